"""Is the installed transformers code one that a shortcut was checked against?

Some per-call shortcuts of the deferred loop compute what a piece of stock code computes, with less host work
(`targets.SHORTCUTS` lists them, each with the digests of the upstream sources it was read against). The digest of
the installed source is taken at first use and again whenever one of the sources is another object than the one
digested (user code may rebind a method, e.g. wrap a processor's `__call__`, after a first call). On a release
whose source is not in the table the shortcut is off and the stock code runs: exact by construction. The drift test
(`tests/test_patching.py`) fails on such a release, so the table is reviewed and extended rather than silently wrong.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import operator
import os
import sys
import types
import textwrap
import threading
import weakref

from .targets import SHORTCUTS

logger = logging.getLogger("transformers_async_stop")

_BY_NAME = {shortcut.name: shortcut for shortcut in SHORTCUTS}
_RESULTS: dict[str, bool] = {}
_DIGESTED: dict[str, tuple] = {}  # per shortcut: the objects its verdict in `_RESULTS` was taken on
_LINKS: dict[str, tuple] = {}  # per shortcut: the lookups that resolved those objects (`_links`)
_LOCK = threading.Lock()
_MISSING = object()
_METHOD = types.MethodType
_BODY = operator.attrgetter("__code__", "__defaults__", "__kwdefaults__", "__closure__")
_CONTENTS = operator.attrgetter("cell_contents")
_chain = itertools.chain.from_iterable
_OWN_MARK = "_transformers_async_stop_patched"  # `config.MARKER`


_READ: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a function -> (its code, the digest)


def _read(obj) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode("utf-8")).hexdigest()[:12]


def source_digest(obj) -> str:
    """sha256 (first 12 hex digits) of an object's source as written in its file, dedented.

    A function's is read once per code object: `inspect.getsource` tokenizes the whole file around it (milliseconds a
    source), and a verdict is taken again whenever a source is another object than the one it was taken on. Whoever
    rebinds a source back and forth (`unpatch()` / `apply()` around each stock call of the benchmark, a library
    patching `_sample` for the length of a call) made every call read and tokenize the sources again: 64-88 ms per
    call on an H200 host (issue 38). What `getsource` reads for a function is the innermost function of its
    `__wrapped__` chain (a bound method's `__func__`), found by its code object, which is immutable: the same
    function with the same code has the same source. Exactly that, as `inspect` does it: `__func__` is followed for a
    bound method only (a wrapper that merely holds the original in a `__func__` attribute is read as itself: red team
    of the memo, hole 1), and anything but a plain function (a class, found by its `__qualname__` and `__module__`,
    both settable) is read every time. Kept by a weak reference: a digested replacement, its closure and globals are
    not kept alive by the memo."""
    target = inspect.unwrap(obj)
    if isinstance(target, types.MethodType):
        target = target.__func__
    if type(target) is not types.FunctionType:
        return _read(obj)
    code = target.__code__
    saved = _READ.get(target)
    if saved is not None and saved[0] is code:
        return saved[1]
    digest = _read(obj)
    _READ[target] = (code, digest)
    return digest


def installed_digests(name: str) -> dict[str, str | None]:
    """The digest of every upstream source the shortcut `name` relies on, as installed (None: not found, or
    wrapped by code that is neither transformers', torch's nor this package's: its source is not the one read)."""
    found = {}
    for source in _BY_NAME[name].sources:
        try:
            obj = _resolve(source)
            found[source] = None if _foreign_wrapper(obj) else source_digest(obj)
        except (ImportError, AttributeError, OSError, TypeError):
            found[source] = None
    return found


def _objects(name: str) -> tuple:
    objects = []
    for source in _BY_NAME[name].sources:
        try:
            obj = _resolve(source)
            objects.append(getattr(obj, "__func__", obj))  # a bound classmethod is a new object at every lookup
        except (ImportError, AttributeError):
            objects.append(None)
    return tuple(objects)


def off_by_user_code(name: str) -> bool:
    """Whether the shortcut `name` is off only because user code stands where a source is (a class-level wrapper, a
    replacement: code in none of transformers', torch's or this package's files), not because the release's sources
    differ. The release notice names only the latter: computed once per process, a wrapper there at the first flagged
    call made it report "sources differ" on every later call (found in this stop's 5.17 suite)."""
    shortcut = _BY_NAME[name]
    user = False
    for source, digest in installed_digests(name).items():
        if digest is not None and digest in shortcut.digests.get(source, {}):
            continue
        try:
            obj = _resolve(source)
        except (ImportError, AttributeError):
            return False  # missing: the release's doing
        if not is_user_code(obj):
            return False  # transformers' own code, other than read: the release's doing
        user = True
    return user


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def is_user_code(obj) -> bool:
    """A Python function (or a method's function) whose code is in none of transformers', torch's or this package's
    files, and not one of the package's own patches: a user's wrapper or replacement."""
    from ..undo.module_state import library_dirs, real_path

    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is None or getattr(obj, _OWN_MARK, False):
        return False
    return not real_path(code.co_filename).startswith(library_dirs() + (_PACKAGE_DIR,))


def _foreign_wrapper(obj) -> bool:
    """Whether `obj` wraps another function (`functools.wraps`, whose source `inspect` shows instead) in code that
    is not transformers', torch's or this package's own patch."""
    from ..undo.module_state import library_dirs, real_path

    allowed = library_dirs()  # by real path: transformers imported under a second path is still transformers
    while getattr(obj, "__wrapped__", None) is not None:
        code = getattr(obj, "__code__", None)
        foreign = code is None or not real_path(code.co_filename).startswith(allowed)
        if foreign and not getattr(obj, _OWN_MARK, False):
            return True
        obj = obj.__wrapped__
    return False


def matches(name: str) -> bool:
    """Whether every upstream source behind the shortcut `name` is one it was checked against (as installed now)."""
    result = _RESULTS.get(name)
    objects = _DIGESTED.get(name)
    if result is not None and objects is not None:
        links = _LINKS.get(name)
        if not (_same_links(links) if links is not None else all(map(operator.is_, _objects(name), objects))):
            result = None  # a source was rebound since its verdict: take it again
    if result is None:
        with _LOCK:
            shortcut = _BY_NAME[name]
            objects = _objects(name)
            found = installed_digests(name)
            result = all(digest in shortcut.digests.get(source, {}) for source, digest in found.items())
            if not result:
                logger.info("transformers_async_stop: shortcut %s is off: %s differs from the sources it was "
                            "checked against; the stock code runs instead", name,
                            ", ".join(s for s, d in found.items() if d not in shortcut.digests.get(s, {})))
            _RESULTS[name] = result
            _DIGESTED[name] = objects
            _LINKS[name] = _links(name)
    return result


def _links(name: str):
    """Every lookup that resolves the shortcut's sources ("module:A.b" is `sys.modules["module"]`, then `.A`, then
    `.b`), with the object each gave: (modules' names, the modules, holders, attribute names, the objects, the last
    lookups whose object is a bound method: (holder, name, its function), and what the functions found run: their
    code, defaults and closure cells). Comparing these by identity is
    resolving every source again (`_objects`), without parsing its name: `matches` runs at every step of some loops.
    None where a source does not resolve (`_objects` then compares, as before)."""
    names, modules, holders, attrs, objects, methods, functions = [], [], [], [], [], [], []
    for source in _BY_NAME[name].sources:
        module_name, _, qualname = source.partition(":")
        module = sys.modules.get(module_name)
        if module is None:
            return None
        names.append(module_name)
        modules.append(module)
        obj, parts = module, qualname.split(".")
        for index, part in enumerate(parts):
            holder, obj = obj, getattr(obj, part, _MISSING)
            if obj is _MISSING:
                return None
            if index == len(parts) - 1 and getattr(obj, "__func__", None) is not None and type(obj) is _METHOD:
                methods.append((holder, part, obj.__func__))  # a bound classmethod: a new object at each lookup
            else:
                holders.append(holder)
                attrs.append(part)
                objects.append(obj)
            if index == len(parts) - 1:
                function = getattr(obj, "__func__", obj)
                if type(function) is types.FunctionType:
                    functions.append(function)
    # what each function found runs, beyond its identity: its code, defaults and closure cells' contents, each
    # replaceable in place (`f.__code__ = g.__code__`: the same object, other code; red team of the issue-38 cuts,
    # hole 2), as flat lists compared from C
    cells = [cell for function in functions for cell in function.__closure__ or ()]
    full = [cell for cell in cells if _cell(cell) is not _MISSING]
    bodies = (functions, list(map(_BODY, functions)), full, list(map(_CONTENTS, full)),
              [cell for cell in cells if _cell(cell) is _MISSING])
    return names, modules, holders, attrs, objects, methods, bodies


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _same_links(links) -> bool:
    """Every lookup of `_links` gives the very object it gave, and every function found runs what it ran."""
    names, modules, holders, attrs, objects, methods, functions = links
    get = sys.modules.get
    if any(map(operator.is_not, map(get, names), modules)):
        return False
    if any(map(operator.is_not, map(getattr, holders, attrs, itertools.repeat(None)), objects)):
        return False
    if not all(getattr(getattr(holder, attr, None), "__func__", None) is function
               for holder, attr, function in methods):
        return False
    functions, bodies, full, contents, empty = functions
    if any(map(operator.is_not, _chain(map(_BODY, functions)), _chain(bodies))):
        return False
    try:
        if any(map(operator.is_not, map(_CONTENTS, full), contents)):
            return False
    except ValueError:  # a cell emptied (`del` of a closure variable)
        return False
    return all(_cell(cell) is _MISSING for cell in empty)


def resolve_source(source: str):
    """"module:Qual.name" -> (the object, what holds it, the attribute's name)."""
    module_name, _, qualname = source.partition(":")
    holder_path, _, attr = qualname.rpartition(".")
    holder = _resolve(f"{module_name}:{holder_path}") if holder_path else sys.modules.get(module_name) or (
        __import__("importlib").import_module(module_name))
    return getattr(holder, attr), holder, attr


def sources_of(name: str) -> frozenset:
    """The upstream sources ("module:Qual.name") the shortcut `name` was read against."""
    return frozenset(_BY_NAME[name].sources)


def _resolve(source: str):
    """"module:Qual.name" -> the object."""
    import importlib

    module_name, _, qualname = source.partition(":")
    obj = sys.modules.get(module_name) or importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
