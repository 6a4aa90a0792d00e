#!/usr/bin/env bash
# One call on a GPU machine: CUDA tests on transformers 5.0.0, 5.17.0 and 5.23.0, stream-op costs, benchmark,
# and (on a machine with two GPUs) the multi-GPU tests: device_map, tensor parallel, synced_gpus over NCCL.
#   bash scripts/gpu_check.sh [tests|bench|multi|all|tests,multi] [extra bench args for 5.23...]
# Environment: VERSIONS="t500 t517 t523" (which releases), BENCH_OLD_CASES (cases for 5.0/5.17),
#              BENCH_TRACE=1 (Chrome traces of the 5.23 cases)
# transformers 5.17.0 is the device image's own; 5.0.0 and 5.23.0 travel as wheels in .whl/ (docs/gpu-runs.md).
# Everything lands in $OUT/gpu-check.tgz (the device returns at most 8 files); the summary goes to stdout.
set -u
what=${1:-all}; shift || true
final=${OUT:-gpu-out}; mkdir -p "$final"
out=$(mktemp -d)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/device.txt"

site() {  # the carried wheels of one transformers release, in a folder of their own
  local tag=$1 dir=/tmp/site_$1
  if [ ! -d "$dir" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" \
      .whl/common/*.whl $( [ "$tag" != common ] && echo .whl/$tag/*.whl ) >/dev/null || exit 1
  fi
  echo "$dir"
}

has() { case ",$what," in *",$1,"*|*",all,"*) return 0 ;; *) return 1 ;; esac; }

if has tests; then
  python3 scripts/stream_overhead.py | tee "$out/stream_overhead.txt"
fi
for tag in ${VERSIONS:-t500 t517 t523}; do
  case $tag in t517) dir=$(site common) ;; *) dir=$(site $tag) ;; esac
  export PYTHONPATH="$dir:$PWD"
  ver=$(python3 -c "import transformers; print(transformers.__version__)")
  echo "=== transformers $ver"
  if has tests; then
    python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py > "$out/pytest_$ver.txt" 2>&1
    grep -E "SYNCS|passed|failed|Error" "$out/pytest_$ver.txt" | tail -40
  fi
  if has multi; then
    NCCL_NVLS_ENABLE=0 python3 -m pytest -q -s -p no:cacheprovider tests/test_device_map.py \
      tests/test_tensor_parallel.py tests/test_distributed.py > "$out/multi_$ver.txt" 2>&1
    grep -E "SYNCS|passed|failed|Error" "$out/multi_$ver.txt" | tail -40
  fi
  if has bench; then
    if [ "$tag" = t523 ]; then args=("$@"); else args=(--cases "${BENCH_OLD_CASES:-tiny-llama,gpt2}"); fi
    [ -n "${BENCH_TRACE:-}" ] && [ "$tag" = t523 ] && args+=(--trace "$out/traces")
    python3 -m transformers_async_stop.bench "${args[@]}" --json "$out/bench_$ver.json" \
      --markdown "$out/bench_$ver.md" --png "$out/bench_$ver.png" 2>"$out/bench_$ver.log" | tee "$out/bench_$ver.txt"
  fi
done
tar czf "$final/gpu-check.tgz" -C "$out" .
