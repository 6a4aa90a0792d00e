"""Modules whose forward changes state they keep on themselves: the flag's extra step would change it too.

The undo of the extra step covers the cache, the sequences and the random numbers. State that a module keeps on
itself and updates inside its forward is out of its reach: after a call that stopped early, the module would hold what
the extra step's forward left there, and the next call (or a caller reading the module) would see it. Stock never runs
that step, so such a call runs stock's loop (`why_stateful`).

What changes inside a forward, found by reading every `forward` of transformers' model files (an AST scan for
assignments to `self.*`, `register_buffer` and in-place buffer writes) and the rope decorator:
- transformers' `dynamic_rope_update` (every family that uses the shared rope code): rope type `dynamic` grows
  `inv_freq`, `max_seq_len_cached` and `attention_scaling` with the longest position seen, and resets them below the
  original length; `longrope` switches `inv_freq` (in place from 5.23) between its short and long factors and caches
  `long_inv_freq`. Both read the length on the host in most releases (`if seq_len > ...`), so the flag gains nothing
  there anyway. Other rope types (`default`, `linear`, `yarn`, `llama3`, ...) compute their frequencies once.
- modules that keep a table or state sized by the longest sequence seen, or a recurrent state, in themselves
  (`STATEFUL_CLASSES`).
Everything else the scan found moves a table to the input's device (CodeGen, CTRL) or is not decoder state.
"""

from __future__ import annotations

import functools
import operator
import os

from torch.utils.hooks import RemovableHandle

# class name -> what its forward keeps (found by the scan above; a decoding-relevant module of these families)
STATEFUL_CLASSES = {
    "TrOCRSinusoidalPositionalEmbedding": "grows its sinusoidal table to the longest position seen",
    "RecurrentGemmaRecurrentBlock": "keeps its convolution state on the module",
    "RecurrentGemmaRglru": "keeps its recurrent state on the module",
    "ClvpRotaryPositionalEmbedding": "caches its rotary table for the last sequence length",
}

_rope_wrapper_code = []  # the code object of `dynamic_rope_update`'s wrapper, made once


def _rope_wrapper():
    """The code every `forward` decorated with `dynamic_rope_update` runs (the decorator copies the wrapped
    function's name, so its code object is what tells); None on a release without the decorator."""
    if not _rope_wrapper_code:
        try:
            from transformers.modeling_rope_utils import dynamic_rope_update
        except ImportError:
            _rope_wrapper_code.append(None)
        else:
            _rope_wrapper_code.append(dynamic_rope_update(lambda self, x, position_ids: None).__code__)
    return _rope_wrapper_code[0]


def _rope_types(module) -> list[str]:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict):  # per layer type (Gemma 3, ...)
        return [str(value) for value in rope_type.values()]
    return [str(rope_type)] if rope_type is not None else []


def _stateful_rope(module) -> str | None:
    forward, wrapper = getattr(type(module), "forward", None), _rope_wrapper()
    # the decorator sits under `torch.no_grad()`'s wrapper: follow the `__wrapped__` chain (functools.wraps)
    for _ in range(8):
        if forward is None or getattr(forward, "__code__", None) is wrapper:
            break
        forward = getattr(forward, "__wrapped__", None)
    if forward is None or wrapper is None:
        return None
    # the same test the decorator makes at every call: "dynamic" in the type, or exactly "longrope"
    for rope_type in _rope_types(module):
        if "dynamic" in rope_type or rope_type == "longrope":
            return rope_type
    return None


def why_stateful(model) -> str | None:
    """Why the flag must run stock's loop for `model`: a module of it changes state it keeps on itself inside its
    forward (None: no such module). Walks the modules at every call, since a caller may swap a module between calls
    (a few microseconds per hundred modules)."""
    for name, module in model.named_modules():
        rope_type = _stateful_rope(module)
        if rope_type is not None:
            return (f"`{name or type(model).__name__}` ({type(module).__name__}) updates its rotary frequencies "
                    f"inside each forward (rope type {rope_type!r}): the extra step would leave them changed")
        what = STATEFUL_CLASSES.get(type(module).__name__)
        if what is not None:
            return f"`{name}` ({type(module).__name__}) {what}: the extra step would leave it changed"
    return None


