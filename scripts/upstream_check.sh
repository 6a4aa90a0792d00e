#!/usr/bin/env bash
# The upstream patch series (upstream/*.patch) against the transformers 5.24.0 sdist, with nothing but the package
# index: `nox -s upstream` runs this script (CI too). The series targets 5.24.0, the release pip installs, and does
# not apply to 5.23.0 (5.24.0 renamed `past_key_values` to `cache` and made static layers croppable: see
# docs/upstream-pr.md, "Which release").
#
#   1. downloads the 5.24.0 sdist from the package index and applies the series to it, one patch at a time, each
#      checked with `git apply --check` first, then committed with `git am` (a patch that does not apply cleanly
#      fails the check);
#   2. one virtualenv (torch 2.13.0 CPU, unpatched transformers 5.24.0 from the index, pytest, parameterized),
#      reused while its pins stay the same; the patched transformers is installed from the patched source tree into
#      its own `pip install --target` directory, which goes first on PYTHONPATH;
#   3. runs the series' own tests (tests/generation/test_async_stopping_criteria.py, added by the series; they
#      need only transformers, torch, pytest and parameterized) against the patched transformers;
#   4. runs the project's equality cases (tests/upstream_equality.py) once against unpatched 5.24.0 and once
#      against the patched one (flag off and flag on), with the plug-in not imported, and compares them bit for bit.
#
# Work directory: $UPSTREAM_WORK (default .nox/_upstream). Python: $PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=5.24.0
TORCH=2.13.0
PY=${PYTHON:-python3}
WORK=${UPSTREAM_WORK:-$ROOT/.nox/_upstream}
VENV=$WORK/venv
PATCHED=$WORK/patched
export HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
start=$SECONDS
step() { echo "== [$((SECONDS - start)) s] $*"; }
mkdir -p "$WORK"

step "1. transformers $VERSION sdist from the package index, and the series"
rm -rf "$WORK/sdist" "$PATCHED"
mkdir -p "$WORK/sdist"
"$PY" -m pip download -q --no-deps --no-binary :all: "transformers==$VERSION" -d "$WORK/sdist"
# --no-same-owner: run as root, tar would keep the archive's owner, and git refuses a repository owned by another user
tar --no-same-owner -xzf "$WORK/sdist/transformers-$VERSION.tar.gz" -C "$WORK/sdist"
SRC=$WORK/sdist/transformers-$VERSION
# its own repository: `git apply` run inside another work tree (this one) would skip paths outside it silently
git -C "$SRC" init -q
git -C "$SRC" add -A
git -C "$SRC" -c user.name=check -c user.email=check@localhost commit -q -m "transformers $VERSION sdist"
shopt -s nullglob
patches=("$ROOT"/upstream/*.patch)
[[ ${#patches[@]} -gt 0 ]] || { echo "no patches in upstream/"; exit 1; }
for patch in "${patches[@]}"; do
  git -C "$SRC" apply --check "$patch" || { echo "FAIL: $(basename "$patch") does not apply cleanly"; exit 1; }
  git -C "$SRC" -c user.name=check -c user.email=check@localhost am -q "$patch"
  echo "applied $(basename "$patch")"
done

step "2. the virtualenv (torch $TORCH, transformers $VERSION) and the patched transformers"
wanted="$("$PY" -c 'import sys; print(sys.version)') torch==$TORCH transformers==$VERSION pytest parameterized"
if [[ ! -x $VENV/bin/python || "$(cat "$VENV/.installed" 2>/dev/null)" != "$wanted" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # --no-compile: byte-compiling torch and transformers is most of the install time on a 2-core machine
  "$VENV/bin/python" -m pip install -q --no-compile "torch==$TORCH" "transformers==$VERSION" pytest parameterized
  echo "$wanted" > "$VENV/.installed"
fi
"$VENV/bin/python" -m pip install -q --no-compile --no-deps --target "$PATCHED" "$SRC"
PYTHON_BIN=$VENV/bin/python
"$PYTHON_BIN" -c "import transformers; assert '/site-packages/' in transformers.__file__, transformers.__file__"
PYTHONPATH=$PATCHED "$PYTHON_BIN" -c "
import transformers
from transformers.generation.configuration_utils import GenerationConfig
assert transformers.__file__.startswith('$PATCHED/'), transformers.__file__
assert hasattr(GenerationConfig(), 'async_stopping_criteria'), 'the series is not in the patched install'
print('patched transformers', transformers.__version__, 'from', transformers.__file__)"

# Steps 3 and 4 share the two cores: the unpatched equality run goes in the background while the series' tests run.
# One thread per process, in both equality runs: a different thread count changes float reductions, and the
# comparison is bit for bit.
export OMP_NUM_THREADS=1
step "3. the series' own tests, on the patched transformers (and, alongside, the equality cases on unpatched $VERSION)"
"$PYTHON_BIN" tests/upstream_equality.py run "$WORK/stock.pt" > "$WORK/stock.log" 2>&1 &
stock_run=$!
(cd "$SRC" && PYTHONPATH=$PATCHED "$PYTHON_BIN" -m pytest -q -p no:cacheprovider \
  tests/generation/test_async_stopping_criteria.py) || { kill "$stock_run" 2> /dev/null; exit 1; }

step "4. the equality cases: unpatched $VERSION vs patched (flag off, flag on), the plug-in not imported"
PYTHONPATH=$PATCHED "$PYTHON_BIN" tests/upstream_equality.py run "$WORK/patched.pt" --patched \
  > "$WORK/patched.log" 2>&1 || { tail -30 "$WORK/patched.log"; kill "$stock_run" 2> /dev/null; exit 1; }
wait "$stock_run" || { tail -30 "$WORK/stock.log"; exit 1; }
"$PYTHON_BIN" tests/upstream_equality.py compare "$WORK/stock.pt" "$WORK/patched.pt"
step "done"
