"""What a transformers function that no one read may have done while a recording ran it: the mechanical rules.

A replay repeats the recorded kernels with none of the forward's Python. That is exact when every decision the
Python made is the same at every step. The decode step's inputs are fixed buffers (ids, positions, a sentinel mask,
all of fixed shape); what differs from step to step on the host is the cache object (its length), time, the
process's state, and whatever the code keeps between calls. Host reads of the device (`.item()`, a data-dependent
shape) already fail the capture. So, of each statement a recording executed in an unread function (`executed`
lines, `watch.py`), the rules refuse:

- a read of the cache other than its `update` call or passing it on (its length is the step): an attribute, a
  subscript, `len()`, iteration;
- a read of the device or of host state on the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, and the modules
  `time`, `random`, `os`, `sys`, `datetime`, `numpy`, `threading`;
- state kept between calls: `global` / `nonlocal`, an attribute set or deleted (`self.calls += 1`), a write into
  an object the function did not make (`self.table[k] = v`), `setattr` / `delattr`, and a read of a mutable
  container its module or closure keeps (a dict, a list, any mutable mapping whose contents may change between
  replays), but for transformers' function registries, whose contents are then compared before every replay;
- a log written every step (a replay writes none): a `logger` call other than the `*_once` ones, `warnings.warn`,
  `print`.

Anything else it read (module attributes, configs, the torch functions it calls) is compared before every replay
(`staleness.py`, `names.py`). A decision the rules cannot see (a branch on something they do not name) is
caught by recording twice, at two positions, and comparing the ops and scalars of the two runs (`verdict.py`).
"""

from __future__ import annotations

import ast
import collections.abc
import sys

CACHE_NAMES = frozenset(("past_key_values", "past_key_value", "cache", "layer_past", "past_key_values_cache"))
_HOST_READS = frozenset(("item", "tolist", "cpu", "numpy"))
# what tells a cache's length, under any name: the methods and counters of transformers' caches and layers
_LENGTH_READS = frozenset(("get_seq_length", "get_mask_sizes", "get_max_cache_shape", "get_usable_length",
                           "cumulative_length", "seen_tokens", "_seen_tokens"))
# what a cache tells that its type and layers fix for the call (the layer kinds), not the step: read freely
_CACHE_FIXED = frozenset(("update", "is_sliding", "is_linear", "is_dummy", "is_compileable"))
_HOST_STATE = frozenset(("time", "random", "os", "sys", "datetime", "np", "numpy", "threading", "print", "input",
                         "open", "setattr", "delattr", "globals", "locals", "vars", "eval", "exec"))
_LOGGERS = frozenset(("logger", "logging", "warnings"))
_HEADERS = {ast.If: ("test",), ast.While: ("test",), ast.For: ("target", "iter"), ast.AsyncFor: ("target", "iter"),
            ast.With: ("items",), ast.AsyncWith: ("items",), ast.Try: (), ast.Match: ("subject",)}
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def why_refused(function_node, executed: set, names: dict, registries: list | None = None) -> str | None:
    """The first rule a statement of `function_node` among the `executed` lines breaks, as a reason; None: none.
    `names`: the globals it ran with and its free variables' values (a container it reads there is state kept
    between calls). A transformers registry it reads (`GeneralInterface`: the attention, mask and experts functions)
    is appended to `registries`: its contents are compared before every replay (`staleness.ModelGraphs.watch`)."""
    global _LOCALS, _GLOBALS, _REGISTRIES
    _LOCALS, _GLOBALS, _REGISTRIES = _local_names(function_node), names, registries if registries is not None else []
    try:
        return _block(function_node.body, executed)
    finally:
        _GLOBALS, _REGISTRIES = {}, []


_LOCALS: frozenset = frozenset()  # the names the function being judged binds itself (its arguments, assignments)
_GLOBALS: dict = {}
_REGISTRIES: list = []
# mutable containers a module or a closure keeps: their contents can change between replays unseen (a mapping that is
# not a dict, such as transformers' registries, too: red team hole 1), except transformers' registries, watched
_CONTAINERS = (collections.abc.MutableMapping, collections.abc.MutableSequence, collections.abc.MutableSet,
               bytearray)


def _local_names(function_node) -> frozenset:
    names = set()
    for item in ast.walk(function_node):
        if isinstance(item, ast.arg):
            names.add(item.arg)
        elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
            names.add(item.id)
    return frozenset(names)


def _block(statements, executed) -> str | None:
    for statement in statements:
        why = _statement(statement, executed)
        if why is not None:
            return why
    return None


