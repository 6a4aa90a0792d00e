#!/usr/bin/env bash
# The final GPU call of 2026-11-29: what this session changed, on one H200, transformers 5.24.0 (carried wheel)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: main at $(cat .gpu_commit)"; } | tee $OUT/device.txt
echo "=== 1. CUDA classes"; TRANSFORMERS_ASYNC_STOP_FORCE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_piecewise*.py tests/test_verify_scores_survive_later_replays.py tests/test_draft_prefill.py tests/test_redteam_verify.py tests/test_step_checks.py tests/test_capture_safety.py tests/test_graphed_default_deny.py tests/test_changes_between_steps_seen.py tests/test_assisted_host_reads.py tests/test_peft.py tests/test_assisted.py tests/test_cuda.py tests/test_attention_lengths_reported.py tests/test_found_family_recordings.py tests/test_attention_backend_settings.py -k "Cuda or cuda or Capture" > $OUT/cuda_tests.txt 2>&1; grep -E "^FAILED|passed|failed" $OUT/cuda_tests.txt | tail -12
echo "=== 2. item 1 (stock and flag in separate processes)"; timeout 80 python3 tests/repro_assisted_found_families.py > $OUT/repro.txt 2>&1; grep -v Warn $OUT/repro.txt | tail -4
echo "=== 3. StaticCacheOverflow matrix"; timeout 130 python3 scripts/assisted_static_524.py --matrix > $OUT/overflow.txt 2>&1; echo "exit $?"; tail -22 $OUT/overflow.txt
echo "=== 4. stock repeatable in one process? the flag equal? (cuDNN SDPA default)"; timeout 90 python3 docs/gpu-runs/2026-11-29-session/cold_options.py --repeat --tokens 48 2>&1 | grep -v Warn | tee $OUT/repeat.txt | tail -8
