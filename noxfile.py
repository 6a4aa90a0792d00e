"""Test sessions. `nox` alone runs what CI runs: `nox -s tests releases floor newest_torch upstream` (keep in step with
.ci/run and README.md, "Running the tests"); `nox -s newest` is the porting check for a new transformers release, run
by hand (see `newest`).

- `tests`: the whole suite, one fresh virtualenv per release, on 4.57.6, 5.0.0 and 5.17.0 (the files marked `slow`
  on 5.17.0), in two pytest-xdist workers (CI's two cores). The newest release's whole suite is `newest_torch`'s.
- `releases`: the newest patch of every minor from 5.1 to 5.24 (5.24.0 with torch 2.13.0 here), quickly: the drift test
  (tests/test_patching.py, marked `drift`) plus the tests marked `core` (see pytest.ini), two releases at a time,
  each in one pytest process. The releases share one virtualenv (.nox/_releases/base: torch, the test dependencies,
  this package) and each release is installed, with its own huggingface_hub/tokenizers/..., into its own
  `pip install --target` directory (.nox/_releases/<version>) that goes first on PYTHONPATH. Some releases only:
  `nox -s releases -- 5.9.0 5.23.0`.
- `floor`: the lowest torch and transformers that setup.py declares (TORCH_FLOOR, TRANSFORMERS[0]), together: the
  drift test and the core subset. Its torch comes from the package index with its CUDA libraries (about 5 GB, 5
  minutes on a 2-core machine; the CPU-only builds live on download.pytorch.org, out of reach of some CI hosts).
- `newest_torch`: the whole suite, the files marked `slow` included, on the newest torch (TORCH_NEWEST) with the
  newest supported transformers (NEWEST). The CI
  machines' pip configuration caps torch at the releases on their disk, so this session lifts the cap for its own
  install (NO_TORCH_CAP) and gets torch from the package index with its CUDA libraries (about 2.6 GB of downloads,
  5.4 GB installed).
- `upstream`: the upstream patch series (scripts/upstream_check.sh).

torch is pinned to 2.13.0 in `tests` and `releases`: on the CI machines that is a local CPU build (an unpinned torch
pulls GBs of CUDA wheels).
Every pytest run has one thread per process (OMP_NUM_THREADS=1): two workers, or two releases, on two cores with
torch's default thread count each would oversubscribe them (OpenMP's spinning waits made the suite slower than one
process: 2026-11-27, the 5.24.0 suite 7 min with two workers of one thread, over 18 min with two of two).
Every install passes `--no-compile`: byte-compiling torch and transformers at install time is most of the install time
on a 2-core machine (torch 31 s -> 8 s, one transformers release 18 s -> 5 s); modules are compiled when imported.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox
import nox.command

TORCH = "2.13.0"
TORCH_FLOOR = "2.6.0"  # setup.py's `torch>=2.6`: transformers 5.x's own floor; keep the two in step
TORCH_NEWEST = "2.15.0"  # the newest torch release (`pip index versions torch`)
# The whole suite runs on these (keep in step with README.md, "Supported transformers releases").
TRANSFORMERS = ["4.57.6", "5.0.0", "5.17.0"]
NEWEST = "5.24.0"  # the newest supported release: its whole suite runs on the newest torch (`newest_torch`)
# The newest patch release of every minor between them (`pip index versions transformers`), drift + core tests only.
RELEASES = [
    "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0", "5.8.1", "5.9.0", "5.10.4", "5.11.0",
    "5.12.1", "5.13.1", "5.14.1", "5.15.1", "5.16.1", "5.18.0", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0",
    NEWEST,
]
# peft: real LoRA models (tests/test_peft.py); where it does not import (an older torch, a future peft), they skip
SLOW_ON = ("5.17.0",)  # the releases whose `tests` session also runs the files marked `slow` (and `newest_torch`)
TEST_DEPS = ["accelerate", "pytest", "parameterized", "peft", "pytest-xdist"]
TEST_ENV = {"TRANSFORMERS_ASYNC_STOP_FORCE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
# the whole suite in two worker processes (CI's two cores); `loadscope` keeps a test class on one worker, so a
# class's setUpClass (a model built once) runs once
XDIST = ["-n", "2", "--dist", "loadscope"]
JOBS = 2  # releases run at once by `releases`

# The CI machines' pip configuration (global `constraint` = /etc/xdg/pip/constraints.txt) caps torch at the releases
# on their disk (torch<=2.14.1). An environment variable overrides the configuration file's value; pip ignores an
# empty one, and an empty constraints file lifts the cap. Only the installs that must reach past it pass this.
NO_TORCH_CAP = {"PIP_CONSTRAINT": os.devnull}

nox.options.sessions = ["tests", "releases", "floor", "newest_torch", "upstream"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("transformers", TRANSFORMERS)
def tests(session, transformers):
    session.install("--no-compile", f"torch=={TORCH}")
    # matplotlib: the benchmark's chart is tested on the full-suite releases (the `[bench]` extra)
    session.install("--no-compile", f"transformers=={transformers}", *TEST_DEPS, "matplotlib")
    session.install("--no-deps", "-e", ".")
    # the files marked `slow` (pytest.ini) run on SLOW_ON only: CI's 2 cores and 90 minutes
    marks = [] if transformers in SLOW_ON else ["-m", "not slow"]
    session.run("python", *PYTEST, *XDIST, "tests", *marks, *session.posargs, env=TEST_ENV)


@nox.session(venv_backend="none")
def releases(session):
    """The drift test and the core subset on every release of RELEASES (or those named: `nox -s releases -- 5.9.0`),
    JOBS at a time, each in one pytest process; each release's output is printed when it ends."""
    versions = session.posargs or RELEASES
    unknown = [v for v in versions if not v.replace(".", "").isdigit()]
    if unknown:
        session.error(f"releases: {unknown} are not release numbers (for example `nox -s releases -- 5.9.0`)")
    python = _shared_base(session)
    # only the files holding a `core` test are collected (collecting all of tests/ takes 15 s per release)
    files = ["tests/test_patching.py"] + sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
        if path.name != "test_patching.py" and "pytest.mark.core" in path.read_text())

    def run(version):
        # each job installs its release (one's download overlaps the other's tests)
        install = _release_dir(python, version)
        if install is not None:
            return version, 1, install
        env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(SHARED / version)}
        banner = subprocess.run([python, "-c", "import transformers, huggingface_hub as hub; print('transformers', "
                                 "transformers.__version__, 'from', transformers.__file__, '| huggingface_hub', "
                                 "hub.__version__)"], env=env, cwd=ROOT, capture_output=True, text=True)
        # the drift test (every target in targets/ where the table says, with the parameters it relies on) and the
        # core flag-vs-stock equality subset, in one process
        done = subprocess.run([python, *PYTEST, "-m", "drift or core", *files], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        return version, done.returncode, banner.stdout + banner.stderr + done.stdout + done.stderr

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
        for version, code, output in pool.map(run, versions):
            session.log(f"transformers {version}: drift and core tests {'passed' if code == 0 else 'FAILED'}")
            print(output, flush=True)
            if code != 0:
                failed.append(version)
    if failed:
        session.error(f"the drift or core tests failed on transformers {', '.join(failed)}")


@nox.session
def floor(session):
    session.install("--no-compile", f"torch=={TORCH_FLOOR}", f"transformers=={TRANSFORMERS[0]}", *TEST_DEPS)
    session.install("--no-deps", "-e", ".")
    session.run("python", "-c", "import torch, transformers; print('torch', torch.__version__, '| transformers', "
                "transformers.__version__)")
    session.run("python", *PYTEST, "tests", "-m", "drift or core", *session.posargs, env=TEST_ENV)


@nox.session
def newest_torch(session):
    """The whole suite on the newest torch, from the package index past the machine's cap (NO_TORCH_CAP), with the
    newest supported transformers. Its own virtualenv (.nox/newest_torch): nothing from the torch 2.13.0 ones."""
    session.install("--no-compile", f"torch=={TORCH_NEWEST}", f"transformers=={NEWEST}", *TEST_DEPS,
                    "matplotlib", env=NO_TORCH_CAP)
    session.install("--no-deps", "-e", ".")
    # fails if anything but TORCH_NEWEST was installed (a cap that came back would otherwise pass unseen)
    session.run("python", "-c", "import torch, transformers; print('torch', torch.__version__, '| transformers', "
                f"transformers.__version__); assert torch.__version__.split('+')[0] == {TORCH_NEWEST!r}")
    session.run("python", *PYTEST, *XDIST, "tests", *session.posargs, env=TEST_ENV)


@nox.session
def newest(session):
    """The porting check, run by hand the day a transformers release appears (not in `.ci/run`: an upstream release
    never blocks a landing): the newest transformers and torch from the package index (torch with its CUDA
    libraries), the drift test, the core tests, and the porting report (scripts/drift_report.py). Fails when
    anything needs porting; the report is printed either way."""
    session.install("--no-compile", "--upgrade", "torch", "transformers", *TEST_DEPS, env=NO_TORCH_CAP)
    session.install("--no-deps", "-e", ".")
    session.run("python", "-c", "import torch, transformers; print('torch', torch.__version__, '| transformers', "
                "transformers.__version__)")
    failed = []
    for label, args, codes in (("drift (tests/test_patching.py)", ["tests/test_patching.py"], [0]),
                               ("core (-m core)", ["tests", "-m", "core", "--ignore=tests/test_patching.py"], [0, 5])):
        try:
            session.run("python", *PYTEST, *args, *session.posargs, env=TEST_ENV, success_codes=codes)
        except nox.command.CommandFailed:
            failed.append(label)
    try:
        session.run("python", "scripts/drift_report.py", env=TEST_ENV)
    except nox.command.CommandFailed:
        failed.append("the porting report (scripts/drift_report.py: something to port)")
    if failed:
        session.error("to port: " + "; ".join(failed))


# --- the shared environment of `releases` -------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent
SHARED = ROOT / ".nox" / "_releases"


@contextlib.contextmanager
def _locked(name: str):
    """Serialise the set-up steps if sessions run under `nox --parallel`."""
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(SHARED / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _shared_base(session) -> str:
    """One virtualenv with torch, the test dependencies and this package (editable), built once and reused."""
    base = SHARED / "base"
    python = base / "bin" / "python"
    stamp = base / ".installed"
    wanted = "\n".join([sys.version, f"torch=={TORCH}", *TEST_DEPS, "-e ."])
    with _locked("base"):
        if stamp.exists() and stamp.read_text() == wanted and python.exists():
            return str(python)
        shutil.rmtree(base, ignore_errors=True)
        session.run(sys.executable, "-m", "virtualenv", "-q", str(base), external=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
        session.run(*pip, f"torch=={TORCH}", *TEST_DEPS, external=True)
        session.run(*pip, "--no-deps", "-e", str(ROOT), external=True)
        stamp.write_text(wanted)
    return str(python)


def _release_dir(python: str, version: str) -> str | None:
    """transformers==version and its own dependencies (huggingface_hub, tokenizers, ...) in a --target directory,
    SHARED / version; None once there, else pip's output (it failed). Called from `releases`' worker threads: plain
    subprocesses, not `session.run`."""
    target = SHARED / version
    stamp = SHARED / f"{version}.installed"
    with _locked(version):
        if stamp.exists() and (target / "transformers").is_dir():
            return None
        shutil.rmtree(target, ignore_errors=True)
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "--target", str(target),
                               f"transformers=={version}"], capture_output=True, text=True)
        if done.returncode != 0:
            return f"pip install transformers=={version} failed:\n{done.stdout}{done.stderr}"
        stamp.write_text(version)
    return None


# --- the upstream patch series ------------------------------------------------------------------------------------
@nox.session(venv_backend="none")
def upstream(session):
    """upstream/*.patch against the transformers 5.24.0 sdist from the package index: applies cleanly, the series'
    own tests pass, and the project's equality cases give unpatched 5.24.0's outputs with the plug-in not imported.
    Its own virtualenv and work directory: .nox/_upstream (scripts/upstream_check.sh says what it does)."""
    session.run("bash", str(ROOT / "scripts" / "upstream_check.sh"), external=True)
