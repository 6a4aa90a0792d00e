"""Replacements for `GenerationMixin.generate`, `_sample`, `_has_unfinished_sequences` and the modes we leave stock.

Two loop shapes exist across 5.x, and the deferred path fits both without copying the loop:
- 5.17+: `_sample` builds its stop check from the module global `DeferredStopCheck` and already undoes the steps
  `finish()` reports (`_undo_generation_steps`). Our subclass (stop_check.py) is that stop check.
- 5.0-5.16: `_sample` passes the device tensor `unfinished_sequences.max() == 0` to `_has_unfinished_sequences`,
  which reads it. Ours records it and answers from the previous step's verdict; after the loop this wrapper undoes
  the extra step in what `_sample` returns.
In both, the stopping criteria run on a side CUDA stream (`SideStreamCriteria`) and the main stream waits for them
only when the next step's logits processors run (`JoiningLogitsProcessors`), after the next forward is queued.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from .cache_rollback import cache_blocks_deferral, rollback_one_step, why_not_rollbackable
from .config import FIELD, _mark, check_flag, flag_of, runs_stock, warn_stock
from .inputs import IN_GENERATE
from .masking import FED, FedMask
from .patching import MARKER
from .stop_check import ACTIVE, AsyncStop

@dataclass
class _Scope:
    user_cache: bool = False


SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("transformers_async_stop_scope", default=None)


# --- generate() ------------------------------------------------------------------------------------------------
def patched_generate(original, target):
    def generate(self, *args, **kwargs):
        if kwargs.get("custom_generate") is not None:
            config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
            if kwargs.get(FIELD) is True or (FIELD not in kwargs and flag_of(config)):
                warn_stock("a `custom_generate` decoding loop is not ours to defer")
        if FIELD in kwargs:
            check_flag(kwargs[FIELD])
        scope = _Scope(user_cache=kwargs.get("past_key_values") is not None)
        in_generate = IN_GENERATE.set("cache_position" not in kwargs)
        scope_token = SCOPE.set(scope)
        fed_token = FED.set(FedMask())
        try:
            return original(self, *args, **kwargs)
        finally:
            FED.reset(fed_token)
            SCOPE.reset(scope_token)
            IN_GENERATE.reset(in_generate)

    return _mark(generate, original)


def stock_with_warning(original, target):
    mode = target.extra["mode"]

    def decoding_method(self, *args, **kwargs):
        config = kwargs.get("generation_config")
        if config is not None and flag_of(config) and not getattr(config, "is_assistant", False):
            warn_stock(f"{mode} is not made async yet")
        return original(self, *args, **kwargs)

    return _mark(decoding_method, original)


def patched_padding_warning(original, target):
    def warn_if_padding_and_no_attention_mask(self, input_ids, attention_mask, *args, **kwargs):
        ctl = ACTIVE.get()
        if ctl is not None and ctl.steps > 0:
            # a decode step feeds tokens `generate()` made itself, after it dropped an all-ones mask: the prompt
            # was checked at prefill, and this check would cost a blocking read per step
            return None
        return original(self, input_ids, attention_mask, *args, **kwargs)

    return _mark(warn_if_padding_and_no_attention_mask, original)


# --- the side stream -------------------------------------------------------------------------------------------
# torch.isin switches to a sort-based algorithm (whose `unique` reads a device count: a blocking sync) once the
# test set has about 10 * numel**0.145 elements; at B <= 1 that is 10 EOS ids.
_ISIN_SORTS_FROM = 10


def _last_token_is_eos(criteria, input_ids):
    """`EosTokenCriteria.__call__` (v5.0-v5.23) without `torch.isin`: a broadcast compare, same booleans."""
    eos = criteria.eos_token_id.to(input_ids.device)
    return (input_ids[:, -1, None] == eos.reshape(1, -1)).any(-1)


class SideStreamCriteria(StoppingCriteriaList):
    """The call's stopping criteria, run on the controller's side stream.

    Differences from `StoppingCriteriaList.__call__` (v5.0-v5.23, identical there): `MaxLengthCriteria` is skipped
    while it can only say "not yet" or fire its `max_position_embeddings` warning is impossible, because the
    deferred loop decides `max_length` on the host, exactly, at the same step; the first result seeds the
    reduction instead of a `torch.full` of False (both save kernel launches and host time every step); and an
    `EosTokenCriteria` with 10 or more ids is answered by a broadcast compare instead of `torch.isin`, whose
    sorting algorithm reads a device count on the host every step.
    """

    def __init__(self, criteria: StoppingCriteriaList, ctl: AsyncStop):
        super().__init__(criteria)
        self._ctl = ctl
        self._max_length = criteria.max_length

    @property
    def max_length(self):
        return self._max_length

    def __call__(self, input_ids, scores, **kwargs):
        last_scores = scores[-1] if isinstance(scores, tuple) and scores else scores
        read = [t for t in (input_ids, last_scores) if isinstance(t, torch.Tensor)]
        self._ctl.to_side(*read)
        length = input_ids.shape[-1]
        is_done = None
        for criteria in self:
            if isinstance(criteria, MaxLengthCriteria) and length < criteria.max_length and (
                getattr(criteria, "max_position_embeddings", None) is None
                or length < criteria.max_position_embeddings
            ):
                continue
            if isinstance(criteria, EosTokenCriteria) and criteria.eos_token_id.numel() >= _ISIN_SORTS_FROM:
                done = _last_token_is_eos(criteria, input_ids)
            else:
                done = criteria(input_ids, scores, **kwargs)
            if not isinstance(done, torch.Tensor):
                self._ctl.warn_host_verdict(criteria)
            if is_done is None and not (isinstance(done, torch.Tensor) and done.dtype == torch.bool
                                        and done.shape == (input_ids.shape[0],)):
                # anything but a per-row bool tensor combines with stock's all-False seed (bools, other dtypes)
                is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            is_done = done if is_done is None else is_done | done
        if is_done is None:
            is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return is_done


class JoiningLogitsProcessors(LogitsProcessorList):
    """The call's logits processors; first, the main stream waits for the previous step's criteria."""

    def __init__(self, processors: LogitsProcessorList, ctl: AsyncStop):
        super().__init__(processors)
        self._ctl = ctl

    def __call__(self, input_ids, scores, **kwargs):
        self._ctl.join()
        return super().__call__(input_ids, scores, **kwargs)


class LaggedStreamer:
    """5.0-5.16 only: stock code hands each token to the streamer as it is made; hold it back one step so that the
    undone extra token is never delivered."""

    def __init__(self, streamer, ctl: AsyncStop):
        self._streamer = streamer
        self._ctl = ctl
        self._held = None

    def put(self, value):
        if self._held is not None:
            self._streamer.put(self._held)
        self._held = value

    def end(self):
        # stock calls end() inside `_sample`, before our `finish()`: the verdict that ended the loop decides
        if self._held is not None and not self._ctl.stop_reported:
            self._streamer.put(self._held)
        self._held = None
        self._streamer.end()

    def __getattr__(self, name):
        return getattr(self._streamer, name)


# --- _sample ---------------------------------------------------------------------------------------------------
def _route_a() -> bool:
    """5.17+: the module builds its stop check from our `DeferredStopCheck` subclass."""
    import transformers.generation.utils as gen_utils

    return getattr(getattr(gen_utils, "DeferredStopCheck", None), MARKER, False) is True


def _cache_is_returned(generation_config, model_kwargs) -> bool:
    """The cache outlives `generate()`: returned in the output, or an object the caller passed in."""
    cache = model_kwargs.get("past_key_values")
    scope = SCOPE.get()
    return bool(generation_config.return_dict_in_generate or getattr(cache, "_is_user_defined", False)
                or (scope is not None and scope.user_cache))


def _why_stock(model, generation_config, synced_gpus, model_kwargs) -> str | None:
    if synced_gpus:
        if not _route_a():
            # 5.0-5.16 test the loop's device-tensor verdict on the host for `continue`: a sync we cannot remove
            return "`synced_gpus=True` is made async on transformers 5.17+ only"
        if _cache_is_returned(generation_config, model_kwargs):
            # peers that finish early keep stepping on a token the extra step appended: their padding positions
            # in the cache would differ from stock's
            return "`synced_gpus=True` with a returned cache is not made async"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and _cache_is_returned(generation_config, model_kwargs):
        return cache_blocks_deferral(cache, _route_a())
    return None


def patched_sample(original, target):
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        def stock():
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

        if runs_stock(generation_config, input_ids.device,
                      lambda: _why_stock(self, generation_config, synced_gpus, model_kwargs)):
            return stock()

        route_a = _route_a()
        ctl = AsyncStop(
            input_ids,
            stopping_criteria.max_length,
            do_sample=bool(generation_config.do_sample),
            streamer=streamer if route_a else None,
        )
        ctl.route_a = route_a
        ctl.cache_returned = _cache_is_returned(generation_config, model_kwargs)
        if synced_gpus:
            ctl.enable_peer_reduction()
        loop_streamer = streamer if (route_a or streamer is None) else LaggedStreamer(streamer, ctl)
        token = ACTIVE.set(ctl)
        try:
            outputs = original(
                self,
                input_ids,
                JoiningLogitsProcessors(logits_processor, ctl),
                SideStreamCriteria(stopping_criteria, ctl),
                generation_config,
                synced_gpus=synced_gpus,
                streamer=loop_streamer,
                **model_kwargs,
            )
        finally:
            ACTIVE.reset(token)
            ctl.close()
        if not route_a:
            outputs = _undo_route_b(ctl, outputs, model_kwargs)
        return outputs

    return _mark(_sample, original)


def patched_has_unfinished_sequences(original, target):
    def _has_unfinished_sequences(self, this_peer_finished, synced_gpus, device=None, *args, **kwargs):
        ctl = ACTIVE.get()
        if ctl is not None and synced_gpus and ctl.peers is not None:
            # 5.17+: every peer reduces its device verdict and reads the previous step's sum, so all peers stop
            # at the same call, one step late (undone like any lagged stop)
            return not ctl.peers_done(this_peer_finished)
        if ctl is None or synced_gpus or ctl.route_a:
            return original(self, this_peer_finished, synced_gpus, device, *args, **kwargs)
        if isinstance(this_peer_finished, torch.Tensor):
            # 5.0-5.16 call this once per step with the step's verdict as a device tensor
            ctl.adopt(this_peer_finished)
            return not ctl.step(this_peer_finished, None, ctl.last_length + 1)
        if this_peer_finished:
            return False
        return True  # the call before the first step

    return _mark(_has_unfinished_sequences, original)


def _undo_route_b(ctl: AsyncStop, outputs, model_kwargs):
    """Undo the extra step in what a 5.0-5.16 `_sample` returned (5.17+ does this itself)."""
    steps = ctl.finish()
    if not steps:
        return outputs
    cache = getattr(outputs, "past_key_values", None)
    if cache is None:
        cache = model_kwargs.get("past_key_values")
    if cache is not None and why_not_rollbackable(cache) is None:
        rollback_one_step(cache, ctl.kept_cache_length)
    if isinstance(outputs, torch.Tensor):
        return outputs[..., :-steps]
    outputs.sequences = outputs.sequences[..., :-steps]
    trim_recorded(outputs, steps)
    return outputs


def trim_recorded(outputs, steps: int) -> None:
    """Drop what the undone steps appended to a generate output's per-step records."""
    for name in ("scores", "logits", "attentions", "hidden_states", "decoder_attentions", "cross_attentions",
                 "decoder_hidden_states"):
        recorded = getattr(outputs, name, None)
        if isinstance(recorded, tuple) and recorded:
            setattr(outputs, name, recorded[:-steps])
