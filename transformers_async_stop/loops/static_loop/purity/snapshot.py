"""The state an observed call could read, as one cheap identity fingerprint per mutable thing (`_Snapshot`).

`guard_for` walks a processor's state with it to know whether a proof is possible at all; the recorder grows one as
the call reaches globals and attribute paths; `Guard.unchanged` compares its fingerprints before every replay.
"""

from __future__ import annotations

import builtins
import collections
import operator
import types

import torch
from torch.nn.modules import module as _nn_module

_LIMIT = 5000  # objects in one snapshot
_NODES = 256  # fingerprints checked before each replay (about 0.5 us each): more would cost what capture saves
_CPU_VALUES = 4096  # elements of a CPU tensor in the state, compared by value at every check
_TRUSTED = ("torch", "builtins", "math", "operator", "functools", "collections", "abc", "typing", "enum", "types")


class _Unprovable(Exception):
    pass


class _Snapshot:
    """The state reachable from some roots: one node per mutable thing, each with a cheap identity fingerprint.

    A fingerprint holds the ids of what a node contains (an object's or class's `__dict__`, a list, a function's
    code, defaults and closure cells, a global's attribute path) or a tensor's metadata. The snapshot keeps every
    object it met alive, so no new object can take an old id: equal fingerprints mean the same objects in the same
    places, and by induction the same state. An attribute rebound to an equal but new object counts as a change (a
    needless recapture, never a stale replay).
    """

    def __init__(self):
        self.nodes = [(_fp_torch_state, None, _fp_torch_state(None))]
        self.keep, self.codes, self._seen = [], set(), set()
        # (namespace, keys, values): the trusted modules and classes met and the globals of every function met,
        # compared once after the observed call (`trusted_held`)
        self.trusted, self._watched = [], set()
        self._hooks = False
        self._watch(torch.Tensor)  # reached through any tensor (`type(scores).calls = ...`), with no path
        self._watch(builtins)  # reached through any builtin function, with no path

    def holds(self) -> bool:
        for fingerprint, obj, expected in self.nodes:
            if fingerprint(obj) != expected:
                return False
        return True

    def _watch(self, owner) -> None:
        # a trusted module or class is compared by identity only at each replay (torch's Python is not changed
        # during a call), and a module's globals by the attribute paths its code reads; but the observed call itself
        # must not write one through an alias (`F = torch.nn.functional; F.n = 1`, `type(scores).n += 1`): its
        # namespace (a live view for a class), kept here, is compared once after the call (`trusted_held`)
        d = owner if type(owner) is dict else vars(owner)
        if id(d) not in self._watched:
            self._watched.add(id(d))
            self.trusted.append((d, tuple(d), tuple(d.values())))

    def trusted_held(self) -> bool:
        for d, keys, values in self.trusted:
            if (len(d) != len(keys) or not all(map(operator.is_, keys, d))
                    or not all(map(operator.is_, values, d.values()))):
                return False
        return True

    def _node(self, fingerprint, obj) -> None:
        if len(self.nodes) >= _NODES:
            raise _Unprovable("its state is too large to check at every step")
        self.nodes.append((fingerprint, obj, fingerprint(obj)))

    def _own(self, inner) -> None:  # a dict fingerprinted by its owner's node: walk it, no node of its own
        self._seen.add(id(inner))
        self.keep.append(inner)
        for item in list(inner.items()):
            self.freeze(item)

    def add(self, root, globals_of) -> None:
        kind, value = root
        if kind == "processor":
            return self.freeze(value)
        where = (*globals_of[value[0]], value[1])  # (globals, builtins, path) of an executed code object
        self._node(_fp_path, where)
        try:
            value = _walk_path(*where)[-1]
        except (KeyError, AttributeError):
            return
        if isinstance(value, types.ModuleType) and not _trusted(value.__name__):
            raise _Unprovable(f"it uses the module {value.__name__} as a value")
        self.freeze(value)

    def freeze(self, v) -> None:
        t = type(v)
        if v is None or t in _LEAVES or id(v) in self._seen:
            return
        self._seen.add(id(v))
        self.keep.append(v)  # no new object can take the id of one we compare while the guard lives
        if len(self._seen) > _LIMIT:
            raise _Unprovable("its state is too large to check at every step")
        if isinstance(v, torch.Tensor):
            if t not in (torch.Tensor, torch.nn.Parameter) and not getattr(t, "_is_buffer", False):
                raise _Unprovable(f"it holds a tensor subclass {t.__name__}")
            if v.is_cpu and v.numel() > _CPU_VALUES:
                raise _Unprovable("it holds a large CPU tensor, whose values a capture could bake in")
            self._node(_fp_tensor, v)
            self._own(v.__dict__)  # Python attributes on a tensor (`t.count = 0`): state like an object's
        elif isinstance(v, tuple) and not hasattr(v, "__dict__") and not _slots(t):  # immutable: ids in its parent
            self.freeze(t)
            for item in v:
                self.freeze(item)
        elif t in (list, set, frozenset, dict, collections.OrderedDict):
            self._node(_fp_dict if isinstance(v, dict) else _fp_set if isinstance(v, (set, frozenset)) else _fp_seq, v)
            for item in (list(v.items()) if isinstance(v, dict) else list(v)):
                self.freeze(item)
        elif t is types.FunctionType:
            self.codes.add(v.__code__)
            self._node(_fp_function, v)
            self._watch(v.__globals__)
            self._own(v.__dict__)
            for part in (v.__defaults__, v.__kwdefaults__, *(_cell(c) for c in v.__closure__ or ())):
                self.freeze(part)
        elif t is types.MethodType:
            self.freeze(v.__func__)
            self.freeze(v.__self__)
        elif t is types.BuiltinFunctionType:
            if not isinstance(v.__self__, (types.ModuleType, type, type(None))):
                self.freeze(v.__self__)  # a bound C method of a value, e.g. `self.ids.append`
        elif t in (staticmethod, classmethod):
            self.freeze(v.__func__)
        elif t is property:
            for part in (v.fget, v.fset, v.fdel):
                self.freeze(part)
        elif t.__name__ == "partial" and t.__module__ == "functools":
            for part in (v.func, v.args, v.keywords, getattr(v, "__dict__", None)):
                self.freeze(part)
        elif isinstance(v, types.ModuleType):
            if not _trusted(v.__name__):
                raise _Unprovable(f"it holds the module {v.__name__}, whose attributes it may read")
            self._watch(v)
        elif isinstance(v, type):
            if _python_class(v) and not _trusted(v.__module__):  # C and trusted classes: identity is enough
                self._node(_fp_class, v)  # its bases, class attributes, methods, `__call__` and its code
                for part in (type(v), *v.__mro__[1:]):
                    self.freeze(part)
                self._own(v.__dict__)
            elif _python_class(v):
                self._watch(v)
        elif t not in _C_DESCRIPTORS:  # C descriptors never change
            if not all(base is object or _python_class(base) for base in t.__mro__):
                raise _Unprovable(f"it holds a {t.__name__}, whose state lives in C")
            attributes = getattr(v, "__dict__", None)
            self._node(_fp_object, v)
            if isinstance(v, torch.nn.Module) and not self._hooks:  # its call runs the global module hooks too
                self._hooks = True
                self._node(_fp_module_hooks, None)
            self.freeze(t)
            if type(attributes) is dict:
                self._own(attributes)
            for slot in _slots(t):
                self.freeze(getattr(v, slot, None))


