"""The call's logits processors, stopping criteria and streamer, as the deferred loop hands them to stock code.

Each is built once per `generate()` call around the user's objects and does per step only what varies per step:
- `JoiningLogitsProcessors` is where the host reads the previous step's verdict (`AsyncStop.join`). In the extra
  step it returns the scores untouched, so no processor runs in a step the flag-off run never made;
- `SideStreamCriteria` runs the criteria on the side stream; in the extra step it calls none of them;
- `ExtraStepStreamer` (4.57-5.16 only) drops the extra step's token.

The parts of stock code they replicate are listed in `targets.SHORTCUTS` with the upstream sources they were
checked against; where the installed source differs, the stock object is called instead (`verified.py`).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..release_checks.verified import matches

# torch.isin switches to a sort-based algorithm (whose `unique` reads a device count: a blocking sync) once the
# test set has about 10 * numel**0.145 elements; at one row that is 10 EOS ids.
_ISIN_SORTS_FROM = 10


# --- logits processors --------------------------------------------------------------------------------------------
class _EosMask:
    """`MinLengthLogitsProcessor` / `MinNewTokensLengthLogitsProcessor.__call__` without the work stock throws away.

    Copied from transformers v4.57.6-v5.24.0 (same body; 5.x spells `isin_mps_friendly` as `torch.isin`, the same
    function off MPS). Differences: the EOS mask is made only inside the minimum length, where it is used (stock
    makes it every step, and past the minimum drops it); the vocabulary `arange` is made once per call (nobody else
    sees it); with 10 or more EOS ids on the scores' device the mask is a broadcast compare instead of `torch.isin`,
    whose sort-based algorithm reads a device count on the host (the same booleans); inside the minimum the stock
    clone that is immediately replaced is skipped. The minimum, the prompt length and the EOS ids are read from the
    processor at every step, as stock reads them: a criterion or another processor may change them, or edit the EOS
    tensor in place, mid-call. No version counter is read (inference tensors have none). The same values come out.
    """

    __slots__ = ("processor", "vocab")

    def __init__(self, processor):
        self.processor = processor
        self.vocab = None

    @property
    def minimum(self) -> int:
        processor = self.processor
        return processor.min_length if type(processor) is MinLengthLogitsProcessor else processor.min_new_tokens

    @property
    def offset(self) -> int:
        processor = self.processor
        return 0 if type(processor) is MinLengthLogitsProcessor else processor.prompt_length_to_skip

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] - self.offset < self.minimum:
            return torch.where(self._mask(scores), -math.inf, scores)
        return scores.clone()

    def _mask(self, scores):
        vocab = self.vocab
        if vocab is None or vocab.shape[0] != scores.shape[-1] or vocab.device != scores.device:
            vocab = self.vocab = torch.arange(scores.shape[-1], device=scores.device)
        eos = self.processor.eos_token_id
        if (isinstance(eos, torch.Tensor) and eos.numel() >= _ISIN_SORTS_FROM and eos.device == vocab.device
                and eos.dtype == vocab.dtype):
            return (vocab[:, None] == eos.reshape(-1)).any(-1)
        return torch.isin(vocab, eos)


def _plan_processor(processor):
    """(callable, names of the extra keyword arguments it requires) for one processor, decided once per call."""
    if type(processor) in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor) and matches(
            f"{type(processor).__name__}.__call__"):
        return _EosMask(processor), ()
    # what `LogitsProcessorList.__call__` asks of each processor at every step
    names = list(inspect.signature(processor.__call__).parameters.keys())
    return processor, tuple(names[2:]) if len(names) > 2 else None


def plan_processors(logits_processor) -> list | None:
    """The call's processors as the package's loops call them (`_plan_processor`: `(input_ids, scores) -> scores`),
    or None where one needs keyword arguments (stock raises for it: the deferred path runs, and raises the same)."""
    planned = []
    for processor in logits_processor:
        callable_, extra = _plan_processor(processor)
        if extra:
            return None
        planned.append(callable_)
    return planned


class JoiningLogitsProcessors(LogitsProcessorList):
    """The call's logits processors. First, the host reads the previous step's verdict: in the extra step no
    processor runs.

    Copied from transformers v4.57.6-v5.24.0 `LogitsProcessorList.__call__`. Differences: each processor's signature
    is read once per call instead of once per step, and the two minimum-length processors keep their EOS mask
    (`_EosMask`). Where the installed `LogitsProcessorList.__call__` is not one we checked, it is called as is.
    """

    def __init__(self, processors: LogitsProcessorList, ctl):
        super().__init__(processors)
        self._ctl = ctl
        self._plan = [_plan_processor(p) for p in processors] if matches("LogitsProcessorList.__call__") else None

    def __call__(self, input_ids, scores, **kwargs):
        if self._ctl.join():
            return scores  # the extra step: its token is undone, and no user code may see it
        if self._plan is None:
            return super().__call__(input_ids, scores, **kwargs)
        for processor, extra in self._plan:
            if extra is None:
                scores = processor(input_ids, scores)
            else:
                if not all(arg in kwargs for arg in extra):
                    raise ValueError(
                        f"Make sure that all the required parameters: "
                        f"{list(inspect.signature(processor.__call__).parameters.keys())} for "
                        f"{processor.__class__} are passed to the logits processor."
                    )
                scores = processor(input_ids, scores, **kwargs)
        return scores


# --- stopping criteria --------------------------------------------------------------------------------------------
_CALL, _MAX_LENGTH, _MANY_EOS = range(3)


def _plan_criterion(criterion) -> int:
    """How a criterion is evaluated each step. Only the exact built-in types get a shortcut: a subclass may have
    its own `__call__`."""
    kind = type(criterion)
    if kind is MaxLengthCriteria and matches("MaxLengthCriteria.__call__"):
        return _MAX_LENGTH
    if kind is EosTokenCriteria and criterion.eos_token_id.numel() >= _ISIN_SORTS_FROM and matches(
            "EosTokenCriteria.__call__"):
        return _MANY_EOS
    return _CALL


def is_user_criterion(criterion) -> bool:
    """A criterion that is neither transformers' own nor the package's (`assisted.draft.DeviceConfidence`): it may do
    anything stock lets it do, such as editing `input_ids[:, -1]` in place, which stock's next forward then gets (its
    input preparation slices `input_ids` after the criteria ran)."""
    module = type(criterion).__module__
    return module != StoppingCriteriaList.__module__ and not module.startswith(__name__.split(".")[0] + ".")


def _last_tokens_are_eos(criterion, input_ids, kwargs):
    """`EosTokenCriteria.__call__` without `torch.isin`: a broadcast compare, the same booleans.

    Copied from transformers v4.57.6-v5.24.0 (5.11+ also look at the last `new_token_length` tokens; earlier
    releases at the last one, whatever the keyword says)."""
    criterion.eos_token_id = criterion.eos_token_id.to(input_ids.device)
    length = kwargs.get("new_token_length", 1) if _eos_takes_length() else 1
    tail = input_ids[:, -length:]
    return (tail[..., None] == criterion.eos_token_id.reshape(-1)).any(-1).any(-1)


@functools.cache
def _eos_takes_length() -> bool:
    return "new_token_length" in inspect.signature(EosTokenCriteria.__call__).parameters


class _CallCriteria(StoppingCriteriaList):
    """The call's stopping criteria, bound to its controller; `max_length` stays the one the list was built with."""

    def __init__(self, criteria: StoppingCriteriaList, ctl):
        super().__init__(criteria)
        self._ctl = ctl
        self._max_length = criteria.max_length

    @property
    def max_length(self):
        return self._max_length


