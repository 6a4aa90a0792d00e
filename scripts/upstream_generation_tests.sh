#!/usr/bin/env bash
# transformers' own generation tests, taken at run time from a git copy of the upstream repository at tag v5.24.0
# (never copied into this repository), run on unpatched transformers 5.24.0 and on 5.24.0 with the upstream series
# (upstream/*.patch), with the flag off and on (every call, the deferred stop check taken on the CPU too): all three
# must have the same outcomes. Local only (CI has no GitHub access).
#
#   bash scripts/upstream_generation_tests.sh GIT_DIR|TESTS_ROOT [pytest args...]
#
# GIT_DIR: a git directory of huggingface/transformers that has the tag (a bare mirror works, e.g. what the `fetch`
# tool gives under /work/.mirror), or TESTS_ROOT: a folder laid out like the repository's root (tests/, and
# conftest.py, utils/, src/ where it has them), used in place (e.g. test files assembled by hand).
# Needs scripts/upstream_check.sh to have run first (its virtualenv provides torch
# and unpatched 5.24.0, its --target folder the patched transformers); a second virtualenv with the tests' extra
# dependencies is made next to it. Files: tests/generation/test_utils.py and the Llama, GPT-2, T5 and Whisper model
# tests ($UPSTREAM_TEST_FILES overrides the list). Each run writes a JUnit XML; the end compares the two, test by test.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MIRROR=${1:?usage: $0 GIT_DIR_OF_TRANSFORMERS [pytest args...]}
shift
TAG=${UPSTREAM_TAG:-v5.24.0}
WORK=${UPSTREAM_WORK:-$ROOT/.nox/_upstream}
FILES=${UPSTREAM_TEST_FILES:-tests/generation/test_utils.py tests/models/llama/test_modeling_llama.py \
tests/models/gpt2/test_modeling_gpt2.py tests/models/t5/test_modeling_t5.py tests/models/whisper/test_modeling_whisper.py}
PY=${PYTHON:-python3}
VENV=$WORK/gen-venv
PATCHED=$WORK/patched
[[ -d $PATCHED/transformers ]] || { echo "run scripts/upstream_check.sh first (it builds $PATCHED)"; exit 1; }
start=$SECONDS
step() { echo "== [$((SECONDS - start)) s] $*"; }

if [[ -d $MIRROR/tests ]]; then
  TESTS=$(cd "$MIRROR" && pwd)
  step "the tests in $TESTS (used in place)"
else
  step "the tests at $TAG from $MIRROR"
  git --git-dir="$MIRROR" rev-parse --verify -q "$TAG^{commit}" > /dev/null || { echo "no tag $TAG in $MIRROR"; exit 1; }
  TESTS=$WORK/upstream-tests
  rm -rf "$TESTS"
  mkdir -p "$TESTS"
  paths=()
  # src: tests/test_pipeline_mixin.py imports src/transformers/__init__.py by its path from the repository's root
  for path in conftest.py pyproject.toml setup.cfg utils src tests; do
    git --git-dir="$MIRROR" cat-file -e "$TAG:$path" 2> /dev/null && paths+=("$path")
  done
  git --git-dir="$MIRROR" archive "$TAG" "${paths[@]}" | tar --no-same-owner -x -C "$TESTS"
fi
for file in $FILES; do [[ -f $TESTS/$file ]] || { echo "$file is not in $TESTS"; exit 1; }; done

# transformers' `testing` extra pins a package the index here does not have (transformers-mic): its pytest plugins
# and test helpers are listed instead (httpx: tests/utils/test_configuration_utils.py imports it)
DEPS="torch==2.13.0 transformers==5.24.0 accelerate pytest pytest-xdist pytest-timeout pytest-rerunfailures pytest-order
pytest-asyncio pytest-env parameterized timeout-decorator httpx"
step "the tests' virtualenv ($(echo $DEPS))"
wanted="$("$PY" -c 'import sys; print(sys.version)') $(echo $DEPS)"
if [[ ! -x $VENV/bin/python || "$(cat "$VENV/.installed" 2> /dev/null)" != "$wanted" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-compile $DEPS
  echo "$wanted" > "$VENV/.installed"
fi

run() {  # $1: stock, patched or patched-flag-on; $2: its PYTHONPATH; $3: pytest's own options; the rest: extra pytest arguments
  local name=$1 path=$2 own=$3 started=$SECONDS
  shift 3
  step "$name: pytest" $FILES "$@"
  # -o addopts="": the repository's pyproject adds doctest options that do not apply to these files
  (cd "$TESTS" && PYTHONPATH=$path HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -p no:cacheprovider -q $own \
    -o addopts="" --junitxml="$WORK/generation-tests-$name.xml" $FILES "$@" > "$WORK/generation-tests-$name.log" 2>&1) ||
    true  # failures are compared below, test by test
  grep -E "^upstream_flag_on_plugin" "$WORK/generation-tests-$name.log" || true
  tail -1 "$WORK/generation-tests-$name.log"
  echo "$name: $((SECONDS - started)) s"
}
run stock "" "-n 2" "$@"
run patched "$PATCHED" "-n 2" "$@"
# the series' flag on for every call, the deferred stop check on the CPU too (scripts/upstream_flag_on_plugin.py); one
# process, so that the plugin's count of deferred calls covers every test
run patched-flag-on "$PATCHED:$ROOT/scripts" "-p upstream_flag_on_plugin" "$@"

step "stock vs patched, test by test"
"$VENV/bin/python" - "$WORK/generation-tests-stock.xml" "$WORK/generation-tests-patched.xml" \
  "$WORK/generation-tests-patched-flag-on.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    result = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
    return result


stock, patched, flag_on = (outcomes(p) for p in sys.argv[1:4])
changed = []
for label, found in (("stock 5.24.0", stock), ("patched 5.24.0", patched), ("patched 5.24.0, flag on", flag_on)):
    counts = {k: sum(v == k for v in found.values()) for k in ("passed", "failure", "error", "skipped")}
    print(f"{label}: {len(found)} tests: {counts['passed']} passed, {counts['failure']} failed, "
          f"{counts['error']} errors, {counts['skipped']} skipped")
    if found is stock:
        continue
    differ = sorted(n for n in stock.keys() | found.keys() if stock.get(n) != found.get(n))
    for name in differ:
        print(f"  {name}: stock {stock.get(name, 'absent')}, {label} {found.get(name, 'absent')}")
    changed += differ
print("same outcomes" if not changed else f"{len(changed)} tests differ")
sys.exit(1 if changed else 0)
EOF
