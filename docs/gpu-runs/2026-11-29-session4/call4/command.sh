#!/usr/bin/env bash
# Session 4 of 2026-11-29, call 4, on 5cea088 (the review mend: one interceptor factory, the encoder length keyed only
# for T5's cut): the CUDA classes of the encoder-decoder files, the latent-attention file and test_piecewise.py
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: 5cea088"; } | tee $OUT/device.txt
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_piecewise_bart.py tests/test_piecewise_t5.py tests/test_piecewise_whisper.py tests/test_piecewise_latent_attention.py tests/test_piecewise.py -k "Cuda or cuda" > $OUT/cuda_tests.txt 2>&1; echo "cuda tests exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -10
