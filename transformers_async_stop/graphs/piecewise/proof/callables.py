"""The state of the functions and callables a replay relies on, beyond their identity (issue 43, holes 4 and 5).

A replay compares the objects found under the names the forward looks up (`names.py`, `staleness.py`). An object can
keep its identity and still run other code, or the same code with other values:
- a function whose `__code__` was replaced in place (IPython's `%autoreload` does this when a user edits a modeling
  file in a notebook), whose `__defaults__` / `__kwdefaults__` were set or edited, or whose closure cells were
  rebound (a decorator's wrapper holds the function it wraps in one);
- a `functools.partial` whose `keywords` were edited (`act.keywords["approximate"] = "none"`), or whose `args` or
  `func` were swapped through `__setstate__`.
`CallableState` takes all of that for a set of roots, and everything reachable from them through closures, defaults,
`__wrapped__`, bound methods and partials; `changed()` compares it before every replay.

A callable whose state it cannot read (an instance of a user's class with `__call__`, a C extension object holding
state, a builtin bound to an object that is no module) is not compared but named: `unreadable` is the first one,
and the proof refuses the recording with it (`admission.py`) rather than replay something it cannot watch. Callables
of torch's and transformers' own types (a module, an op overload, a registry) are compared by identity; their state
is the module snapshot's, or fixed.
"""

from __future__ import annotations

import functools
import operator
import types

import torch

# callables with no state of their own beyond their identity (a builtin of a module, a class, a slot wrapper...)
_STATELESS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
              types.MethodWrapperType, types.MethodDescriptorType, types.ClassMethodDescriptorType, type)
_OWN_PREFIXES = ("torch", "transformers", "functools", "builtins", "operator", "typing", "collections", "enum")
_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_CODE = operator.attrgetter("__code__")
_DEFAULTS = operator.attrgetter("__defaults__")
_KWDEFAULTS = operator.attrgetter("__kwdefaults__")
_CLOSURE = operator.attrgetter("__closure__")
_PARTIAL = operator.attrgetter("func", "args", "keywords")
_CONTENTS = operator.attrgetter("cell_contents")


class CallableState:
    """What the roots' code and bound values are now; `changed()` says whether any of it moved since."""

    def __init__(self, roots, known_modules=()):
        """`known_modules`: the model's modules, whose state the model's snapshot compares; any other module a
        callable holds (a partial of a `Softplus`, a bound method of a module outside the model) is taken here: its
        attributes, parameters, buffers and children by identity, its class, its tensors' storage."""
        self.unreadable: str | None = None
        known = {id(module) for module in known_modules}
        functions, partials, tensors, seen = [], [], [], set()
        outside, entries, sized, seen_modules = [], [], [], set()
        stack = list(roots)
        while stack:
            value = stack.pop()
            if id(value) in seen or isinstance(value, _ATOMS):
                continue
            seen.add(id(value))
            kind = type(value)
            if kind is types.FunctionType:
                functions.append(value)
                stack += _reached_from_function(value)
            elif kind is types.MethodType:
                # a method's object is state its code reads: a module (snapshotted), a class, or refused
                stack.append(value.__func__)
                owner = value.__self__
                if isinstance(owner, torch.nn.Module):
                    stack.append(owner)
                else:
                    self._note(_why_unbound(owner))
            elif kind is functools.partial:
                partials.append(value)
                stack += [value.func, *value.args, *(value.keywords or {}).values()]
            elif kind in (classmethod, staticmethod, property):
                stack += [getattr(value, "__func__", None) or value.fget]
            elif kind in (tuple, list, frozenset, set) and len(value) < 64:
                stack += list(value)
            elif isinstance(value, torch.Tensor):
                tensors.append(value)  # read at its address by a replay: `t.data = x` moves it
            elif isinstance(value, torch.nn.Module):
                if id(value) not in known:
                    # a module outside the model (a partial of a `Softplus`, a module-level activation instance):
                    # its state is taken here, as the model's snapshot takes the model's (red team of the proof
                    # pipeline, hole 3)
                    for module in value.modules():
                        if id(module) in known or id(module) in seen_modules:
                            continue
                        seen_modules.add(id(module))
                        outside.append(module)
                        tables = (module.__dict__, module._parameters, module._buffers, module._modules)
                        entries += [(table, name, item) for table in tables for name, item in table.items()]
                        sized += tables
                        tensors += [item for table in tables[1:3] for item in table.values() if item is not None]
                        stack.append(type(module).forward)
            elif callable(value):
                self._note(_why_unreadable(value, stack))
        self.outside, self.classes = outside, list(map(type, outside))
        self.entries = _columns(entries)
        self.sized, self.sizes = sized, list(map(len, sized))
        self.tensors = tensors
        self.pointers = list(map(torch.Tensor.data_ptr, tensors))
        self.geometry = [(tensor.shape, tensor.stride(), tensor.dtype) for tensor in tensors]
        self.functions = functions
        self.codes = list(map(_CODE, functions))
        self.defaults = list(map(_DEFAULTS, functions))
        self.kwdefaults = list(map(_KWDEFAULTS, functions))
        # the keyword-defaults dicts' entries, flat (a dict edited in place is the same object)
        tables = [table for table in self.kwdefaults if table]
        self.kw_tables, self.kw_sizes = tables, list(map(len, tables))
        self.kw_entries = _columns([(table, key, value) for table in tables for key, value in table.items()])
        # `__closure__` itself is read-only: its cells' contents are what can be rebound
        cells = [cell for closure in map(_CLOSURE, functions) if closure for cell in closure]
        # filled cells compared from C (`cell_contents` raises on an emptied one: a change); empty ones apart
        self.cells = [cell for cell in cells if _cell_contents(cell) is not _EMPTY]
        self.contents = list(map(_CONTENTS, self.cells))
        self.empty_cells = [cell for cell in cells if _cell_contents(cell) is _EMPTY]
        self.partials = partials
        self.partial_state = [_partial_state(partial) for partial in partials]

    def _note(self, why) -> None:
        if why is not None and self.unreadable is None:
            self.unreadable = why

    def changed(self) -> bool:
        """Whether any of it moved since (before every replay: C-level maps over flat lists)."""
        if self.outside:
            tables, names, values = self.entries
            if (list(map(type, self.outside)) != self.classes or list(map(len, self.sized)) != self.sizes
                    or any(map(operator.is_not, map(dict.get, tables, names), values))):
                return True
        if self.tensors and (list(map(torch.Tensor.data_ptr, self.tensors)) != self.pointers or [
                (tensor.shape, tensor.stride(), tensor.dtype) for tensor in self.tensors] != self.geometry):
            return True
        functions = self.functions
        try:
            if (any(map(operator.is_not, map(_CODE, functions), self.codes))
                    or any(map(operator.is_not, map(_DEFAULTS, functions), self.defaults))
                    or any(map(operator.is_not, map(_KWDEFAULTS, functions), self.kwdefaults))
                    or any(map(operator.is_not, map(_CONTENTS, self.cells), self.contents))):
                return True
        except ValueError:  # a cell emptied since (`del` of the enclosing function's variable)
            return True
        tables, keys, values = self.kw_entries
        if list(map(len, self.kw_tables)) != self.kw_sizes or any(
                map(operator.is_not, map(dict.get, tables, keys), values)):
            return True
        if self.empty_cells and any(_cell_contents(cell) is not _EMPTY for cell in self.empty_cells):
            return True
        for partial, (func, args, keywords, items) in zip(self.partials, self.partial_state):
            now = _PARTIAL(partial)
            if now[0] is not func or now[1] is not args or now[2] is not keywords or (
                    keywords is not None and not _same_items(keywords, items)):
                return True
        return False


