"""A pytest plugin that runs transformers' own tests on the patched transformers (upstream/*.patch) with the series'
flag on for every call, the deferred stop check taken on the CPU too.

    PYTHONPATH=<patched transformers>:scripts python -m pytest -p upstream_flag_on_plugin <upstream tests...>

The series gates `DeferredStopCheck` on CUDA with `async_stopping_criteria=True` (MPS: always). Here its
`is_supported` answers as on CUDA with the flag set, whatever the call and device say, so every `_sample` call that
can defer does (`defer_on_any_device()` in the series' own tests does the same for the CPU). The upstream tests' own
expectations are left as they are. At the end it prints how many stop checks were deferred and how many extra steps
were undone, so a run that never deferred cannot pass unnoticed; `UPSTREAM_FLAG_ON_COUNTS=path.json` also writes the
counts per test.
"""

from __future__ import annotations

import collections
import json
import os

import torch
from transformers.generation import utils as generation_utils

_check = generation_utils.DeferredStopCheck
if "async_stopping_criteria" not in _check.is_supported.__code__.co_varnames:
    raise RuntimeError("this transformers has no async_stopping_criteria: it is not the patched one")

_original_is_supported = _check.is_supported
_original_finish = _check.finish
_current = {"test": None}
_counts = collections.defaultdict(collections.Counter)


def _is_supported(device, cache, cache_is_returned, is_assistant, async_stopping_criteria=False):
    device = torch.device("cuda") if torch.device(device).type == "cpu" else device
    deferred = _original_is_supported(device, cache, cache_is_returned, is_assistant, async_stopping_criteria=True)
    _counts[_current["test"]]["deferred" if deferred else "not deferred"] += 1
    return deferred


def _finish(self):
    if getattr(self, "stop_reported", False):  # the loop ran one step the flag-off call never made: undone here
        _counts[_current["test"]]["extra steps undone"] += 1
    return _original_finish(self)


_check.is_supported = staticmethod(_is_supported)
_check.finish = _finish


def pytest_report_header(config):
    return "upstream series: async_stopping_criteria=True for every call, DeferredStopCheck on CPU too"


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    total = collections.Counter()
    for counts in _counts.values():
        total.update(counts)
    tests = sum(1 for counts in _counts.values() if counts["deferred"])
    terminalreporter.write_line(f"upstream_flag_on_plugin: {dict(total)}; tests with a deferred call: {tests}")
    out = os.environ.get("UPSTREAM_FLAG_ON_COUNTS")
    if out:
        with open(out, "w") as f:
            json.dump({"total": total, "per_test": _counts}, f, indent=1, sort_keys=True)
