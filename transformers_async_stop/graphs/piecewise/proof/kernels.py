"""The kernels the dispatcher runs for the ops a recording captured: torch's own, or the recording is refused (red
team of the proof pipeline, holes 5 and 7).

A recording captures the kernels its ops dispatched to. A kernel registered for an ATen op from outside torch
(`torch.library.Library("aten", "IMPL").impl(...)`) is what stock's next forward runs, whatever it holds: a Python
function runs as a frame the watch sees (foreign), but a C-level callable (a `functools.partial` of another op) runs
no Python at all, and its state can change between calls. So:
- `why_foreign_kernels(ops)`: every registration of each op the recording ran must come from torch's own sources (its
  C++ tree, or its Python package: `torch._meta_registrations`); one from anywhere else (a user's file, `<string>`,
  another package's extension) refuses the recording, named. Read from the dispatcher's own dump of each op
  (`torch._C._dispatch_dump`, private: a torch without it, or one whose dump does not parse, checks nothing here and
  says so in the reason of nothing; the registrations below still make the recordings stale);
- `registrations()`: the kernels registered through `torch.library` (its set of "namespace/op/key"), compared before
  every replay (`staleness.ModelGraphs.changed`): one registered or taken out after the recording makes it stale (a
  CUDA graph replays the kernels it captured, stock runs the new one) and clears a failure (tried again).
"""

from __future__ import annotations

import functools
import os
import re

import torch

# torch's own Python registrations name its files (`torch/_meta_registrations.py`), by either spelling of its path
_TORCH = tuple({os.path.realpath(os.path.dirname(torch.__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep})
# the source trees torch's own C++ registrations name (`registered at /…/aten/src/ATen/RegisterCPU_0.cpp:123`)
_TORCH_SOURCES = ("/aten/src/ATen/", "/torch/csrc/", "/build/aten/", "/functorch/csrc/", "/c10/")
_REGISTERED = re.compile(r"registered at (.*?):\d+ ::")
_DUMP = getattr(torch._C, "_dispatch_dump", None)


def registrations():
    """The kernels registered through `torch.library` now (a set of strings; None where torch keeps none)."""
    library = getattr(torch, "library", None)
    impls = getattr(library, "_impls", None)
    return impls if isinstance(impls, set) else None


def why_foreign_kernels(ops) -> str | None:
    """`ops`: the recording's op names as the watch logs them ("aten.mm.default"). The first registered kernel of
    one of them from outside torch, as a reason; None: all torch's own."""
    impls = registrations() or ()
    version = len(impls)
    # the ops it ran, and every ATen or prims op a kernel was registered for through `torch.library` but for meta
    # kernels (a kernel above the Python dispatch key, `AutogradCPU`, runs before the watch's op log sees the op it
    # was called for: the log shows what it dispatched instead)
    names = [_schema_name(op) for op in dict.fromkeys(ops)]
    names += [f"{ns}::{op}" for ns, op, key in (entry.split("/") for entry in list(impls) if entry.count("/") == 2)
              if ns in ("aten", "prims") and key != "Meta"]
    for name in dict.fromkeys(names):
        where = _foreign(name, version)
        if where is not None:
            return f"a kernel registered for {name} from outside torch ({where})"
    return None


def _schema_name(op: str) -> str:
    """"aten.mm.default" -> "aten::mm"; "aten.add.Tensor" -> "aten::add.Tensor"."""
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    return f"{namespace}::{name}" + (f".{overload}" if overload and overload != "default" else "")


@functools.lru_cache(maxsize=4096)
def _foreign(name: str, version: int) -> str | None:
    """Where a kernel of `name` not torch's own was registered, or None (`version`: the count of `torch.library`
    registrations, so a registration since is read again)."""
    if _DUMP is None:
        return None
    try:
        dump = _DUMP(name)
    except Exception:  # noqa: BLE001 (a private API: an op it cannot dump is not checked here)
        return None
    for line in dump.splitlines():
        found = _REGISTERED.search(line)
        if found is None:
            continue
        path = found.group(1)
        if path.startswith(_TORCH) or any(marker in path for marker in _TORCH_SOURCES):
            continue
        return f"{line.split(':', 1)[0].strip()} at {path}"
    return None
