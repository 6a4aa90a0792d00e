#!/usr/bin/env bash
# Session 4 of 2026-11-29, call 1, on 3111bfa: the BART family's graphed decoder on CUDA: exactness and syncs per
# step (encdec_syncs.py), the CUDA classes of tests/test_piecewise_bart.py and tests/test_piecewise_whisper.py (fp32,
# bf16), and the bart-base and whisper-small bench cases, stock / flag / upstream / floor
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: 3111bfa"; } | tee $OUT/device.txt
timeout 200 python3 docs/gpu-runs/2026-11-29-session4/call1/encdec_syncs.py > $OUT/encdec_syncs.txt 2>&1; echo "syncs exit $?"; grep -v "^\[transformers\]" $OUT/encdec_syncs.txt | grep -v "^\s*$" | tail -14
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_piecewise_bart.py tests/test_piecewise_whisper.py -k "Cuda or cuda" > $OUT/cuda_tests.txt 2>&1; echo "cuda tests exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -8
timeout 200 python3 -m transformers_async_stop.bench --cases bart-base,whisper-small --variants stock,async,upstream,floor --reps 3 --json $OUT/bench.json --markdown $OUT/bench.md > $OUT/bench.txt 2>&1; echo "bench exit $?"; tail -14 $OUT/bench.txt
