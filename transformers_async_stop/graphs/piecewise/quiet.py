"""When a decode step's staleness checks may be skipped: since the last full check, only code the package has read
can have run in this process.

Before each replay the graphed forward looks for anything user code changed since the recording
(`PiecewiseForward._why_not_observed`, `ModelGraphs.changed`: hook tables, module classes and children, parameters
and their storage, every plain attribute and config field, the torch names the replayed Python looks up). For a
16-layer model that is about 2,300 dictionary lookups per step, 200 µs of host time on a 2-core CI machine
(`scripts/step_checks_cost.py`), on the critical path of a GPU that waits for the host.

Only code changes the model. Between two decode steps of the dynamic-cache loop this thread runs the loop (this
package's), transformers' cache and attention code, the call's logits processors and stopping criteria, and the
streamer. When each processor and criterion is one of transformers' own classes that run tensor ops on their
arguments only (`_PROCESSORS`, `_CRITERIA`: none holds a callable or a model of the user's) with its class's own
`__call__`, there is no streamer, and nothing else can run Python in between, nothing the checks look at can have
changed since the previous step's full check found the model as recorded. "Nothing else" is checked per step:
  - no other thread (`threading.active_count() == 1`): another thread may change the model at any time, and stock's
    next forward would see it;
  - no trace, profile or monitoring function (a debugger's or coverage's callbacks run at every Python call);
  - no object freed by the cyclic garbage collector since the last check (a `__del__` or weakref callback of a user
    object may run there), and no gc callback;
and once per call: no Python signal handler of the user's.

What stays unseen: a raw `_thread` thread that never touched `threading`, a `sys.addaudithook` hook (it cannot be
listed), and a finalizer of a user object freed by reference count inside transformers' or this package's code
between two steps. Each needs user code written to change the model from outside the call's own callbacks.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading

from ...undo.module_state import package_dir, real_path

# transformers' processors and criteria that compute from their arguments and their own tensors only (the classes
# generate() builds from a GenerationConfig). Left out: those holding a user callable or a model
# (`PrefixConstrainedLogitsProcessor`, `UnbatchedClassifierFreeGuidanceLogitsProcessor`), the watermarking and
# model-specific ones, and every subclass (the type must be exactly one of these)
_PROCESSORS = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor", "LogitNormalization",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "ExponentialDecayLengthPenalty",
)
_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria", "MaxTimeCriteria", "StopStringCriteria", "ConfidenceCriteria")


def _classes(module, names) -> dict:
    """{class: its module's file} for the names this release has."""
    where = real_path(module.__file__)
    return {getattr(module, name): where for name in names if isinstance(getattr(module, name, None), type)}


def _own_call(obj, allowed: dict) -> bool:
    """`obj` is exactly one of `allowed`'s classes, called through its class's own `__call__` (not rebound by user
    code on the class, nor set on the instance)."""
    cls = type(obj)
    where = allowed.get(cls)
    if where is None or "__call__" in getattr(obj, "__dict__", ()):
        return False
    code = getattr(getattr(cls.__call__, "__func__", cls.__call__), "__code__", None)
    return code is not None and real_path(code.co_filename) == where


def _package_criterion(criterion) -> bool:
    """One of this package's own criteria (the assistant's `DeviceConfidence`), with its class's `__call__`."""
    cls = type(criterion)
    code = getattr(cls.__call__, "__code__", None)
    return (cls.__module__.startswith(__name__.split(".")[0] + ".") and code is not None
            and "__call__" not in getattr(criterion, "__dict__", ())
            and real_path(code.co_filename).startswith(package_dir()))


def _default_signal_handlers() -> bool:
    """No Python signal handler but Python's own (SIGINT's `default_int_handler`): a user's handler runs between
    any two bytecodes of this thread."""
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (ValueError, OSError):
            continue
        if handler not in (signal.SIG_DFL, signal.SIG_IGN, None, signal.default_int_handler):
            return False
    return True


def between_steps_read(logits_processor, stopping_criteria, streamer) -> bool:
    """Once per call: only read code runs between two decode steps of this call (see the module docstring)."""
    from transformers.generation import logits_process, stopping_criteria as criteria_module

    if streamer is not None or gc.callbacks or not _default_signal_handlers():
        return False
    processors = _classes(logits_process, _PROCESSORS)
    criteria = _classes(criteria_module, _CRITERIA)
    return (all(_own_call(p, processors) for p in logits_processor)
            and all(_own_call(c, criteria) or _package_criterion(c) for c in stopping_criteria))


_MONITORING = getattr(sys, "monitoring", None)  # Python 3.12+
_TOOLS = range(6)  # sys.monitoring's tool ids


def _freed() -> int:
    """Objects the cyclic garbage collector has freed so far (its finalizers run user code)."""
    return sum(generation["collected"] for generation in gc.get_stats())


class Quiet:
    """Per call: whether the step about to run may skip the checks the previous step's full check vouches for.
    `vouch()` after a full check found the model as recorded; `still()` before the next step."""

    __slots__ = ("read_only", "freed")

    def __init__(self, read_only: bool):
        self.read_only = read_only  # `between_steps_read`, once per call
        self.freed = None  # the collector's count at the last full check; None: no full check vouches

    def vouch(self) -> None:
        self.freed = _freed() if self.read_only else None

    def lapse(self) -> None:
        self.freed = None

    def still(self) -> bool:
        if self.freed is None:
            return False
        if (threading.active_count() != 1 or sys.gettrace() is not None or sys.getprofile() is not None
                or gc.callbacks or _freed() != self.freed):
            return False
        if _MONITORING is not None and any(map(_MONITORING.get_tool, _TOOLS)):
            return False
        return True
