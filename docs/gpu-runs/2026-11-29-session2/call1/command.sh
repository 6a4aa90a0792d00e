#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 1: issue 44's padded batches per batch size, after the first padded step takes the
# grown 4D mask (731270e). Per step (the bench's N-token minus 1-token method, warm KV lengths) at b1, b4 and b8,
# padded and not, with the floor; then the per-size padded workloads (cold and warm passes, prefill included).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: main at $(git rev-parse --short HEAD 2>/dev/null || cat .gpu_commit)"; } | tee $OUT/device.txt
for b in 1 4 8; do
  echo "=== per step, b$b"
  timeout 150 python3 -m transformers_async_stop.bench --cases llama-1b --modes eager --batch $b --variants stock,async,floor --reps 3 --json $OUT/step_b$b.json --markdown $OUT/step_b$b.md > $OUT/step_b$b.txt 2>&1; echo "exit $?"; grep -E "llama-1b eager" $OUT/step_b$b.txt | tail -6
done
echo "=== workloads"
timeout 240 python3 -m transformers_async_stop.bench --cases padded-b1-llama-1b,padded-b4-llama-1b,padded-b8-llama-1b --variants stock,async,upstream,floor --reps 1 --json $OUT/workloads.json --markdown $OUT/workloads.md > $OUT/workloads.txt 2>&1; echo "exit $?"; tail -30 $OUT/workloads.txt
