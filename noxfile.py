"""Test sessions, one per supported transformers release: `nox -s tests` runs all three.

torch is pinned to 2.13.0: on the CI machines that is a local CPU build (an unpinned torch pulls GBs of CUDA wheels).
"""

import nox

TRANSFORMERS = ["5.0.0", "5.17.0", "5.23.0"]
TORCH = "2.13.0"

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("transformers", TRANSFORMERS)
def tests(session, transformers):
    session.install(f"torch=={TORCH}")
    session.install(f"transformers=={transformers}", "accelerate", "pytest", "parameterized")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *session.posargs,
                env={"TRANSFORMERS_ASYNC_STOP_FORCE": "1", "HF_HUB_OFFLINE": "1"})
