#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 5: where call 3's one sync per call comes from (sync_trace.py)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_ASYNC_STOP_FORCE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 docs/gpu-runs/2026-11-29-session2/call5/sync_trace.py > $OUT/sync_trace.txt 2>&1; echo "exit $?"; grep -v Warning $OUT/sync_trace.txt | grep -E "===|File .*(transformers_async_stop|transformers/)" | tail -60
