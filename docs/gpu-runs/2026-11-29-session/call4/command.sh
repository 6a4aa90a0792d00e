#!/usr/bin/env bash
# The final GPU call of 2026-11-29, part 2: the bench's real-workload cases (issue 44), stock / flag / floor
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: main at $(cat .gpu_commit)"; } | tee $OUT/device.txt
echo "=== eager-attention CUDA classes after the test fix"; TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_piecewise_attention_implementations.py -k "Cuda" > $OUT/eager_cuda.txt 2>&1; grep -E "^FAILED|passed|failed" $OUT/eager_cuda.txt | tail -4
echo "=== bench"; timeout 440 python3 -m transformers_async_stop.bench --cases varied-lengths-llama-1b,padded-batches-llama-1b,conversation-llama-1b,olmo-1b --variants stock,async,upstream,floor --reps 3 --back-to-back 1 --json $OUT/workloads.json --markdown $OUT/workloads.md > $OUT/bench.txt 2>&1; echo "exit $?"; tail -45 $OUT/bench.txt
