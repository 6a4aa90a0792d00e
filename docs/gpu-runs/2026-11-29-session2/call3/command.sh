#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 3: the CUDA classes of what this session changed (the additive mask, OPT read by
# hand, the first padded step's grown mask) and of the padded and hand-read families' files
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: $(cat .gpu_commit)"; } | tee $OUT/device.txt
TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_additive_mask.py tests/test_piecewise_opt.py tests/test_piecewise.py tests/test_redteam_padded_masks.py tests/test_piecewise_families.py tests/test_piecewise_found_families.py tests/test_verify_scores_survive_later_replays.py -k "Cuda or cuda" > $OUT/cuda_tests.txt 2>&1; echo "exit $?"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/cuda_tests.txt | tail -25
