#!/usr/bin/env bash
# Session 2 of 2026-11-29, call 2: where a padded decode step's extra host time goes (padded_probe.py)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/common/*.whl .whl/t524/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 docs/gpu-runs/2026-11-29-session2/padded_probe.py > $OUT/padded_probe.txt 2>&1; echo "exit $?"; cat $OUT/padded_probe.txt | cut -c1-400
