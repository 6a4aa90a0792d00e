"""The names the Python a replay skips looks up, and the objects first seen under them.

A replay runs none of the forward's Python, so a name rebound after the recording is one stock's next forward calls
and a replay never does:
- `watched_functions`: the torch functions and tensor methods the code of the model's module classes and of its
  modeling module calls by name (user code setting `torch.nn.functional.silu = ...`, a method set on `torch.Tensor`),
  for the snapshot (`staleness.py`) and the default-deny proof (`default_deny.why_foreign_functions`);
- `watched`: `forward` / `__call__` of each module class, the transformers methods along their method order, the
  modeling module's functions, and every global the read code looks up, with the object this process first saw
  there (`why_rebound`: the step runs eagerly where one was replaced);
- `code_names`: every name a function's code (nested and wrapped functions included) looks up.
"""

from __future__ import annotations

import builtins
import sys

import torch

from ....release_checks.verified import is_user_code, resolve_source, sources_of
from . import default_deny


# where a forward looks up the torch functions it calls: a name rebound there after the recording (user code setting
# `torch.nn.functional.silu = ...`) is one stock's next forward calls and a replay never does
_TORCH_NAMESPACES = (torch, torch.nn.functional, torch._C._nn, torch.special, torch.linalg)


def _codes(function, seen: set) -> None:
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    while code is None and hasattr(function, "__wrapped__"):  # a decorator's wrapper: the wrapped function's code
        function = function.__wrapped__
        code = getattr(function, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        if code not in seen:
            seen.add(code)
            stack += [const for const in code.co_consts if hasattr(const, "co_names")]
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None and wrapped is not function:
        _codes(wrapped, seen)


def code_names(function) -> set:
    """Every name the code of `function` (its nested functions and wrapped functions included) looks up."""
    codes: set = set()
    _codes(function, codes)
    return _names(codes)


def _names(codes) -> set:
    names: set = set()
    for code in codes:
        names.update(code.co_names)
    return names


def watched_functions(model, module) -> list:
    """(namespace, name, object) for every torch function or tensor method name the Python a replay skips looks up:
    the names in the code of each module class's own `forward` / `__call__` (the model's, and torch's own modules')
    and of the modeling module's functions they call (`module`'s functions). A name rebound in `torch`,
    `torch.nn.functional`... or set on `torch.Tensor` after the recording makes it stale
    (`staleness.ModelGraphs.changed`). A pass over the code objects, not a trace of the recording: a function mode or
    profiler active while recording would change what torch calls (a `TorchFunctionMode` makes `F.silu` look its own
    name up again)."""
    codes: set = set()
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            if klass is torch.nn.Module or klass is object:
                continue
            for attr in ("forward", "__call__"):
                if attr in vars(klass):
                    _codes(vars(klass)[attr], codes)
    for value in list(vars(module).values()):
        if callable(value) and getattr(value, "__module__", None) == module.__name__ and hasattr(value, "__code__"):
            _codes(value, codes)
    return torch_entries(_names(codes))


def torch_entries(names) -> list:
    """(namespace, name, object) for each of `names` found in torch's namespaces, and on `torch.Tensor` (with the
    tensor operators the interpreter looks up)."""
    names = set(names)
    entries = []
    for namespace in _TORCH_NAMESPACES:
        table = vars(namespace)
        entries += [(table, name, table[name]) for name in names if name in table]
    tensor_table, base = vars(torch.Tensor), torch._C.TensorBase
    # operators are looked up by the interpreter, not by name in the code (`residual + hidden_states`)
    names.update(_TENSOR_OPERATORS)
    entries += [(tensor_table, name, tensor_table.get(name)) for name in names if hasattr(base, name)]
    return entries


def builtin_entries(names) -> list:
    """(builtins' namespace, name, object) for each of `names` that is a builtin (`getattr`, `isinstance`...): one
    rebound in `builtins` is what stock's next forward calls (red team of the proof pipeline)."""
    table = vars(builtins)
    return [(table, name, table[name]) for name in set(names) if name in table and callable(table[name])]


_TENSOR_OPERATORS = tuple(f"__{op}__" for op in (
    "add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv", "rtruediv", "itruediv",
    "matmul", "rmatmul", "pow", "rpow", "neg", "pos", "getitem", "setitem", "and", "or", "invert", "eq", "ne", "lt",
    "le", "gt", "ge", "mod", "floordiv"))



# (owner, attribute) -> the object first seen there by this process: a replay runs none of these, so one rebound since
# (a class-level forward wrapper, a patched module function) must send the call to the eager forward. A wrapper made
# with `functools.wraps` has the original's source (`inspect.getsource` unwraps it), so the digests cannot see it.
_FIRST_SEEN: dict = {}


def watched(model, module, family, families) -> list:
    """(owner, attribute, the object first seen there) for every class method and module function a replay skips:
    `forward` and `__call__` of each module class of the model, and the modeling module's functions it calls."""
    pairs = [(cls, name) for cls in {type(m) for m in model.modules()} for name in ("forward", "__call__")]
    pairs += [(module, name) for name in family.watched if hasattr(module, name)]
    pairs += _looked_up(module, family, families)
    pairs += default_deny.transformers_methods({type(m) for m in model.modules()})
    return [(owner, name, _first_seen(owner, name)) for owner, name in pairs]


def _first_seen(owner, name):
    """The object first seen at `owner.name` by this process; one in code outside transformers, torch and this
    package (a user's class-level wrapper or replacement, there while a model is proven) is returned but not kept as
    the first: kept, it would make putting the original back look like a rebinding, and every later model of that
    class decode eagerly for the rest of the process (found in the 5.17 suite: a test's `LlamaForCausalLM.forward`
    wrapper there at a worker's first Llama proof sent every later Llama eager, "LlamaForCausalLM.forward was
    replaced"). Such code itself is refused where it runs (`default_deny`)."""
    key = (owner, name)
    first = _FIRST_SEEN.get(key, _UNSEEN)
    if first is not _UNSEEN:
        return first
    current = getattr(owner, name)
    if not is_user_code(current):
        _FIRST_SEEN[key] = current
    return current


_UNSEEN = object()



_LOOKED_UP: dict = {}


def _looked_up(module, family, families) -> list:
    """(module, name) for every global the read code looks up by name (red team holes R4, R9): the modeling module's
    own functions and classes' methods (`slice_logits_to_keep`, the output dataclass...), and each digested source
    outside it (`masking_utils`' `_ignore_causal_mask_sdpa`, `causal_mask_function`...) with the names its code looks
    up in its own module. A name rebound there since it was first seen sends the step eager, as a hand-listed one did
    (`family.watched`). Computed once per (module, family): a pass over the code objects."""
    key = (module.__name__, family.name)
    found = _LOOKED_UP.get(key)
    if found is not None:
        return found
    pairs = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        functions = [value] if callable(value) and hasattr(value, "__code__") else [
            attribute for attribute in vars(value).values() if hasattr(attribute, "__code__")
        ] if isinstance(value, type) else []
        for function in functions:
            pairs.update((module, name) for name in code_names(function) if name in vars(module))
    # a family found by discovery runs the read families' shared sources (the mask functions, the cache update...)
    read = [family] if not family.auto else families
    for source in sorted({source for each in read for source in sources_of(f"piecewise forward ({each.name})")}):
        owner_name, _, qualname = source.partition(":")
        owner = sys.modules.get(owner_name)
        if owner is None or owner is module:
            continue
        try:
            function, holder, attr = resolve_source(source)
        except (ImportError, AttributeError):
            continue
        pairs.add((holder, attr))
        pairs.update((owner, name) for name in code_names(function) if name in vars(owner))
    patched = patched_targets()
    pairs = [(owner, name) for owner, name in pairs if (id(owner), name) not in patched]
    found = _LOOKED_UP[key] = sorted(pairs, key=lambda pair: (getattr(pair[0], "__name__", ""), pair[1]))
    return found


def patched_targets() -> set:
    """(id of the owner, attribute) of the package's own patch targets (the SDPA mask-skip check...): they change with
    `apply()` / `unpatch()`, and what they compute is the stock function's (tests/test_patching.py), so they are not a
    user's rebinding."""
    from ....release_checks.targets import TARGETS

    patched = set()
    for target in TARGETS:
        try:
            patched.add((id(target.resolve_owner()), target.attr))
        except (ImportError, AttributeError):
            continue
    return patched


def why_rebound(entries) -> str | None:
    for owner, name, first in entries:
        if getattr(owner, name, None) is not first:
            return f"{getattr(owner, '__name__', owner)}.{name} was replaced"
    return None
