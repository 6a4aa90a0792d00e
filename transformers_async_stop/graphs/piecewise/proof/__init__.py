"""The proof that a model's decode forward may be replayed, as one pipeline (docs/design/family-proof.md).

A replay is sound only for the code objects the proof saw run, and for the state those objects can read. The
recording path (`forward.PiecewiseForward`) runs the stages in order, and each has one module:

1. **find the family and admit the call** (`family.find`, `admission.why_not_model`): which modules the forward is
   cut at, and what must hold of the model and the call (the switch, the configuration, the placement, default-deny
   of every module class, no hooks, no rebound names). An unchanged model's next call asks only what a call can
   change (`admission.why_not_again`);
2. **watch the recording** (`watch.RunWatch`, installed around the recording's forward by `graphs.record`): every
   transformers function and every other code object that ran, the ATen ops of each piece;
3. **give the verdict** (`verdict.judge`): foreign code, code compiled from a string or from another source than its
   file's (`identity.py`), custom ops and ops outside the pieces refuse the recording; a found family's functions are
   read code under another name (`normal_form.py`) or pass the rules (`rules.py`) and are confirmed at a second
   position (`verdict.first_difference`);
4. **hand over the set of things to watch** (`handover.py`): what every replay compares first, per step
   (`WatchSet.why_eager`) and in the model's snapshot (`staleness.ModelGraphs.changed`, with the code state of every
   watched function and callable, `callables.py`). `hand_over` takes the snapshot.

Helpers of the stages: `discover.py` (a family's layout, found), `default_deny.py` (which classes and torch functions
are proven), `observed.py` (hooks, tensors, the cache), `names.py` (the names a replay skips).
"""

from __future__ import annotations

import sys

from . import default_deny, names
from .admission import PIECEWISE_ENV, why_not_again, why_not_model
from .family import FAMILIES, Family, base_of, family_of, find
from .handover import WatchSet
from .normal_form import read_digests
from .verdict import Verdict, first_difference, judge
from .watch import RunWatch, why_busy

__all__ = ["FAMILIES", "PIECEWISE_ENV", "Family", "RunWatch", "Verdict", "WatchSet", "base_of", "family_of", "find",
           "first_difference", "hand_over", "judge_recording", "watch_for", "why_not_again", "why_not_model"]


def watch_for(family):
    """Stage 2: the watch to install around a recording of `family`'s forward: (watch, None), or (None, why none can
    be installed). A hand-read family under a debugger or coverage (a trace function already set) records unwatched,
    as before the watch existed: its code is read and digested; a found family is proven only by what it ran, and
    stays eager."""
    why = why_busy()
    if why is not None:
        return (None, why) if family.auto else (None, None)
    # a hand-read family's code is read: which code objects ran is what its proof needs (identity, foreign code);
    # its lines and ops are not traced (a Python dispatch mode under `inference_mode` sees composite ops before they
    # decompose, and may pick other kernels than eager: the recording must run the eager ones)
    return RunWatch(trace_ops=family.auto, trace_lines=family.auto), None


def judge_recording(watch, family) -> Verdict:
    """Stage 3: the verdict on the recording `watch` saw."""
    return judge(watch, family, read_digests(FAMILIES.values()))


def hand_over(graphs, model, watch_set: WatchSet | None = None) -> None:
    """Stage 4: the model's snapshot, compared before every replay (`staleness.ModelGraphs.changed`), with the torch
    names and internals its replayed Python looks up, and the code state of every function a replay skips
    (`watch_set`'s; one made from the model as it is now where None is given)."""
    if watch_set is None:
        watch_set = WatchSet(model, family_of(model))
    module = sys.modules[type(base_of(model)).__module__]
    functions = names.watched_functions(model, module) + default_deny.torch_internals(
        [type(model), *map(type, model.modules())])
    graphs.snapshot(model, functions, watch_set.functions())
