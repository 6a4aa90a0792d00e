#!/usr/bin/env bash
# One call on a GPU machine checks and times everything asked for, per transformers release:
#   bash scripts/gpu_check.sh [what] [extra bench args...]
# what: a comma list of
#   tests     CUDA tests (tests/test_cuda.py, tests/test_static_loop.py, the CUDA classes of the files in NEW_CUDA,
#             tests/test_assisted.py -k Cuda)
#   overhead  the package's own host time per decode step (scripts/own_overhead.py)
#   profile   where a decode step's host time goes, stock / upstream / imported / async (scripts/host_profile.py)
#   bench     the benchmark (python -m transformers_async_stop.bench), extra args passed through
#   multi     on two GPUs: device_map, tensor parallel, synced_gpus over NCCL
#   multi2    on two GPUs: stock vs flag ms/token, syncs per step and GPU busy per device, Llama-8B-shaped split by
#             device_map and tensor parallel (scripts/multi_gpu_bench.py; MULTI_BENCH_ARGS, e.g. "--quick" or
#             "--configs dm-static-b8"; T_MULTI2, default 540 s: run it alone in a call)
#   fuzz      the differential fuzz on CUDA (TAS_FUZZ_DRAWS draws, default 200)
#   usage     the usage fuzzer on CUDA (scripts/usage_fuzz.py, USAGE_DRAWS scenarios, default 1000), once per seed in
#             USAGE_SEEDS (default 0; a seed repeated runs the same scenarios again, under the same load)
#   seeds     the usage fuzzer's scenarios of the seeds in USAGE_ONLY (a comma list: the failing seeds of an earlier
#             CUDA run) on CUDA, shrunk where they fail
#   old       OLD_TESTS (pytest paths; default tests/test_thread_streams.py) on this tree, and (where .old/ holds an
#             earlier copy of the package, made with `git archive <commit> transformers_async_stop | tar -x -C .old`)
#             on that copy: a test of a fix should fail there. OLD_REPEAT: runs of each. `threads` is the same mode
#   targets   issue 17's ratios side by side (scripts/static_dynamic_ratios.py) and generate()'s own host time per
#             dynamic-cache step outside the forward (scripts/host_profile.py --outside-forward)
#   blog      the blog's experiment: a static-cache generate() inside @torch.inference_mode(), Llama-1B-shaped bf16
#             and #43089's tiny Llama, stock / upstream / flag side by side (scripts/inference_mode_blog.py)
#   issue31   the CUDA classes of the default-deny, peft, path-report and piecewise tests (issues 31 and 33)
#   issue37   issue 37's CUDA checks: the sequence mirror and seed 297's mechanism (tests/test_assisted_mirror.py,
#             tests/test_usage_holes.py), and 5.24's static cache with an assistant, each case in its own process
#             (tests/test_assisted_static_524.py, scripts/assisted_static_524.py --log)
#   families  the CUDA classes of the 31 families' graphed forward (found and proven per recording, and the sliding-
#             window layers: issue 36), in FAMILY_WORKERS pytest workers (default 6)
#   paired    the flag's ms/token on Llama-1B-shaped bf16 b1 DynamicCache, this tree against the earlier copy in
#             .old/ (scripts/paired_speed.py), alternating processes, PAIRED_ROUNDS rounds (default 3)
#   lora      the bench's llama-1b-lora case, stock vs flag (which forward a peft LoRA model gets, and its speed)
#   issue38   issue 38's CUDA tests (the graphed acceptance, the draft's hook watch across rounds, the verify forward,
#             the assisted tests), the usage fuzzer's assisted dimension (USAGE_DRAWS, default 300), and where a
#             Llama-1B token's GPU time goes, DynamicCache against static (scripts/kernel_split.py)
#   issue38bench  the assisted bench with stock, flag, upstream and floor (BENCH_REPS, default 5), and the
#             package's host time per assisted round by stage on CUDA (scripts/round_host_cost.py --device cuda;
#             ROUND_COST=0 leaves it out)
#   bound     issue 38's targets with the per-step checks stubbed out beside the flag and stock, rotated rep by rep
#             in one process (scripts/checks_free_bound.py; BOUND_REPS, default 5): what a free check would give
#   all       tests,overhead,bench
# Stage limits (seconds): T_CUDA, T_NEW, T_ASSISTED (the three pytest runs of `tests`), USAGE_TIMEOUT (per seed).
# Environment: VERSIONS="t4576 t500 t517 t523" (which releases; default "t523"), PROFILE_CASES, PROFILE_VARIANTS,
# BENCH_TRACE=1.
# transformers 5.17.0 is the device image's own; the others travel as wheels in .whl/ (docs/gpu-runs.md).
# Everything lands in $OUT/gpu-check.tgz (the device returns at most 8 files), packed again after every stage so that
# a call cut off by its time limit keeps what it finished; a summary goes to stdout.
set -u
what=${1:-all}; shift || true
final=${OUT:-gpu-out}; mkdir -p "$final"
out=$(mktemp -d)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  git log -1 --format='commit %h %s' 2>/dev/null; git status --short 2>/dev/null | head -20; } | tee "$out/device.txt"

