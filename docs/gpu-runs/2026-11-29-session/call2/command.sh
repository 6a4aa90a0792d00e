#!/usr/bin/env bash
# GPU call A (2026-11-29): issue 43 item 1 on CUDA, the CUDA classes after the proof pipeline, issue 44's cold lengths
set -u
export PYTHONUNBUFFERED=1 TRANSFORMERS_ASYNC_STOP_FORCE=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; echo "tree: main at $(cat .gpu_commit)"; } | tee $OUT/device.txt
echo "=== item 1 repro"; timeout 150 python3 tests/repro_assisted_found_families.py > $OUT/repro.txt 2>&1; grep -v Warn $OUT/repro.txt | tail -12
echo "=== CUDA classes"; timeout 330 python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_piecewise*.py tests/test_verify_scores_survive_later_replays.py tests/test_draft_prefill.py tests/test_redteam_verify.py tests/test_step_checks.py tests/test_capture_safety.py tests/test_graphed_default_deny.py tests/test_changes_between_steps_seen.py tests/test_assisted_host_reads.py tests/test_peft.py tests/test_assisted.py tests/test_cuda.py tests/test_attention_lengths_reported.py -k "Cuda or cuda or Capture" > $OUT/cuda_tests.txt 2>&1; grep -E "^FAILED|passed|failed" $OUT/cuda_tests.txt | tail -15
echo "=== cold lengths"; timeout 300 python3 docs/gpu-runs/2026-11-29-session/cold_options.py --calls 8 --tokens 32 --variants default,nocudnn,avoid 2>&1 | tee $OUT/cold_options.txt | tail -20