class SideStreamCriteria(_CallCriteria):
    """The call's stopping criteria, run on the controller's side stream; none runs in the extra step.

    Copied from transformers v4.57.6-v5.24.0 `StoppingCriteriaList.__call__`. Differences:
    - an exact `MaxLengthCriteria` is skipped while it can only say "not yet" and its `max_position_embeddings`
      warning cannot fire: the deferred loop decides `max_length` on the host, exactly, at the same step;
    - the first per-row bool result seeds the reduction instead of a `torch.full` of False;
    - an exact `EosTokenCriteria` with 10 or more ids is a broadcast compare instead of `torch.isin`, whose sorting
      algorithm reads a device count on the host every step.
    Each shortcut is taken only where the installed source is one we checked (`targets.SHORTCUTS`).

    A call with a user criterion (`is_user_criterion`) runs its criteria on the main stream, in stock's order: the
    next step's input preparation, queued there after them, reads `input_ids` as they left it (a criterion may edit
    the last token in place). Only the verdict's read is late.
    """

    def __init__(self, criteria: StoppingCriteriaList, ctl):
        super().__init__(criteria, ctl)
        self._plan = [(c, _plan_criterion(c)) for c in criteria] if matches("StoppingCriteriaList.__call__") else None
        self._side = not any(is_user_criterion(c) for c in criteria)

    def __call__(self, input_ids, scores, **kwargs):
        ctl = self._ctl
        if ctl.extra:
            # the step the flag-off run never made: all rows "done", whatever the criteria would say
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        ctl.last_ids = input_ids  # stock returns this very tensor if the call ends at this step (`own_sequences`)
        if self._side:
            if ctl.steps == 0 and ctl.cuda:  # the first step's criteria: called once, before its verdict is recorded
                ctl.allow_side(_loop_unfinished(sys._getframe(1), input_ids))
            ctl.to_side(input_ids, scores)
        if self._plan is None:
            is_done = super().__call__(input_ids, scores, **kwargs)
        else:
            is_done = fold_criteria(self._plan, input_ids.shape[-1], lambda: input_ids, scores, ctl, kwargs)
            if is_done is None:
                is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if not ctl.synchronous and isinstance(is_done, torch.Tensor) and is_done.shape != (input_ids.shape[0],):
            # a criterion answering (batch, 1): stock's `unfinished & ~is_done` becomes (batch, batch), and with EOS
            # ids its next step multiplies the tokens into that shape and raises at `torch.cat`. Where stock stops
            # at this step, an extra step run ahead would raise first: each verdict is read at once from here on
            ctl.synchronous = True
            ctl.why_synchronous = ("a criterion's verdict changed the shape of unfinished_sequences: each verdict "
                                   "is read at once (an extra step would broadcast its tokens to that shape)")
        return is_done


