#!/usr/bin/env bash
# Session 4 of 2026-11-29, call 3, on the final tree (T5 merged, the recorder split, the t5-base bench case): the
# encoder-decoder bench cases, stock / flag / upstream / floor, 3 reps
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: ${TREE:-see README}"; } | tee $OUT/device.txt
timeout 400 python3 -m transformers_async_stop.bench --cases bart-base,t5-base,whisper-small --variants stock,async,upstream,floor --reps 3 --json $OUT/bench.json --markdown $OUT/bench.md > $OUT/bench.txt 2>&1; echo "bench exit $?"; tail -16 $OUT/bench.txt
