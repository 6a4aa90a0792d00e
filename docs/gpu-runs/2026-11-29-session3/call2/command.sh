#!/usr/bin/env bash
# Session 3 of 2026-11-29, call 2, on 47635ac: encoder-decoders on the dynamic-cache loop and Whisper's graphed decoder
# on CUDA: exactness and syncs per step for tiny BART, T5, Whisper and the Whisper-small-shaped model (encdec_syncs.py),
# the Whisper graphed forward's CUDA classes (fp32, bf16), and the whisper-small bench case, stock / flag / upstream /
# floor
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; git log -1 --format='tree: %h' 2>/dev/null; } | tee $OUT/device.txt
timeout 200 python3 docs/gpu-runs/2026-11-29-session3/call2/encdec_syncs.py > $OUT/encdec_syncs.txt 2>&1; echo "syncs exit $?"; grep -v "^\s*$" $OUT/encdec_syncs.txt | tail -8
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_piecewise_whisper.py -k "Cuda or cuda" > $OUT/cuda_whisper.txt 2>&1; echo "whisper cuda exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_whisper.txt | tail -5
timeout 240 python3 -m transformers_async_stop.bench --cases whisper-small --variants stock,async,upstream,floor --reps 3 --json $OUT/bench_whisper.json --markdown $OUT/bench_whisper.md > $OUT/bench_whisper.txt 2>&1; echo "bench exit $?"; tail -25 $OUT/bench_whisper.txt