# --- forward hooks: user code that sees every forward -------------------------------------------------------------
def hooked(model) -> bool:
    """Whether a forward hook or pre-hook is registered on the model, any of its modules, or globally: user code
    that runs at every forward (a counter, a logger, an interpretability tool saving activations). It would run in
    the extra step too, and what it did there cannot be undone."""
    from torch.nn.modules import module as nn_module

    if any(_users(getattr(nn_module, name, None) or {}) for name in _GLOBAL_HOOKS):
        return True
    return any((m._forward_hooks or m._forward_pre_hooks)
               and (_users(m._forward_hooks) or _users(m._forward_pre_hooks)) for m in model.modules())


def _users(hooks: dict) -> bool:
    """Whether any of `hooks` is user code. transformers' own hooks are left out: the output-capturing ones it
    installs once attentions or hidden states are asked for (and leaves in place; they record only while that
    forward's collector is active, and the deferred loop trims what the extra step recorded), and the input-grad one
    of `enable_input_require_grads`. Counting them would send every later call on the model to reading at once."""
    for hook in hooks.values():
        hook = getattr(hook, "func", hook)  # functools.partial
        if getattr(hook, _PASSIVE, False):
            continue
        if not str(getattr(hook, "__module__", "") or "").startswith("transformers."):
            return True
    return False


_PASSIVE = "__transformers_async_stop_passive__"


def passive_hook(hook):
    """Declare a forward hook passive: it neither keeps the tensors it is given nor minds seeing the forward of the
    flag's extra step (a forward counter, a profiler's range marker). Such a hook leaves the call on its fast path;
    it will be called once more than in stock when the call stops early. Returns the hook, to wrap it inline:

        model.register_forward_hook(transformers_async_stop.passive_hook(count_calls))

    Any other hook makes the call read each verdict before the next forward (and the static-cache loop feed stock's
    fresh inputs), so that the hook sees exactly stock's forwards."""
    function = getattr(hook, "__func__", hook)  # a bound method: the mark goes on its function
    setattr(function, _PASSIVE, True)
    return hook


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")


class HookWatch:
    """Notices a forward hook on the model at the call's start or registered mid-call (by a criterion, a processor or
    a streamer), for the controller: from then on each verdict is read before the next forward is queued, so no hook
    ever sees a forward that stock never runs. Per step it reads one counter, torch's count of hook handles ever
    made (`RemovableHandle.next_id`, public module state of `torch.utils.hooks`); the modules are scanned only when
    it moved. It also notices a class-level `forward` wrapper (`type(model).forward = wrapper`, installed before the
    call or mid-call): user code that runs at every forward as a hook does, unseen by torch's hook registry; per
    step one attribute read, the wrapper's code looked at only when the class's `forward` is another object."""

    __slots__ = ("model", "seen", "forward", "why", "modules", "classes", "children", "tables", "unhandled")

    def __init__(self, model):
        self.model = model
        self.seen = self.forward = None
        self.why = None  # what was noticed, for `last_path()`
        self.modules = self.classes = self.children = None
        self.tables = ()  # the modules' forward hook tables as last listed (`quiet`)
        self.unhandled = 0  # user hooks found in those tables with no handle made since (the static loop's fingerprint)

    def hooked(self) -> bool:
        if self._moved():  # the first look, or a module swapped or replaced since
            why = foreign_module(self.model, self.modules)
            if why is not None:
                self.why = why
                return True
        forward = getattr(type(self.model), "forward", None)
        if forward is not self.forward:
            self.forward = forward
            if user_code(forward, type(self.model)):
                self.why = (f"{type(self.model).__name__}.forward is replaced by user code: each verdict is read "
                            "before the next forward, which the wrapper would see")
                return True
        now = RemovableHandle.next_id
        # no handle made since the last look: the tables it listed are still looked at (a hook put in one without a
        # handle, by a processor between two steps), from C where they are all empty
        if now == self.seen:
            if not self._tables_hooked():
                return False
            self.unhandled += 1
        self.seen = now
        if hooked(self.model):
            self.why = ("a forward hook is registered on the model: each verdict is read before the next forward, "
                        "which the hook would see")
            return True
        return False


    def quiet(self) -> bool:
        """It has looked, noticed nothing, and the hook tables it listed hold no user hook: it may go on watching in
        a later call of the same model, as from one step to the next (an assistant's draft, a call per round)."""
        return self.modules is not None and self.why is None and not self._tables_hooked()

    def _tables_hooked(self) -> bool:
        """A user's forward hook in one of the tables last listed (transformers' own and passive ones left out, as
        `hooked` leaves them)."""
        return any(self.tables) and any(_users(table) for table in self.tables if table)

    def _moved(self) -> bool:
        """A module's class swapped, or a submodule replaced, since the last look (per step: two C-level passes over
        the model's modules and their children); the lists are taken again where one moved, or at the first look. A
        module added under a new name is not looked for: the forward's code calls the modules it knows by name, so a
        new one runs only where it replaced (or wraps, in place of) one of them."""
        if self.modules is not None:
            tables, names, values = self.children
            if (list(map(type, self.modules)) == self.classes
                    and not any(map(operator.is_not, map(dict.get, tables, names), values))):
                return False
        self.modules = list(self.model.modules())
        self.classes = list(map(type, self.modules))
        self.tables = [table for m in self.modules for table in (m._forward_hooks, m._forward_pre_hooks)]
        entries = [(m._modules, name, child) for m in self.modules for name, child in m._modules.items()]
        tables, names, values = (list(column) for column in zip(*entries)) if entries else ([], [], [])
        self.children = (tables, names, values)
        return True


