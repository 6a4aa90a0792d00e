#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 6: the final tree's CUDA checks of what changed after call 4 (the stop check's
# finish, the pack_gqa shortcut split) and the no-sync cases of the padded first step
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: 7596b17 (+ this call's command)"; } | tee $OUT/device.txt
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_additive_mask.py tests/test_cuda.py tests/test_redteam_padded_masks.py tests/test_usage_found_family_holes.py -k "Cuda or cuda or StreamerRaising" > $OUT/cuda_tests.txt 2>&1; echo "exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -15
