#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 4: issue 44's padded batches per size after the additive mask (cb87ace) and the first
# padded step's grown mask (731270e): per step at b1 and b8 (padded and not), then the per-size padded workloads
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
res=$(mktemp -d)
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: $(cat .gpu_commit)"; } | tee $res/device.txt
echo "=== the additive mask's CUDA class after the no-sync test's fix"
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_additive_mask.py -k Cuda > $res/cuda_additive.txt 2>&1; grep -E "^FAILED|passed|failed" $res/cuda_additive.txt | tail -4
for b in 1 8; do
  echo "=== per step, b$b"
  timeout 130 python3 -m transformers_async_stop.bench --cases llama-1b --modes eager --batch $b --variants stock,async,floor --reps 3 --json $res/step_b$b.json --markdown $res/step_b$b.md > $res/step_b$b.txt 2>&1; echo "exit $?"; grep -E "^llama-1b eager b" $res/step_b$b.txt | tail -4
  tar czf $OUT/call4.tgz -C $res .
done
echo "=== workloads"
timeout 230 python3 -m transformers_async_stop.bench --cases padded-b1-llama-1b,padded-b4-llama-1b,padded-b8-llama-1b --variants stock,async,upstream,floor --reps 1 --json $res/workloads.json --markdown $res/workloads.md > $res/workloads.txt 2>&1; echo "exit $?"; tail -12 $res/workloads.txt
tar czf $OUT/call4.tgz -C $res .
