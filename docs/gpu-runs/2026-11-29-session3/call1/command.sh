#!/usr/bin/env bash
# Session 3 of 2026-11-29, call 1: the CUDA classes of the multi-head latent attention's graphed forward (3f6c07d),
# fp32 and bf16 each in a process of its own (a device fault would end the process's CUDA context)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: 3f6c07d"; } | tee $OUT/device.txt
for sel in "fp32:LatentAttentionOnCuda and not Bf16" "bf16:LatentAttentionOnCudaBf16"; do
  name=${sel%%:*}
  TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_piecewise_latent_attention.py -k "${sel#*:}" > $OUT/cuda_$name.txt 2>&1; echo "$name exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_$name.txt | tail -8
done