def _loop_unfinished(frame, input_ids):
    """The `unfinished_sequences` of the stock `_sample` frame that called the criteria (every release from 4.57.6
    to 5.23.0 spells the line `unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)`),
    or None where the caller is something else.

    The first step's `&` reads that tensor on the side stream, and stock drops it as soon as the `&` is queued: made
    on the main stream, its memory is then free for the next allocation on the main stream, by any thread, before
    the side stream has read it. The controller marks it as used by the side stream (`AsyncStop.allow_side`); where it
    cannot be found the criteria stay on the main stream for the call. Read once per call."""
    found = frame.f_locals.get("unfinished_sequences") if frame.f_code.co_name == "_sample" else None
    if (isinstance(found, torch.Tensor) and found.device == input_ids.device and found.dim() == 1
            and found.shape[0] == input_ids.shape[0]):
        return found
    return None


def fold_criteria(plan, length: int, input_ids_of, scores, ctl, kwargs):
    """The loop of `StoppingCriteriaList.__call__` over planned `(criterion, kind)` pairs, with the shortcuts listed
    in `SideStreamCriteria`; the per-row verdict, or None where no criterion had to be called (then stock's
    answer is all False). `input_ids_of()` gives the sequence of `length` tokens, asked for only when a criterion
    runs (the static-cache loop makes it on demand)."""
    is_done = input_ids = None
    for criterion, kind in plan:
        if kind == _MAX_LENGTH and length < criterion.max_length and (
                criterion.max_position_embeddings is None or length <= criterion.max_position_embeddings):
            continue  # it can only say "not yet", and cannot warn: the loop stops at max_length on the host
        if input_ids is None:
            input_ids = input_ids_of()
        if kind == _MANY_EOS:
            done = _last_tokens_are_eos(criterion, input_ids, kwargs)
        else:
            done = criterion(input_ids, scores, **kwargs)
            if kind == _CALL and not isinstance(done, torch.Tensor):
                ctl.warn_host_verdict(criterion)
        if is_done is None:
            if isinstance(done, torch.Tensor) and done.dtype == torch.bool and done.shape == (input_ids.shape[0],):
                is_done = done
                continue
            # anything else combines with stock's all-False seed (Python bools, other dtypes promote)
            is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        is_done = is_done | done
    return is_done


class ExtraStepCriteria(_CallCriteria):
    """Beam search's criteria (run in line, on the main stream): none runs in the extra step."""

    def __call__(self, input_ids, scores, **kwargs):
        if self._ctl.extra:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return super().__call__(input_ids, scores, **kwargs)


# --- the streamer -------------------------------------------------------------------------------------------------
class ExtraStepStreamer:
    """4.57-5.16 only: stock code hands each token to the streamer as soon as it is made, after the step's logits
    processors, by which time the host has read the previous verdict: the extra step's token is dropped, every
    other one is delivered at the same moment as without the flag."""

    def __init__(self, streamer, ctl):
        self._streamer = streamer
        self._ctl = ctl

    def put(self, value):
        if not self._ctl.extra:
            self._streamer.put(value)

    def __getattr__(self, name):
        return getattr(self._streamer, name)