_LEAVES = frozenset((bool, int, float, str, bytes, complex, torch.dtype, torch.device, torch.layout,
                     torch.memory_format, type(Ellipsis), type(NotImplemented), types.CodeType, range, slice,
                     types.UnionType, types.GenericAlias))  # immutable all the way down
_C_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
                  types.MemberDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType,
                  type(collections.namedtuple("_", "a").a))  # a namedtuple's field getters
_EMPTY = object()
_SLOTS: dict = {}
_PYTHON_CLASSES: dict = {}


def _trusted(module_name) -> bool:
    return str(module_name or "").split(".")[0] in _TRUSTED


def _python_class(cls) -> bool:
    """Made by a class statement: its instances' state is their `__dict__` and slots. A C extension's classes are
    heap types too, but their state is a C struct no fingerprint sees, which shows as a larger instance size."""
    known = _PYTHON_CLASSES.get(cls)
    if known is None:
        bases = [b for b in cls.__bases__ if b is not object]
        own = cls.__dict__.get("__slots__", ())
        own = [own] if isinstance(own, str) else [n for n in own if n not in ("__dict__", "__weakref__")]
        grown = cls.__basicsize__ - max((b.__basicsize__ for b in cls.__bases__), default=object.__basicsize__)
        known = _PYTHON_CLASSES[cls] = bool(
            cls.__flags__ & (1 << 9) and all(_python_class(b) for b in bases)  # Py_TPFLAGS_HEAPTYPE
            and 0 <= grown <= 8 * (len(own) + 2)  # slots, then at most a dict and a weakref pointer
            and (cls.__dictoffset__ != 0 or "__slots__" in cls.__dict__))
    return known