pack() {  # after every stage: a call cut off by its time limit still brings back what it finished
  tar czf "$final/gpu-check.tgz" -C "$out" .
}

site() {  # the carried wheels of one transformers release, in a folder of their own
  local tag=$1 dir=/tmp/site_$1
  if [ ! -d "$dir" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" \
      .whl/common/*.whl $( [ "$tag" != common ] && echo .whl/$tag/*.whl ) >/dev/null || exit 1
  fi
  echo "$dir"
}

# every other test file with CUDA classes (their names say Cuda/cuda/Capture; their CPU tests run in CI); the
# multi-GPU files run in `multi`
NEW_CUDA=$(grep -l "cuda.is_available" tests/test_*.py | grep -vE "test_(cuda|static_loop|assisted|device_map|tensor_parallel|distributed)\.py")

has() { case ",$what," in *",$1,"*) return 0 ;; *",all,"*) case $1 in tests|overhead|bench) return 0 ;; esac ;; esac; return 1; }

for tag in ${VERSIONS:-t523}; do
  case $tag in t517) dir=$(site common) ;; *) dir=$(site $tag) ;; esac
  export PYTHONPATH="$dir:$PWD"
  ver=$(python3 -c "import transformers; print(transformers.__version__)")
  echo "=== transformers $ver"
  if has overhead; then
    timeout 120 python3 scripts/own_overhead.py 2>&1 | tee "$out/overhead_$ver.txt"
  fi
  pack
  if has tests; then
    timeout "${T_CUDA:-420}" python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py tests/test_static_loop.py \
      > "$out/pytest_$ver.txt" 2>&1
    grep -E "SYNCS|passed|failed|Error|error" "$out/pytest_$ver.txt" | tail -40
    # the CUDA classes of the newer test files (their CPU tests run in CI)
    timeout "${T_NEW:-300}" python3 -m pytest -q -s -p no:cacheprovider $NEW_CUDA -k "Cuda or cuda or Capture" \
      > "$out/pytest_new_$ver.txt" 2>&1
    grep -E "SYNCS|passed|failed|Error|error" "$out/pytest_new_$ver.txt" | tail -30
    # assisted decoding's CUDA tests (syncs per verify round); its CPU tests run in CI
    timeout "${T_ASSISTED:-200}" python3 -m pytest -q -s -p no:cacheprovider tests/test_assisted.py -k Cuda \
      > "$out/assisted_$ver.txt" 2>&1
    grep -E "CUDA syncs|passed|failed|Error|error" "$out/assisted_$ver.txt" | tail -20
  fi
  pack
  if has issue31; then
    timeout "${T_ISSUE31:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_graphed_default_deny.py \
      tests/test_peft.py tests/test_path_report.py tests/test_piecewise.py tests/test_piecewise_families.py \
      tests/test_default_device.py tests/test_usage_holes.py tests/test_criteria_edits.py \
      $(ls tests/test_redteam_default_deny.py 2>/dev/null) -k "OnCuda or Cuda or cuda" > "$out/issue31_$ver.txt" 2>&1
    grep -E "passed|failed|^FAILED|Error" "$out/issue31_$ver.txt" | tail -25
  fi
  pack
  if has issue37; then
    timeout "${T_ISSUE37:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_assisted_mirror.py \
      tests/test_usage_holes.py tests/test_assisted_static_524.py -k "Cuda or cuda" > "$out/issue37_$ver.txt" 2>&1
    grep -E "passed|failed|^FAILED|Error" "$out/issue37_$ver.txt" | tail -15
    case $ver in 5.2[4-9]*|5.[3-9]*)  # 5.24 accepts a static cache with an assistant; earlier releases raise
      timeout "${T_STATIC524:-150}" python3 scripts/assisted_static_524.py --log > "$out/static524_$ver.txt" 2>&1
      echo "--- static524 (exit $?)"; grep -vE "Warning|warn\(" "$out/static524_$ver.txt" | tail -20 ;;
    esac
  fi
  pack
  if has families; then
    timeout "${T_FAMILIES:-240}" python3 -m pytest -q -p no:cacheprovider -n "${FAMILY_WORKERS:-6}" \
      tests/test_piecewise_found_families.py tests/test_piecewise_sliding.py tests/test_piecewise_families.py \
      -k "Cuda" > "$out/families_$ver.txt" 2>&1
    grep -E "passed|failed|^FAILED|Error" "$out/families_$ver.txt" | tail -25
  fi
  pack
  if has paired; then
    for r in $(seq "${PAIRED_ROUNDS:-3}"); do
      for root in ${PAIRED_ROOTS:-.old .}; do  # PAIRED_ROOTS=". .old": this tree first in each round
        label=$( [ "$root" = . ] && echo HEAD || cat .old/COMMIT )
        [ -d "$root/transformers_async_stop" ] && timeout 120 python3 scripts/paired_speed.py --root "$root" \
          --label "$label" 2>/dev/null | tee -a "$out/paired_$ver.jsonl"
      done
    done
  fi
  pack
  if has issue38; then
    # issue 38's cuts on CUDA: the graphed acceptance, the draft's hook watch across rounds, the verify forward, the
    # assisted CUDA tests; the usage fuzzer's assisted dimension; the DynamicCache / static kernel split
    timeout "${T_ISSUE38:-200}" python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_acceptance_graph.py \
      tests/test_piecewise_verify.py tests/test_assisted.py tests/test_unchanged_model_not_walked.py \
      tests/test_draft_hook_watch_across_rounds.py tests/test_forward_hooks.py -k "Cuda or cuda" \
      > "$out/issue38_tests_$ver.txt" 2>&1
    grep -E "passed|failed|^FAILED|Error" "$out/issue38_tests_$ver.txt" | tail -15
    timeout "${USAGE_TIMEOUT:-200}" python3 scripts/usage_fuzz.py --device cuda --require assisted \
      --draws "${USAGE_DRAWS:-300}" --workers "${USAGE_WORKERS:-8}" --shrink 0 > "$out/issue38_fuzz_$ver.txt" 2>&1
    grep -E "^TOTAL|^FAIL" "$out/issue38_fuzz_$ver.txt" | tail -10
    timeout 150 python3 scripts/kernel_split.py --reps 5 > "$out/kernel_split_$ver.txt" 2>&1
    grep -vE "^\{|Warning|warn" "$out/kernel_split_$ver.txt" | tail -14
  fi
  pack
  if has issue38bench; then
    # the issue's targets side by side (wall / floor, flag / stock, upstream's DeferredStopCheck), and the
    # package's host time per round by stage
    timeout 300 python3 -m transformers_async_stop.bench --cases llama-1b-draft,llama-1b-copy,llama-1b-lookup \
      --variants stock,async,upstream,floor --reps "${BENCH_REPS:-5}" > "$out/bench_assisted_$ver.txt" 2>&1
    tail -22 "$out/bench_assisted_$ver.txt"
    if [ "${ROUND_COST:-1}" = 1 ]; then  # ROUND_COST=0: the bench alone
      timeout 240 python3 scripts/round_host_cost.py --device cuda --full --runs 3 --new-tokens 128 \
        > "$out/round_host_cost_$ver.txt" 2>&1
      grep -E "^==|total wall|package-only" "$out/round_host_cost_$ver.txt"
    fi
  fi
  pack
  if has bound; then
    timeout "${T_BOUND:-420}" python3 scripts/checks_free_bound.py --reps "${BOUND_REPS:-5}" \
      > "$out/checks_free_bound_$ver.txt" 2>&1
    grep -vE "^\[|Warning|warn|Passing" "$out/checks_free_bound_$ver.txt" | tail -30
  fi
  pack
  if has lora; then
    timeout 240 python3 -m transformers_async_stop.bench --cases llama-1b-lora,llama-1b --modes eager --batch 1 \
      --variants stock,async --reps "${LORA_REPS:-5}" --json "$out/lora_$ver.json" --markdown "$out/lora_$ver.md" \
      2>"$out/lora_$ver.log" | tee "$out/lora_$ver.txt" | tail -20
  fi
  pack
  if has threads || has old; then
    old_tests=(${OLD_TESTS:-tests/test_thread_streams.py})
    for r in $(seq "${OLD_REPEAT:-1}"); do  # a race: OLD_REPEAT runs of each, to count how often it shows
      if [ -d .old/transformers_async_stop ]; then
        echo "--- run $r: ${old_tests[*]} on the earlier copy in .old/ ($(cat .old/COMMIT 2>/dev/null))"
        # run from .old/: `python -m` puts the working directory first on sys.path, so the old package is imported
        (cd .old && PYTHONPATH="$dir" timeout 200 python3 -m pytest -q -p no:cacheprovider \
          "${old_tests[@]/#/../}" -s) > "$out/old_${ver}_$r.txt" 2>&1
        grep -E "passed|failed|differ|Error" "$out/old_${ver}_$r.txt" | tail -12
      fi
      echo "--- run $r: ${old_tests[*]} on this tree"
      timeout 200 python3 -m pytest -q -p no:cacheprovider "${old_tests[@]}" > "$out/new_${ver}_$r.txt" 2>&1
      grep -E "passed|failed|differ|Error" "$out/new_${ver}_$r.txt" | tail -12
      pack
    done
  fi
  pack
  if has targets; then
    timeout 240 python3 scripts/static_dynamic_ratios.py --reps "${TARGET_REPS:-15}" > "$out/targets_$ver.txt" 2>&1
    tail -12 "$out/targets_$ver.txt"
    [ "${TARGETS_PROFILE:-1}" = 0 ] || timeout 240 python3 scripts/host_profile.py --cases tiny-eager-43089 --variants stock,async-deferred,async \
      --outside-forward --top 12 > "$out/outside_forward_$ver.txt" 2>&1
    grep -sE "^===|^case|^tiny" "$out/outside_forward_$ver.txt" | tail -12
  fi
  pack
  if has blog; then
    timeout 300 python3 scripts/inference_mode_blog.py --reps "${BLOG_REPS:-7}" > "$out/blog_$ver.txt" 2>&1
    echo "--- blog (exit $?)"; grep -vE "Warning|warn\(" "$out/blog_$ver.txt" | tail -14
  fi
  pack
  if has profile; then
    mkdir -p "$out/prof_$ver"
    timeout 300 python3 scripts/host_profile.py --cases "${PROFILE_CASES:-tiny-static,llama1b-static}" \
      --variants "${PROFILE_VARIANTS:-stock,upstream,imported,async}" --gaps \
      --out "$out/prof_$ver" > "$out/profile_$ver.txt" 2>&1
    rm -f "$out/prof_$ver"/*.trace.json  # large; the figures drawn from them are in the text
    grep -E "^===|ms/token|^tiny|^llama|device per step|package|create_masks|prepare_inputs|processors|criteria" \
      "$out/profile_$ver.txt" | tail -60
  fi
  pack
  if has fuzz; then
    TAS_FUZZ_DEVICE=cuda TAS_FUZZ_DRAWS=${TAS_FUZZ_DRAWS:-200} timeout 400 python3 -m pytest -q -p no:cacheprovider \
      tests/test_fuzz.py > "$out/fuzz_$ver.txt" 2>&1
    tail -3 "$out/fuzz_$ver.txt"
  fi
  pack
  if has usage; then
    run=0
    for seed in ${USAGE_SEEDS:-0}; do
      run=$((run + 1))
      timeout "${USAGE_TIMEOUT:-270}" python3 scripts/usage_fuzz.py --device cuda --draws "${USAGE_DRAWS:-1000}" \
        --seed "$seed" --workers "${USAGE_WORKERS:-8}" --shrink 30 --max-failures 5 --json "$out/usage_${ver}_$run.json" \
        > "$out/usage_${ver}_$run.txt" 2>&1
      echo "--- usage run $run (seed $seed)"
      grep -E "^TOTAL|^FAILED|drawn|passed" "$out/usage_${ver}_$run.txt" | tail -12
      pack
    done
  fi
  pack
  if has seeds && [ -n "${USAGE_ONLY:-}" ]; then
    timeout "${USAGE_TIMEOUT:-270}" python3 scripts/usage_fuzz.py --device cuda --only "$USAGE_ONLY" --shrink 30 \
      --max-failures 50 --json "$out/seeds_$ver.json" > "$out/seeds_$ver.txt" 2>&1
    echo "--- usage seeds $USAGE_ONLY"
    grep -E "^FAIL|^TOTAL|drawn|passed" "$out/seeds_$ver.txt" | tail -20
  fi
  pack
  if has multi; then
    timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_device_map.py \
      tests/test_tensor_parallel.py tests/test_distributed.py > "$out/multi_$ver.txt" 2>&1
    grep -E "SYNCS|passed|failed|Error" "$out/multi_$ver.txt" | tail -40
  fi
  pack
  if has multi2; then
    timeout "${T_MULTI2:-540}" python3 scripts/multi_gpu_bench.py ${MULTI_BENCH_ARGS:-} \
      --json "$out/multi_bench_$ver.json" --markdown "$out/multi_bench_$ver.md" \
      > "$out/multi_bench_$ver.txt" 2> "$out/multi_bench_$ver.log"
    echo "--- multi2 (exit $?)"; cat "$out/multi_bench_$ver.md" 2>/dev/null
    grep -E "FAILED|Error|skipped" "$out/multi_bench_$ver.log" | tail -5
  fi
  pack
  if has bench; then
    args=("$@")
    [ -n "${BENCH_TRACE:-}" ] && args+=(--trace "$out/traces")
    python3 -m transformers_async_stop.bench "${args[@]}" --json "$out/bench_$ver.json" \
      --markdown "$out/bench_$ver.md" --png "$out/bench_$ver.png" 2>"$out/bench_$ver.log" | tee "$out/bench_$ver.txt"
  fi
  pack
done
pack
