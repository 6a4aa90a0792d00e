#!/usr/bin/env bash
# Session 4 of 2026-11-29, call 2, on the final package tree (BART's family and T5's graphed, merged; the recorder
# split): syncs per step and exactness of every encoder-decoder family (call 1's encdec_syncs.py), and the CUDA
# classes of the encoder-decoder files, the graphed forward's main files and test_cuda.py (no-sync cases among them)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: ${TREE:-see README}"; } | tee $OUT/device.txt
timeout 150 python3 docs/gpu-runs/2026-11-29-session4/call1/encdec_syncs.py > $OUT/encdec_syncs.txt 2>&1; echo "syncs exit $?"; grep -v "^\[transformers\]" $OUT/encdec_syncs.txt | grep -v "^\s*$" | tail -14
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 400 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_piecewise_bart.py tests/test_piecewise_t5.py tests/test_piecewise_whisper.py tests/test_redteam_bart_graphs.py tests/test_piecewise_latent_attention.py tests/test_piecewise.py tests/test_piecewise_families.py tests/test_piecewise_found_families.py tests/test_additive_mask.py tests/test_cuda.py -k "Cuda or cuda" > $OUT/cuda_tests.txt 2>&1; echo "cuda tests exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -15