def _columns(entries) -> tuple:
    return tuple(map(list, zip(*entries))) if entries else ([], [], [])


def _reached_from_function(function) -> list:
    reached = [cell for cell in map(_cell_contents, function.__closure__ or ()) if cell is not _EMPTY]
    reached += list(function.__defaults__ or ())
    reached += list((function.__kwdefaults__ or {}).values())
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None:
        reached.append(wrapped)
    return reached


_EMPTY = object()  # an empty cell's contents


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not bound yet in its enclosing function)
        return _EMPTY


def _same_items(table: dict, items: dict) -> bool:
    """A keyword-defaults dict holds the very values it held (identity, no `==` on user objects)."""
    return table.keys() == items.keys() and not any(map(operator.is_not, map(table.get, items), items.values()))


def _partial_state(partial) -> tuple:
    """(func, args, keywords, a copy of the keywords): the objects themselves, compared by identity."""
    func, args, keywords = _PARTIAL(partial)
    return func, args, keywords, dict(keywords) if keywords is not None else None


def _why_unbound(owner) -> str | None:
    """Why the object a method is bound to cannot be read (None: it can; a module is followed by the caller)."""
    if isinstance(owner, (type, types.ModuleType)) or isinstance(owner, _ATOMS):
        return None
    if _own_type(type(owner)):
        return None
    return f"a method bound to a {type(owner).__module__}.{type(owner).__qualname__} whose state the proof cannot read"


def _why_unreadable(value, stack) -> str | None:
    """None where `value` is a callable of no state of its own (or torch's / transformers' / the standard
    library's, whose state is fixed or snapshotted elsewhere); the reason otherwise. A wrapper of the standard
    library around a function (`functools.lru_cache`) is followed to the function."""
    if isinstance(value, _STATELESS) or isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        owner = getattr(value, "__self__", None)
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) and owner is not None and not (
                isinstance(owner, (types.ModuleType, type)) or _own_type(type(owner))):
            return f"a builtin bound to a {type(owner).__name__} ({getattr(value, '__qualname__', value)!r})"
        return None
    wrapped = getattr(value, "__wrapped__", None)
    if wrapped is not None and _own_type(type(value)):
        stack.append(wrapped)
        return None
    if _own_type(type(value)):
        return None
    # a subclass of one of theirs included (a `functools.partial` subclass given its own `__call__`)
    return f"a callable {type(value).__module__}.{type(value).__qualname__} whose state the proof cannot read"


def _own_type(cls) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module.split(".", 1)[0] in _OWN_PREFIXES
