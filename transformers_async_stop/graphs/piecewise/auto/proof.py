"""The automatic proof of one recording: every function it ran is read code under another name, or passed the rules,
and (where one passed only the rules) a second recording at another position ran the same ops.

`why_unproven(watch, family, read)` is asked after each recording of a family found by `discover.py` (the hand-read
families keep their digests): the transformers functions the recording's run executed (`run_watch.RunWatch`), each
taken as a whole definition:
- its normal digest (`normal_form.py`) is one of a read source's: it is that read code (a modular copy);
- otherwise every statement of it that ran passes `rules.why_refused`: it is *checked*, and the recording is kept only
  once a second one, at a later position, ran the same ATen ops with the same scalars and tensor geometry
  (`first_difference`), so that nothing the rules do not name decided differently with the step.
Code of neither transformers, torch, the standard library nor this package that ran (a user's function rebound into
a module, a patched method) refuses the recording, named.
"""

from __future__ import annotations

import dataclasses
import sys

from . import normal_form, rules


@dataclasses.dataclass
class Verdict:
    why: str | None  # the recording cannot be kept (None: it can)
    checked: tuple = ()  # the functions that passed the rules alone (the recording must be confirmed)
    # what the functions that ran look up by name, to compare before every replay (`staleness.ModelGraphs.watch`):
    # (namespace dict, name, object) entries, and the registries they read
    names: list = dataclasses.field(default_factory=list)
    registries: list = dataclasses.field(default_factory=list)


def why_unproven(watch, family, read: frozenset) -> Verdict:
    for code, module in watch.foreign.items():
        return Verdict(f"code the package has not read ran in the forward: {module}.{_qualname(code)}")
    if watch.stray:
        # an op between a cache update and its attention ran outside every piece: no replay would run it again
        return Verdict(f"{watch.stray[0][0]} ran between a cache update and its attention")
    prefix = normal_form.family_prefix(family.causal_lm)
    nodes: dict = {}  # id(def) -> (def, module, lines)
    for code, lines in watch.lines.items():
        node = normal_form.def_at(code.co_filename, code.co_firstlineno)
        module = watch.modules.get(code, "")
        if node is None:
            return Verdict(f"transformers code without a readable source ran: {module}.{_qualname(code)}")
        entry = nodes.setdefault(id(node), (node, module, set(), code))
        entry[2].update(lines)
    checked, registries = [], []
    for node, module, lines, code in nodes.values():
        digest = normal_form.normal_digest(node, prefix if module == family.module else None)
        if digest in read or _generic_read(module, code):
            continue
        names = dict(vars(sys.modules[module])) if module in sys.modules else {}
        names.update(watch.closures.get(code, {}))
        why = rules.why_refused(node, lines, names, registries)
        if why is not None:
            return Verdict(f"{module}.{node.name} {why}")
        checked.append(f"{module}.{node.name}")
    return Verdict(None, tuple(sorted(checked)), _looked_up(watch), registries)


def _looked_up(watch) -> list:
    """(namespace dict, name, object) for every name the transformers code that ran looks up in its module's globals
    or in torch's namespaces: rebound after the recording (`_grouped_linear`, `F.grouped_mm` set by user code), stock's
    next forward runs the new object and a replay the recorded one (red team hole 2)."""
    from ..code_names import torch_entries
    from ..eligibility import patched_targets

    patched = patched_targets()  # the package's own patches change with `apply()` / `unpatch()`, not a user's
    entries, names = [], set()
    for code, module in watch.modules.items():
        owner = sys.modules.get(module)
        table = vars(owner) if owner is not None else {}
        for name in code.co_names:
            names.add(name)
            if name in table and (id(owner), name) not in patched:
                entries.append((table, name, table[name]))
    return entries + torch_entries(names)


GENERIC = "piecewise generic machinery (found families)"


def _generic_read(module: str, code) -> bool:
    """`code` lies in one of transformers' generic sources read by hand for every family (`targets/piecewise_rows.py`,
    `GENERIC`: the output-capturing wrapper, the output types' registration), as installed."""
    from ....release_checks.verified import matches, sources_of

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
