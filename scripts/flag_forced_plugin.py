"""A pytest plugin that runs transformers' own tests with `async_stopping_criteria=True` as every call's default.

    TRANSFORMERS_ASYNC_STOP_FORCE=1 python -m pytest -p flag_forced_plugin <upstream tests...>

(with this folder on PYTHONPATH). Importing the package applies its patches; the plugin then makes the flag's
unset value resolve to True instead of False (5.x resolves unset generation fields through
`GenerationConfig._get_default_generation_params`), so every `generate()` that does not say otherwise takes the
deferred path, also on CPU with `TRANSFORMERS_ASYNC_STOP_FORCE=1`. The upstream tests' own expectations are left as
they are: where they compare two generate() calls, both run with the flag. No script runs it: run it as above.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")

import transformers_async_stop  # noqa: E402,F401  (applies the patches)
from transformers import GenerationConfig  # noqa: E402

_FIELD = "async_stopping_criteria"
_defaults = GenerationConfig._get_default_generation_params


def _forced_defaults():
    defaults = _defaults()
    defaults[_FIELD] = True
    return defaults


GenerationConfig._get_default_generation_params = staticmethod(_forced_defaults)


def pytest_report_header(config):
    return f"transformers_async_stop {transformers_async_stop.__version__}: async_stopping_criteria=True by default"
