"""What one recording's run of the forward executed, outside the parts a replay runs again eagerly.

A recording bakes in every decision the forward's Python made while it ran. The proof (`verdict.py`) looks at
exactly what ran, not at what a class could run: which transformers functions executed, line by line, and which
code of neither transformers, torch, the standard library nor this package did (a user's function, a monkeypatch).
`RunWatch` collects both with `sys.settrace` (line events only in transformers' files; torch's and the standard
library's frames are not traced further), and, when asked, the ATen ops each piece dispatched with their non-tensor
arguments and the geometry of their tensors (`TorchDispatchMode`), so that two recordings at different positions can
be compared (`proof.first_difference`), and any op dispatched between two pieces outside the code a replay runs again
(`stray`). The cache update, the attention and a K-token forward's mask calls run again at every replay
(`recorder._Recorder._eager`): while they run, and while the recorder does its own bookkeeping, the watch is paused.

Recording-time only: a replay runs none of this. Where a trace function is already set (a debugger, coverage), the
watch would displace it: the recording is not made (`why_busy`).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ....undo.module_state import real_path

_TRANSFORMERS = os.path.dirname(real_path(__import__("transformers").__file__)) + os.sep
_TORCH = os.path.dirname(real_path(torch.__file__)) + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(real_path(__file__))))) + os.sep
_STDLIB = tuple(real_path(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib"))
_SITE = tuple(real_path(sysconfig.get_paths()[name]) + os.sep for name in ("purelib", "platlib"))


@functools.lru_cache(maxsize=4096)
def kind_of(filename: str) -> str:
    """"transformers", "torch" (torch's files and the standard library's: their own code, not traced further),
    "ours" (this package), "generated" (compiled from a string: judged by its code object, `identity.py`), or
    "other"."""
    if filename.startswith("<frozen "):  # the standard library's frozen modules (`abc`, `os`, `codecs` in 3.11+)
        return "torch"
    if filename.startswith("<"):  # compiled from a string: dataclasses' methods, named tuples, or a user's `exec`
        return "generated"
    path = real_path(filename)
    if path.startswith(_TRANSFORMERS):
        return "transformers"
    if path.startswith(_OURS):
        return "ours"
    if path.startswith(_TORCH) or (path.startswith(_STDLIB) and not path.startswith(_SITE)):
        return "torch"
    return "other"


def why_busy() -> str | None:
    """Why a watch cannot be installed now (None: it can)."""
    if sys.gettrace() is not None:
        return "a trace function is set (a debugger or coverage): the automatic proof needs its own"
    return None


class RunWatch:
    """Install with `with watch:` around the recording's forward (this thread only); pause with `paused()`."""

    def __init__(self, trace_ops: bool, trace_lines: bool = True):
        self.pause = 0
        # a hand-read family's code is read and digested: which of its code objects ran is needed (their identity,
        # `identity.py`), not which lines
        self.trace_lines = trace_lines
        self.lines: dict = {}  # code object -> the line numbers executed
        self.modules: dict = {}  # code object -> the name of the module whose globals it ran with
        self.foreign: dict = {}  # code object of neither transformers, torch, the stdlib nor this package -> module
        self.closures: dict = {}  # code object -> its free variables' values (a decorator's registry, say)
        # code compiled from a string -> (the module whose globals it ran with, the type it ran for)
        self.generated: dict = {}
        # transformers code run with globals other than its module's dict -> the module they name
        self.foreign_globals: dict = {}
        self.ops: list | None = [] if trace_ops else None
        # ops the forward dispatched between a piece's end and the next one's start, outside the code a replay runs
        # again: a replay would not run them (a query scaled after the cache update)
        self.stray: list = []
        self.between = False
        self._mode = _OpLog(self) if trace_ops else None
        self._thread = None

    def __enter__(self):
        self._thread = threading.get_ident()
        sys.settrace(self._call)
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            sys.settrace(None)
        return False

    def paused(self):
        return _Paused(self)

    def _call(self, frame, event, arg):
        if self.pause or event != "call":
            return None
        code = frame.f_code
        kind = kind_of(code.co_filename)
        if kind == "transformers":
            if code not in self.lines:
                self.lines[code] = set()
                globals_ = frame.f_globals
                name = globals_.get("__name__", "")
                self.modules[code] = name
                owner = sys.modules.get(name)
                if owner is None or vars(owner) is not globals_:
                    # run with a dict other than its module's (`types.FunctionType(f.__code__, dict(vars(m)))`): what
                    # it looks up is in no namespace the proof watches (red team of the proof pipeline, hole 2)
                    self.foreign_globals.setdefault(code, name or "?")
                if code.co_freevars:
                    local = frame.f_locals
                    self.closures[code] = {name: local.get(name) for name in code.co_freevars}
            return self._line if self.trace_lines else None
        if kind == "generated":
            # code compiled from a string: the standard library's methods of a dataclass or a named tuple of
            # transformers' or torch's, or a user's (`exec`, a notebook cell, a source rewriter's patch run in a
            # modeling module's namespace: issue 43, hole 2). Judged by the code object itself after the run
            # (`identity.why_not_generated`), with the type it ran for
            if code not in self.generated:
                local = frame.f_locals
                first = local.get(code.co_varnames[0]) if code.co_argcount and code.co_varnames else None
                self.generated[code] = (frame.f_globals.get("__name__", "") or "?",
                                        first if isinstance(first, type) else type(first))
            return None
        if kind == "other":
            self.foreign.setdefault(code, frame.f_globals.get("__name__", "?"))
        return None

    def _line(self, frame, event, arg):
        if event == "line" and not self.pause:
            self.lines[frame.f_code].add(frame.f_lineno)
        return self._line


class _Paused:
    __slots__ = ("watch",)

    def __init__(self, watch):
        self.watch = watch

    def __enter__(self):
        self.watch.pause += 1

    def __exit__(self, *exc):
        self.watch.pause -= 1
        return False


class _OpLog(TorchDispatchMode):
    """Each ATen op of the pieces, as (op, arguments with every tensor by its geometry). Runs every op as it is: the
    kernels are the ones eager chooses (the mode only looks)."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watch = self.watch
        if not watch.pause:
            (watch.stray if watch.between else watch.ops).append((str(func), _shape_of(args), _shape_of(kwargs)))
        return func(*args, **kwargs)


def _shape_of(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((key, _shape_of(item)) for key, item in value.items()))
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return value
    return type(value).__name__
