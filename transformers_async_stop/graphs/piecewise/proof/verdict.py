"""Stage 3 of the proof: the verdict on one recording, from what its run executed (`watch.py`).

A replay is sound only for the code objects the proof saw run, and for the state those objects can read. So:
- code of neither transformers, torch, the standard library nor this package that ran (a user's function rebound
  into a module, a patched method, a Python kernel registered for an op) refuses the recording, named;
- so does code compiled from a string (`exec` in a modeling module's namespace), unless it is a method the standard
  library generated for a dataclass or named tuple of transformers' or torch's (`identity.why_not_generated`), and
  transformers code that is not its file's text at its line (compiled from an edited source under the file's name:
  `identity.why_not_file_code`): the proof below judges the file's text, so the text must be what ran;
- an op dispatched between a cache update and its attention (no replay runs it again), and an op outside ATen's and
  prims' namespaces (a custom op, whose kernel can be registered anew between calls), refuse it too;
- for a family found by `discover.py` (the hand-read families' code is read and digested: `admission.py`), each
  transformers function that ran, taken as a whole definition, is read code under another name (its normal digest,
  `normal_form.py`, is a read source's: a modular copy), or passes `rules.why_refused` on the lines it executed: it
  is *checked*, and the recording is kept only once a second one, at a later position, ran the same ATen ops with the
  same scalars and tensor geometry (`first_difference`), so that nothing the rules do not name decided differently
  with the step.
What the code that ran looks up by name (`names`), and the registries it read, go to stage 4 (`handover.py`), to be
compared before every replay, kept or not (a failed proof is tried again once they change).
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import sys

from ....release_checks.verified import matches, sources_of
from . import identity, kernels, normal_form, rules
from .names import builtin_entries, patched_targets, torch_entries


@dataclasses.dataclass
class Verdict:
    why: str | None  # the recording cannot be kept (None: it can)
    checked: tuple = ()  # the functions that passed the rules alone (the recording must be confirmed)
    # what the functions that ran look up by name, to compare before every replay (`staleness.ModelGraphs.watch`):
    # (namespace dict, name, object) entries, and the registries they read
    names: list = dataclasses.field(default_factory=list)
    registries: list = dataclasses.field(default_factory=list)
    # the functions whose code ran, whose code state is compared before every replay (`callables.CallableState`)
    functions: list = dataclasses.field(default_factory=list)


# the namespaces of the ops a recording may hold: ATen's and its primitives' (any other is a custom op, whose kernel is
# whatever is registered when it runs)
_OP_NAMESPACES = ("aten.", "prims.")


def judge(watch, family, read: frozenset) -> Verdict:
    """The verdict on the recording whose run `watch` saw (see the module docstring)."""
    names = _looked_up(watch)
    # transformers' registries among them (the experts functions...) are compared by their contents, refused or not:
    # a user's function registered there, then taken out again, tries the recording again
    # (looked up by name, or held in a closure: `use_experts_implementation`'s `experts_interface`)
    held = [*(value for _, _, value in names), *(value for values in watch.closures.values()
                                               for value in values.values())]
    registries = [value for value in {id(value): value for value in held}.values() if rules.is_registry(value)]
    functions, unresolved = identity.functions_of(watch.modules)
    functions += _globals_loaded(watch)
    why = _why_foreign(watch) or (
        f"transformers code ran that no function the proof watches holds: {watch.modules.get(unresolved)}."
        f"{_qualname(unresolved)}" if unresolved is not None else None)
    if why is not None:
        return Verdict(why, names=names, registries=registries, functions=functions)
    if not family.auto:
        return Verdict(None, names=names, registries=registries, functions=functions)
    prefix = normal_form.family_prefix(family.causal_lm)
    nodes: dict = {}  # id(def) -> (def, module, lines)
    for code, lines in watch.lines.items():
        node = normal_form.def_at(code.co_filename, code.co_firstlineno)
        module = watch.modules.get(code, "")
        if node is None:
            return Verdict(f"transformers code without a readable source ran: {module}.{_qualname(code)}", names=names,
                           registries=registries, functions=functions)
        entry = nodes.setdefault(id(node), (node, module, set(), code))
        entry[2].update(lines)
    checked = []
    for node, module, lines, code in nodes.values():
        digest = normal_form.normal_digest(node, prefix if module == family.module else None)
        if digest in read or _generic_read(module, code):
            continue
        namespace = dict(vars(sys.modules[module])) if module in sys.modules else {}
        namespace.update(watch.closures.get(code, {}))
        why = rules.why_refused(node, lines, namespace, registries)
        if why is not None:
            return Verdict(f"{module}.{node.name} {why}", names=names, registries=registries, functions=functions)
        checked.append(f"{module}.{node.name}")
    return Verdict(None, tuple(sorted(checked)), names, registries, functions)


def _why_foreign(watch) -> str | None:
    """Code or ops the recording ran that no proof covers (see the module docstring), as a reason; None: none."""
    for code, module in watch.foreign.items():
        return f"code the package has not read ran in the forward: {module}.{_qualname(code)}"
    for code, (module, owner) in watch.generated.items():
        why = identity.why_not_generated(code, owner)
        if why is not None:
            return f"{why} ran in the forward: {module}.{_qualname(code)}"
    for code, module in watch.foreign_globals.items():
        return f"transformers code ran with globals other than its module's: {module}.{_qualname(code)}"
    for code in watch.lines:
        why = identity.why_not_file_code(code)
        if why is not None:
            return f"transformers code ran that the proof cannot read: {watch.modules.get(code, '?')}." \
                   f"{_qualname(code)} ({why})"
    if watch.stray:
        # an op between a cache update and its attention ran outside every piece: no replay would run it again
        return f"{watch.stray[0][0]} ran between a cache update and its attention"
    for op in watch.ops or ():
        if not op[0].startswith(_OP_NAMESPACES):
            return f"a custom op ran in the forward ({op[0]}): its kernel can be registered anew between calls"
    return kernels.why_foreign_kernels(op[0] for op in watch.ops or ())


def _looked_up(watch) -> list:
    """(namespace dict, name, object) for every name the transformers code that ran looks up in its module's globals
    or in torch's namespaces: rebound after the recording (`_grouped_linear`, `F.grouped_mm` set by user code), stock's
    next forward runs the new object and a replay the recorded one (red team hole 2)."""
    patched = patched_targets()  # the package's own patches change with `apply()` / `unpatch()`, not a user's
    entries, names = [], set()
    for code, module in watch.modules.items():
        owner = sys.modules.get(module)
        table = vars(owner) if owner is not None else {}
        for name in code.co_names:
            names.add(name)
            if name in table and (id(owner), name) not in patched:
                entries.append((table, name, table[name]))
    return entries + torch_entries(names) + builtin_entries(names)


def _globals_loaded(watch) -> list:
    """The objects the code that ran loads as globals (its module's, or a builtin): called or read by the replayed
    Python, so their state is followed (`callables.CallableState`), and a callable whose state cannot be read
    refuses the recording. `co_names` also holds attribute names (`nn.functional.silu`): only the global loads count."""
    loaded = []
    for code, module in watch.modules.items():
        owner = sys.modules.get(module)
        table = vars(owner) if owner is not None else {}
        for name in _global_loads(code):
            value = table.get(name, _MISSING)
            if value is _MISSING:
                value = vars(builtins).get(name, _MISSING)
            if value is not _MISSING and callable(value):
                loaded.append(value)
    return list({id(value): value for value in loaded}.values())


_MISSING = object()


@functools.lru_cache(maxsize=8192)
def _global_loads(code) -> tuple:
    return tuple({instruction.argval for instruction in dis.get_instructions(code)
                  if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")})


GENERIC = "piecewise generic machinery (found families)"


def _generic_read(module: str, code) -> bool:
    """`code` lies in one of transformers' generic sources read by hand for every family (`targets/piecewise_rows.py`,
    `GENERIC`: the output-capturing wrapper, the output types' registration), as installed."""
    name = normal_form.outer_name(code.co_filename, code.co_firstlineno)
    return name is not None and f"{module}:{name}" in sources_of(GENERIC) and matches(GENERIC)


def first_difference(ops_a: list, ops_b: list) -> str | None:
    """Where two recordings' runs dispatched different ops (None: the same ops, scalars and geometry)."""
    for index, (a, b) in enumerate(zip(ops_a, ops_b)):
        if a != b:
            return f"op {index}: {a[0]} differs ({_short(a)} vs {_short(b)})"
    if len(ops_a) != len(ops_b):
        return f"{len(ops_a)} ops vs {len(ops_b)}"
    return None


def _short(op) -> str:
    text = repr(op[1:])
    return text if len(text) < 120 else text[:117] + "..."


def _qualname(code) -> str:
    return getattr(code, "co_qualname", code.co_name)
