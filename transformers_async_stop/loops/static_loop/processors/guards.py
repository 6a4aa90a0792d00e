"""Whether a captured processor's state is what it was at capture (`AttrGuard`), checked before every replay."""

from __future__ import annotations

import copy
import operator

import torch

_MISSING = object()
_SCALARS = (int, float, bool, str, bytes, complex, type(None))


class AttrGuard:
    """Whether an object's attributes are what they were when the guard was made.

    A captured graph bakes a processor's Python scalars (`temperature`, `top_k`, `penalty`...) and its tensors'
    addresses in; a change after capture is one the graph would ignore. Compared, before every replay: the type and
    its `__call__`; each attribute, scalars by value (and type), containers by value (a deep copy compared with ==; a
    container that holds tensors element by element), tensors by identity and layout (memory, shape, strides,
    dtype: what a replay bakes in), anything else by identity. A tensor's values are not compared: every captured
    processor reads its tensors on the device, so a replay reads them as they are, as stock's call does (an
    in-place edit is honoured); no private counter is read (`_version` raises for inference tensors). The common
    case, every attribute still the same object, is one C-level pass.
    """

    __slots__ = ("obj", "kind", "call", "items", "size", "get", "refs", "tensors", "containers")

    def __init__(self, obj):
        self.obj = obj
        self.kind = type(obj)
        self.call = getattr(self.kind, "__call__", None)
        attrs = vars(obj)
        self.size = len(attrs)
        self.items = tuple((key, value, _snapshot(value)) for key, value in attrs.items())
        keys = tuple(attrs)
        self.get = operator.itemgetter(*keys, *keys[:1])  # always a tuple (one more item, where there is one)
        self.refs = tuple(attrs.values()) + tuple(attrs.values())[:1]
        self.tensors = tuple((value, _layout(value)) for value in attrs.values() if isinstance(value, torch.Tensor))
        self.containers = tuple((key, value, snap) for key, value, snap in self.items if isinstance(snap, _Frozen))

    def unchanged(self) -> bool:
        obj = self.obj
        kind = type(obj)
        if kind is not self.kind or kind.__call__ is not self.call:
            return False
        attrs = obj.__dict__
        if len(attrs) != self.size:
            return False
        if self.size:
            try:
                current = self.get(attrs)
            except KeyError:
                return False
            if not all(map(operator.is_, current, self.refs)):
                return self._rebound()
        for tensor, layout in self.tensors:
            if _layout(tensor) != layout:
                return False
        for key, ref, snap in self.containers:
            if not _same(attrs[key], ref, snap):
                return False
        return True

    def _rebound(self) -> bool:
        """Some attribute is another object: unchanged only if every one is equal to what it was."""
        attrs = self.obj.__dict__
        return all(_same(attrs.get(key, _MISSING), ref, snap) for key, ref, snap in self.items)


def _layout(tensor: torch.Tensor) -> tuple:
    """What a captured graph bakes in of a tensor it reads: where its memory is and how it is laid out."""
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


class _Frozen:
    """A container's snapshot: `kind` "eq" (a deep copy compared with ==) or "walk" (element by element)."""

    __slots__ = ("eq", "copy")

    def __init__(self, eq, copied):
        self.eq = eq
        self.copy = copied


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return _layout(value)
    if type(value) in _SCALARS:
        return None
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        if _holds_tensor(value):
            return _Frozen(False, _freeze(value))
        return _Frozen(True, copy.deepcopy(value))
    return None  # any other object: by identity


def _same(value, ref, snap) -> bool:
    if isinstance(ref, torch.Tensor):
        return value is ref and _layout(value) == snap
    if type(ref) in _SCALARS:
        return value is ref or (type(value) is type(ref) and value == ref)
    if isinstance(snap, _Frozen):
        if snap.eq:
            return type(value) is type(ref) and value == snap.copy
        return _freeze(value) == snap.copy
    return value is ref


class _TensorMark:
    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor, self.version = tensor, _layout(tensor)

    def __eq__(self, other):
        return isinstance(other, _TensorMark) and other.tensor is self.tensor and other.version == self.version

    def __hash__(self):
        return id(self.tensor)


class _Identity:
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _freeze(value):
    if isinstance(value, torch.Tensor):
        return _TensorMark(value)
    kind = type(value)
    if kind in _SCALARS:
        return kind, value
    if kind in (list, tuple):
        return kind, tuple(_freeze(v) for v in value)
    if kind is dict:
        return kind, tuple((_freeze(k), _freeze(v)) for k, v in value.items())
    return _Identity(value)


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False
