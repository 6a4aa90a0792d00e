#!/usr/bin/env bash
# Session 3 of 2026-11-29, call 3, on a31255d (the recorder and the step checks split out of graphs.py and forward.py):
# the CUDA classes of the files the stop touched and of the graphed forward's main files, and test_cuda.py (no-sync
# cases among them)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: a31255d"; } | tee $OUT/device.txt
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_piecewise_latent_attention.py tests/test_piecewise_whisper.py tests/test_piecewise.py tests/test_piecewise_families.py tests/test_piecewise_found_families.py tests/test_additive_mask.py tests/test_cuda.py -k "Cuda or cuda" > $OUT/cuda_tests.txt 2>&1; echo "exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -15
