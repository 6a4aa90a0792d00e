"""Code identified by the code object that ran, not by its file and line (issue 43, holes 2 and 3).

The proof judges a transformers function by its source: the file's text at the line the code object names
(`normal_form.def_at`, `rules.py`), or its digest (`verified.py`). That is sound only where the code that ran *is*
that text. Two ways it is not:
- code compiled from a string and run in a modeling module's namespace (`exec(compile(src, "<patch>", "exec"),
  vars(modeling_x))`, what source-rewriting patchers do): its file is no file;
- code compiled from an edited source under the modeling file's own name and line numbers (`compile(src,
  modeling_x.__file__, "exec")`): its file is a file, but not the text that compiled to it.

`why_not_file_code(code)` compiles the file's text as the import system does (the whole module, so every flag a
`__future__` import sets is the file's) and finds the code object of the same name at the same line: the code that
ran must equal it (CPython's code equality: bytecode, constants, names, line table; not the file name). One compile per
file and version of its text, per process; each code object's verdict is remembered with it, weakly.

Code compiled from a string is the standard library's only where it is a method that `dataclasses` or
`collections.namedtuple` generated for a class of transformers' or torch's (the output types' `__init__`): checked by
the code object itself being that class's method (`why_not_generated`). Any other is foreign, and the recording is
refused with its name (`verdict.py`).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import weakref

_GENERATED = frozenset(("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__lt__",
                        "__le__", "__gt__", "__ge__", "__new__", "<lambda>", "__match_args__", "__getstate__",
                        "__setstate__", "__replace__"))
_OWN = ("transformers.", "torch.")
_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # code -> verdict (None: the file's code)


def why_not_file_code(code) -> str | None:
    """None where `code` is what compiling its file's current text gives at its line; the reason otherwise."""
    try:
        found = _VERDICTS.get(code, False)
    except TypeError:
        found = False
    if found is not False:
        return found
    verdict = _judge(code)
    try:
        _VERDICTS[code] = verdict
    except TypeError:
        pass
    return verdict


def _judge(code) -> str | None:
    filename = code.co_filename
    lines = linecache.getlines(filename)
    if not lines:
        return "its file has no readable source"
    try:
        stat = os.stat(filename)
        version = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = None
    compiled = _file_codes(filename, len(lines), version)
    if compiled is None:
        return "its file's text does not compile"
    for candidate in compiled.get((code.co_firstlineno, code.co_name), ()):
        if candidate == code:
            return None
    return "it is not the code its file's text compiles to at that line (compiled from another source)"


@functools.lru_cache(maxsize=128)
def _file_codes(filename: str, size: int, version) -> dict | None:
    """(first line, name) -> the code objects compiling the file's text gives, nested ones included."""
    try:
        module = compile("".join(linecache.getlines(filename)), filename, "exec", dont_inherit=True,
                         optimize=sys.flags.optimize)
    except (SyntaxError, ValueError):
        return None
    table: dict = {}
    stack = [module]
    while stack:
        code = stack.pop()
        table.setdefault((code.co_firstlineno, code.co_name), []).append(code)
        stack += [const for const in code.co_consts if hasattr(const, "co_code")]
    return table


def why_not_generated(code, owner_type) -> str | None:
    """None where `code`, compiled from a string, is a method `dataclasses` or `namedtuple` generated for a class of
    transformers' or torch's (`owner_type`: the type of the instance or class it ran for); the reason otherwise."""
    if code.co_name not in _GENERATED or not isinstance(owner_type, type):
        return "code compiled from a string"
    for klass in owner_type.__mro__:
        if not klass.__module__.startswith(_OWN):
            continue
        if "__dataclass_fields__" not in vars(klass) and "_fields" not in vars(klass):
            continue
        for value in vars(klass).values():
            if _holds(getattr(value, "__func__", value), code, 3):
                return None
    return "code compiled from a string"


def _holds(function, code, depth: int) -> bool:
    """`function` has `code`, or wraps a function that has it (its closure or `__wrapped__`, `depth` levels down: a
    dataclass's `__init__` wrapped by transformers' own, 5.24's `_BCCacheNameMeta`)."""
    if getattr(function, "__code__", None) is code:
        return True
    if depth == 0 or not hasattr(function, "__code__"):
        return False
    inner = [cell.cell_contents for cell in function.__closure__ or () if _full(cell)]
    wrapped = getattr(function, "__wrapped__", None)
    return any(_holds(item, code, depth - 1) for item in (*inner, *([wrapped] if wrapped is not None else [])))


def _full(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def functions_of(modules: dict):
    """`modules`: code object -> the module whose globals it ran with (`watch.RunWatch.modules`). The functions that
    hold those code objects, found in their modules' namespaces (module functions, class members along decorators'
    wrappers), and the first code object that none holds and that is no nested function of one that is held (its
    code state could change unwatched: red team of the proof pipeline, hole 1), or None."""
    held: dict = {}
    for name in set(modules.values()):
        owner = sys.modules.get(name)
        if owner is not None:
            held.update(_module_functions(owner))
    functions = {id(held[code]): held[code] for code in modules if code in held}
    # a nested function's code is fixed by the code of the function it is defined in (a constant of it): a wrapper a
    # decorator or a metaclass makes (5.24's `_BCCacheNameMeta` wraps each output type's `__init__`) is one
    nested = set()
    stack = list(held)
    while stack:
        code = stack.pop()
        for const in code.co_consts:
            if hasattr(const, "co_code") and const not in nested:
                nested.add(const)
                stack.append(const)
    unresolved = next((code for code in modules if code not in held and code not in nested), None)
    return list(functions.values()), unresolved


def _module_functions(module) -> dict:
    """code object -> function, for the functions of `module`'s namespace and of the classes it defines (properties,
    class and static methods included), through decorators' wrappers (`__wrapped__`, closure cells)."""
    found: dict = {}
    stack = []
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            stack += list(vars(value).values())
        else:
            stack.append(value)
    seen = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, property):
            stack += [value.fget, value.fset, value.fdel]
            continue
        if isinstance(value, (classmethod, staticmethod)):
            stack.append(value.__func__)
            continue
        code = getattr(value, "__code__", None)
        if code is None or not hasattr(value, "__closure__"):
            continue
        found.setdefault(code, value)
        stack += [cell.cell_contents for cell in value.__closure__ or () if _full(cell)]
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is not None:
            stack.append(wrapped)
    return found