def foreign_module(model, modules=None) -> str | None:
    """Why a module of `model` keeps each verdict read at once: its class is code the package has not read (a user's
    steering wrapper, a counter, an activation recorder, a subclass, a peft adapter layer, a quantization library's
    layer), whose forward may keep state or count calls; the flag's extra step would run it once more than stock, and
    the undo cannot reach what it did there. Default-deny: only transformers', torch's and this package's modules, and
    those defined in the file of the model's own class (remote code: the model itself), are read; transformers' own
    stateful ones are `why_stateful`'s."""
    import sys

    allowed = library_dirs() + (package_dir(),)
    own = getattr(sys.modules.get(type(model).__module__), "__file__", None)
    own = real_path(own) if own else None
    verdicts: dict = {}
    for module in (modules if modules is not None else model.modules()):
        cls = type(module)
        foreign = verdicts.get(cls)
        if foreign is None:
            where = getattr(sys.modules.get(cls.__module__), "__file__", None)
            where = real_path(where) if where else None
            foreign = verdicts[cls] = not (where and (where == own or where.startswith(allowed)))
        if foreign:
            name = next((n for n, m in model.named_modules() if m is module), "?")
            return (f"`{name}` ({cls.__module__}.{cls.__qualname__}) is a module of code the package has not read: "
                    "each verdict is read before the next forward, which it would see")
    return None


def user_code(function, cls=None) -> bool:
    """Whether `function` (the `forward` of `cls`) is code other than transformers', torch's, this package's or the
    file that defines `cls` (remote code, a user's subclass: the model's own code): its code object's file tells (a
    `functools.wraps` wrapper copies the name and module, not the code)."""
    import sys

    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return False  # a builtin or a callable object: nothing of ours to tell by
    where = real_path(code.co_filename)
    defined = getattr(sys.modules.get(getattr(cls, "__module__", None)), "__file__", None)
    if defined and where == real_path(defined):
        return False
    return not where.startswith(library_dirs() + (package_dir(),))


@functools.lru_cache(maxsize=8192)
def real_path(path: str) -> str:
    """`os.path.realpath`, remembered per path string. The default-deny checks ask for the real path of the file of
    every module class and function they prove, once per call, and an assistant's draft runs a call per round: each
    answer costs a dozen `lstat` calls (70% of a draft round's eligibility check, measured: 6.7 ms per check for a
    2-layer Llama on a 2-core machine). A path whose symlinks change while the process runs would keep its first
    answer; a file imported under a second path is another string, and is resolved on its own."""
    return os.path.realpath(path)


def package_dir() -> str:
    """This package's root folder (this file is in its `undo/`), by real path."""
    return os.path.dirname(os.path.dirname(real_path(__file__))) + os.sep


def library_dirs() -> tuple[str, ...]:
    """transformers' and torch's package folders, as real paths (with a trailing separator). Files are compared by
    real path: the same file imported under a second path (a symlinked copy of transformers, as transformers' own
    test suite loads it with `direct_transformers_import`, which also makes that copy `sys.modules["transformers"]`)
    is still transformers' own."""
    import torch
    import transformers

    return tuple(os.path.dirname(real_path(m.__file__)) + os.sep for m in (transformers, torch))
