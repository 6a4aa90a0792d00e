"""The names the Python a replay skips looks up: the torch functions and tensor methods its code calls by name.

A replay runs none of the forward's Python, so a name rebound after the recording (user code setting
`torch.nn.functional.silu = ...`, a method set on `torch.Tensor`) is one stock's next forward calls and a replay never
does. `watched_functions` lists them for the staleness snapshot (`staleness.py`) and the default-deny proof
(`proven.why_foreign_functions`); `code_names` serves the eligibility's watch of a modeling module's globals.
"""

from __future__ import annotations

import torch


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


_TENSOR_OPERATORS = tuple(f"__{op}__" for op in (
    "add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv", "rtruediv", "itruediv",
    "matmul", "rmatmul", "pow", "rpow", "neg", "pos", "getitem", "setitem", "and", "or", "invert", "eq", "ne", "lt",
    "le", "gt", "ge", "mod", "floordiv"))