def _statement(node, executed) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        # a definition runs nothing but its decorators and defaults; a nested function that ran has lines of its own
        if not _ran(node.lineno, node.lineno, executed):
            return _block(node.body, executed) if isinstance(node, ast.ClassDef) else _nested(node, executed)
        why = _expressions([*node.decorator_list, *getattr(getattr(node, "args", None), "defaults", [])],
                           node.lineno)
        return why or (_nested(node, executed) if not isinstance(node, ast.ClassDef) else None)
    headers = next((fields for kind, fields in _HEADERS.items() if isinstance(node, kind)), None)
    if headers is not None:
        first_body = min((child.lineno for name in _BODIES for child in getattr(node, name, []) or []
                          if hasattr(child, "lineno")), default=node.end_lineno + 1)
        if _ran(node.lineno, max(node.lineno, first_body - 1), executed):
            values = []
            for name in headers:
                value = getattr(node, name)
                values += value if isinstance(value, list) else [value]
            why = _expressions(values, node.lineno)
            if why is not None:
                return why
        for name in _BODIES:
            for child in getattr(node, name, []) or []:
                body = child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else None
                why = _block(body, executed) if body is not None else _statement(child, executed)
                if why is not None:
                    return why
        return None
    if not _ran(node.lineno, node.end_lineno, executed):
        return None
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return f"line {node.lineno}: a {type(node).__name__.lower()} statement (state kept between calls)"
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    for target in targets:
        for item in ast.walk(target):
            if isinstance(item, ast.Attribute) and isinstance(item.ctx, (ast.Store, ast.Del)):
                return f"line {node.lineno}: sets the attribute {item.attr!r} (state kept between calls)"
            if isinstance(item, ast.Subscript) and isinstance(item.ctx, (ast.Store, ast.Del)) and not (
                    isinstance(item.value, ast.Name) and item.value.id in _LOCALS):
                # a tensor the function made may be written in place (a captured op); what another object holds
                # (`self.table[k] = v`, a module's dict) is state kept between calls
                return f"line {node.lineno}: writes into an object it did not make (state kept between calls)"
    return _expressions([node], node.lineno)


def _nested(node, executed) -> str | None:
    return _block(node.body, executed)


def _ran(first: int, last: int, executed: set) -> bool:
    return any(line in executed for line in range(first, last + 1))


def _expressions(nodes, line: int) -> str | None:
    for root in nodes:
        if root is None:
            continue
        parents = {}
        for parent in ast.walk(root):
            for child in ast.iter_child_nodes(parent):
                parents[child] = parent
        for item in ast.walk(root):
            why = _node(item, parents)
            if why is not None:
                return f"line {getattr(item, 'lineno', line)}: {why}"
    return None


def _node(item, parents) -> str | None:
    if isinstance(item, ast.Name) and isinstance(item.ctx, ast.Load):
        if item.id in _HOST_STATE and item.id not in _LOCALS:
            return f"reads {item.id!r} on the host"
        if item.id in CACHE_NAMES:
            return _cache_use(item, parents)
        value = _GLOBALS.get(item.id) if item.id not in _LOCALS else None
        if isinstance(value, _CONTAINERS):
            if is_registry(value):
                if not any(value is seen for seen in _REGISTRIES):
                    _REGISTRIES.append(value)
            else:
                return f"reads the global {item.id!r}, a {type(value).__name__} its module keeps"
        if item.id in _LOGGERS and item.id not in _LOCALS:
            parent = parents.get(item)
            attr = parent.attr if isinstance(parent, ast.Attribute) else ""
            if not attr.endswith("_once"):
                return f"writes a log every step ({item.id}.{attr or '...'})"
    if isinstance(item, ast.Attribute) and item.attr in _HOST_READS and isinstance(parents.get(item), ast.Call) \
            and parents[item].func is item:
        return f"reads the device on the host (.{item.attr}())"
    if isinstance(item, ast.Attribute) and item.attr in _LENGTH_READS:
        # whatever holds the cache under another name (`kwargs["past_key_values"]`, a renamed argument)
        return f"reads {item.attr!r} on the host (a cache's length)"
    if isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id in ("getattr", "hasattr") \
            and item.args and isinstance(item.args[0], ast.Name) and item.args[0].id in CACHE_NAMES:
        return f"reads the cache on the host ({item.func.id}())"
    return None


def is_registry(value) -> bool:
    """One of transformers' function registries (`GeneralInterface`: attention, mask, experts functions)."""
    generic = sys.modules.get("transformers.utils.generic")
    interface = getattr(generic, "GeneralInterface", None)
    return interface is not None and isinstance(value, interface)


def _cache_use(name, parents) -> str | None:
    """The cache only passed on (a call's argument, a keyword's value, a conditional expression's branch, a comparison
    with None, a tuple of arguments) or its `update` called."""
    parent = parents.get(name)
    if isinstance(parent, ast.Attribute):
        call = parents.get(parent)
        if parent.attr == "update" and isinstance(call, ast.Call) and call.func is parent:
            return None
        if parent.attr in _CACHE_FIXED and parent.attr != "update":
            return None
        return f"reads the cache's {parent.attr!r} on the host (the step's length)"
    if isinstance(parent, ast.Call) and parent.func is not name:
        if isinstance(parent.func, ast.Name) and parent.func.id in ("len", "iter", "list", "tuple", "enumerate",
                                                                    "bool"):
            return f"reads the cache on the host ({parent.func.id}())"
        return None
    if isinstance(parent, (ast.keyword, ast.IfExp, ast.Tuple, ast.Starred, ast.Return, ast.Assign, ast.NamedExpr,
                           ast.Dict)):
        return None
    if isinstance(parent, ast.Compare) and all(isinstance(c, ast.Constant) and c.value is None
                                               for c in parent.comparators):
        return None  # `cache is not None`: the cache's presence is fixed for the call (one is required)
    if isinstance(parent, ast.Compare) and isinstance(parent.left, ast.Name) and parent.left is not name:
        return None
    if isinstance(parent, ast.BoolOp):
        return "reads the cache's truth on the host"
    if isinstance(parent, ast.Call) and parent.func is name:
        return "calls the cache"
    if parent is None or isinstance(parent, (ast.Expr, ast.Compare)):
        return None
    return f"reads the cache on the host ({type(parent).__name__})"
