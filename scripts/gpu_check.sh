#!/usr/bin/env bash
# One call on a GPU machine: CUDA tests on transformers 5.0.0, 5.17.0 and 5.23.0, then the benchmark.
# Usage (device root = repo root, wheels carried in .whl/, see docs/gpu-runs.md):
#   bash scripts/gpu_check.sh [tests|bench|all] [extra bench args...]
# Logs go to $OUT (or ./gpu-out): pytest_<version>.txt, bench_<version>.{json,md,png}.
set -u
what=${1:-all}; shift || true
out=${OUT:-gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$out/device.txt"

site() {  # install the carried wheels of one transformers release into its own folder
  local tag=$1 dir=/tmp/site_$1
  if [ ! -d "$dir" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" \
      .whl/common/*.whl $( [ "$tag" != common ] && [ -d .whl/$tag ] && echo .whl/$tag/*.whl ) >/dev/null || exit 1
  fi
  echo "$dir"
}

for tag in t500 t517 t523; do
  case $tag in t517) dir=$(site common) ;; *) dir=$(site $tag) ;; esac
  export PYTHONPATH="$dir:$PWD"
  ver=$(python3 -c "import transformers; print(transformers.__version__)")
  echo "=== transformers $ver"
  if [ "$what" = tests ] || [ "$what" = all ]; then
    python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/pytest_$ver.txt" \
      | grep -E "SYNCS|passed|failed|Error" | tail -40
  fi
  if [ "$what" = bench ] || [ "$what" = all ]; then
    if [ "$tag" = t523 ]; then cases=(); else cases=(--cases "${BENCH_OLD_CASES:-tiny-llama,gpt2}"); fi
    python3 -m transformers_async_stop.bench "${cases[@]}" "$@" --json "$out/bench_$ver.json" \
      --markdown "$out/bench_$ver.md" --png "$out/bench_$ver.png" 2>"$out/bench_$ver.log" | tail -40
  fi
done
