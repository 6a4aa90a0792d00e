"""Which `_sample` calls the static-cache loop takes, and what it runs in them: decided once per call.

The loop is taken where its inputs, its tail and its stop can reproduce stock exactly, and nowhere else:
a decoder-only model that keeps transformers' own `prepare_inputs_for_generation` and
`_update_model_kwargs_for_generation`, a cache made only of full-attention `StaticLayer`s, one new token per step, no
per-step attentions or hidden states, one device and one process (no `device_map` split, no `synced_gpus` or tensor
parallelism), and an installed transformers whose sources are the ones
this loop was read against (`targets.SHORTCUTS`: "static decode loop"). Every other call runs the deferred path of
`generation.py`.

The tail is captured into CUDA graphs only when every logits processor is capturable: a built-in one known to be
(temperature, top-k, top-p, min-p, the two minimum-length ones, encoder repetition penalty), a built-in that reads the
sequence in its device form (`processors/`: repetition penalty, no-repeat n-gram, sequence bias and bad words), one the user declared
with `graph_safe()`, or one `purity.guard_for` gives a guard for (the hook below). Every captured processor but a
declared one has a guard, checked before each capture and replay: a built-in's is a snapshot of its attributes
(`processors.AttrGuard`), taken at the first capture.
Stopping criteria are never captured: an exact `EosTokenCriteria` that no user criterion precedes is evaluated inside
the tail on the new token (reading its ids tensor live, as stock reads it at every call), an
exact `MaxLengthCriteria` is decided on the host (as on the deferred path), and every other criterion runs eagerly,
after the tail, on the real sequence.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from ...control.step_lists import _EosMask, _plan_criterion, is_user_criterion, plan_processors
from ...release_checks.verified import matches
from ...release_checks import cache_kwarg
from ...graphs.backend import emulates
from . import processors as forms

STATIC_LOOP_ENV = "TRANSFORMERS_ASYNC_STOP_STATIC_LOOP"
CAPTURE_ENV = "TRANSFORMERS_ASYNC_STOP_CAPTURE"
_GRAPH_SAFE = "_async_stop_graph_safe"


def graph_safe(processor):
    """Declare a logits processor (an instance or its class) safe to capture into a CUDA graph; returns it.

    The promise: its `__call__` is a pure function of `scores` (it may read `input_ids.shape[0]` and `.device`, never
    the values or the length of `input_ids`); it keeps no Python state between calls, reads nothing on the host and
    builds no tensor from host data. A captured processor runs once at capture and is replayed after that, so a
    processor that breaks the promise gives wrong results, not an error.
    """
    setattr(processor, _GRAPH_SAFE, True)
    return processor


def _off(env: str) -> bool:
    return os.environ.get(env, "").strip().lower() in ("0", "false", "no", "off")


def _builtin_graph_safe() -> tuple:
    from transformers.generation import logits_process as lp

    kinds = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper)
    if matches("static loop encoder repetition penalty"):
        kinds += (lp.EncoderRepetitionPenaltyLogitsProcessor,)  # reads only its own ids and penalty
    return kinds


def _is_graph_safe(processor) -> bool:
    return _guard_maker(processor) is not None


def _guard_maker(processor):
    """How a capturable processor's guard is made (a callable returning an object with `unchanged() -> bool`, or
    returning None where it cannot be guarded after all), `_DECLARED` for a `graph_safe()` one (its promise needs no
    guard), or None: not capturable. Decided once per call."""
    if isinstance(processor, (_EosMask, forms._Form)) or type(processor) in _builtin_graph_safe():
        return forms.guard_for_builtin(processor)
    if getattr(processor, _GRAPH_SAFE, False) is True:
        return _DECLARED
    guard = _purity_guard(processor)
    return None if guard is None else _PurityMaker(guard)


_DECLARED = object()  # a `graph_safe()` processor: captured, unguarded


class _PurityMaker:
    """The guard maker of a processor `purity` judges: the guard itself, once its observed call proved the processor
    pure (`capturable`; a guard without that attribute is taken at its word), else None (no capture)."""

    __slots__ = ("purity",)

    def __init__(self, guard):
        self.purity = guard

    def __call__(self):
        return self.purity if getattr(self.purity, "capturable", True) is True else None


def _purity_guard(processor):
    """The hook of `purity/` (the capture of undeclared user processors).

    `purity.guard_for(processor)` returns a guard, or None where the processor is not capturable. It is called once
    per call, here, at planning. If the guard has `observe(input_ids, scores)`, the tail calls that instead of the
    processor at the call's first step (`Tail._observe`; until then the processor gets stock's fresh tensors), and
    captures only if `guard.capturable` is then True. Its `unchanged() -> bool` is checked before every capture and
    replay; one False sends the rest of the call eager. Imported lazily and defensively: where the module is absent or
    fails, no user processor is captured without a declaration."""
    try:
        purity = importlib.import_module(f"{__package__}.purity")
    except Exception:  # noqa: BLE001 - absent or broken: capture nothing undeclared
        return None
    guard_for = getattr(purity, "guard_for", None)
    if guard_for is None:
        return None
    try:
        guard = guard_for(processor)
    except Exception:  # noqa: BLE001 - an analysis that fails proves nothing
        return None
    return guard if guard is not None and callable(getattr(guard, "unchanged", None)) else None


@dataclasses.dataclass
class LoopPlan:
    """What one `_sample` call of the static-cache loop runs."""

    processors: list  # callables (input_ids, scores) -> scores, in order
    phased: list  # the `_EosMask`s among them: their one host decision depends on the length
    forms: list  # the device forms among them (`processors/forms.py`): bound to the tail's sequence buffer
    pure: bool  # every processor is capturable: one logits buffer and a view of the sequence serve every step
    guards: list  # per capturable processor but a declared one: a maker of its guard (`_guard_maker`)
    observed: list  # (index, guard) of the processors `purity` judges on their first call (`Tail._observe`)
    capture: bool  # replay the tail from CUDA graphs
    eos: list  # exact `EosTokenCriteria`: evaluated inside the tail on the new token
    criteria: list  # every other criterion, planned `(criterion, kind)`: folded after the tail (`fold_criteria`)
    do_sample: bool
    has_eos: bool  # stock's `has_eos_stopping_criteria`: finished rows get the pad token
    scores: bool  # return the processed scores of each step
    logits: bool  # return the raw logits of each step

    def phase(self, length: int) -> tuple:
        """The host decisions of the processors at this sequence length (one CUDA graph per distinct value)."""
        decisions = tuple(length - m.offset < m.minimum for m in self.phased)
        for form in self.forms:
            decisions += form.phase(length)
        return decisions


def plan_loop(model, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs):
    """The call's `LoopPlan`, or None where the deferred path of `generation.py` runs instead."""
    from transformers.cache_utils import Cache, StaticLayer
    from transformers.generation.utils import GenerationMixin

    if _off(STATIC_LOOP_ENV) or synced_gpus or getattr(generation_config, "is_assistant", False):
        return None
    if model.config.is_encoder_decoder or not model_kwargs.get("use_cache", True):
        return None
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1 or torch.distributed.is_initialized():
        return None  # a model split over devices or processes: the captured tail would span them
    if model_kwargs.get("inputs_embeds") is not None or stopping_criteria.max_length is None:
        return None
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        return None
    kind = type(model)
    if (kind.prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation
            or kind._update_model_kwargs_for_generation is not GenerationMixin._update_model_kwargs_for_generation):
        return None
    cache = cache_kwarg.get(model_kwargs)
    layers = getattr(cache, "layers", None) if isinstance(cache, Cache) else None
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return None
    if not (matches("static decode loop") and matches("LogitsProcessorList.__call__")
            and matches("StoppingCriteriaList.__call__")):
        return None

    planned = plan_processors(logits_processor)
    if planned is None:
        return None
    processors = [forms.device_form(p) or p for p in planned]
    makers = [_guard_maker(p) for p in processors]
    pure = all(make is not None for make in makers)
    observed = [(index, make.purity) for index, make in enumerate(makers)
                if callable(getattr(getattr(make, "purity", None), "observe", None))]
    eos, criteria = [], []
    for criterion in stopping_criteria:
        # the tail checks EOS before the other criteria run: only where none before it is user code, which may
        # change its ids, and stock's EOS criterion would see them at the same step
        if _exact_eos(criterion) and not any(is_user_criterion(c) for c, _ in criteria):
            eos.append(criterion)
        else:
            criteria.append((criterion, _plan_criterion(criterion)))
    capture = _capturable_device(model) and not _off(CAPTURE_ENV) and pure
    rdig = generation_config.return_dict_in_generate
    return LoopPlan(
        processors=processors, phased=[p for p in processors if isinstance(p, _EosMask)],
        forms=[p for p in processors if isinstance(p, forms._Form)], pure=pure,
        guards=[make for make in makers if make is not None and make is not _DECLARED], observed=observed,
        capture=capture, eos=eos,
        criteria=criteria, do_sample=bool(generation_config.do_sample),
        has_eos=any(hasattr(c, "eos_token_id") for c in stopping_criteria),
        scores=bool(rdig and generation_config.output_scores), logits=bool(rdig and generation_config.output_logits),
    )


def _exact_eos(criterion) -> bool:
    from transformers.generation.stopping_criteria import EosTokenCriteria

    return type(criterion) is EosTokenCriteria and matches("EosTokenCriteria.__call__")


def _capturable_device(model) -> bool:
    """CUDA; or the CPU inside a test's `testing.emulation.emulated()` (the tails' captures emulated)."""
    try:
        device = model.device
    except (AttributeError, StopIteration):
        return False
    return (device.type == "cuda" and torch.cuda.is_available()) or emulates(device)