def _slots(cls) -> tuple:
    names = _SLOTS.get(cls)
    if names is None:
        names = []
        for base in cls.__mro__:
            declared = base.__dict__.get("__slots__", ())
            names += [declared] if isinstance(declared, str) else list(declared)
        _SLOTS[cls] = names = tuple(n for n in names if n not in ("__dict__", "__weakref__"))
    return names


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _ids(d):
    return tuple(map(id, d)), tuple(map(id, d.values()))


def _fp_torch_state(_):
    return torch.get_default_dtype(), torch.is_grad_enabled()


def _module_hooks() -> tuple:
    # the hooks `nn.Module.__call__` runs for every module (`register_module_forward_hook`, ...): dicts in torch's
    # module namespace, read by name at each check (torch could rebind one); a release without one has none to compare
    return tuple(d for d in (getattr(_nn_module, name, None) for name in _HOOK_DICTS) if isinstance(d, dict))


_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
               "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")


def _fp_module_hooks(_):
    return tuple(map(_ids, _module_hooks()))


def _fp_dict(d):
    return _ids(d)


def _fp_seq(s):
    return tuple(map(id, s))


def _fp_set(s):
    return frozenset(map(id, s))


def _fp_function(f):
    return (id(f.__code__), id(f.__defaults__), id(f.__kwdefaults__), id(f.__dict__), _ids(f.__dict__),
            tuple(id(_cell(c)) for c in f.__closure__) if f.__closure__ else ())


def _fp_class(c):
    return id(type(c)), id(c.__mro__), _ids(c.__dict__)


def _fp_object(o):
    d = getattr(o, "__dict__", None)
    return (id(type(o)), id(d), _ids(d) if type(d) is dict else None,
            tuple(id(getattr(o, s, _EMPTY)) for s in _slots(type(o))))


def _fp_tensor(t):
    # the graph reads device memory live: only where and how it reads must stay. A CPU tensor's values are baked
    # into the launches at capture (a 0-dim operand), so they are compared too (`.data` writes skip `_version`).
    # Its Python attributes are Python state (a counter kept as `t.count`): their ids, as for an object's `__dict__`
    d = t.__dict__
    return (t.dtype, t.device, t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr(),
            t.tolist() if t.is_cpu else None, id(d), _ids(d))


def _walk_path(globs, builtins_, path):
    value = globs[path[0]] if path[0] in globs else builtins_[path[0]]
    values = [value]
    for name in path[1:]:
        if not isinstance(value, (types.ModuleType, type)):
            break  # the attributes of an object: the object's own nodes cover them
        value = getattr(value, name)
        values.append(value)
    return values


def _fp_path(where):
    try:
        return tuple(map(id, _walk_path(*where)))
    except (KeyError, AttributeError):
        return None
