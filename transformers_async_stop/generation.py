"""Replacements for `GenerationMixin.generate`, `_sample`, `_has_unfinished_sequences` and the modes left stock.

Two loop shapes exist across 4.57-5.23, and the deferred path fits both without copying the loop:
- 5.17+: `_sample` builds its stop check from the module global `DeferredStopCheck` and already undoes the steps
  `finish()` reports (`_undo_generation_steps`). Our subclass (stop_check.py) is that stop check.
- 4.57-5.16: `_sample` passes the device tensor `unfinished_sequences.max() == 0` to `_has_unfinished_sequences`,
  which reads it. Ours records it and answers from what the host already knows; after the loop this wrapper undoes
  the extra step in what `_sample` returns.
In both, the stopping criteria run on a side CUDA stream (`SideStreamCriteria`), and the host reads a step's
verdict at the next step's logits processors (`JoiningLogitsProcessors`), after the next forward has been queued.
"""

from __future__ import annotations

import torch

from .release_checks import cache_kwarg
from .undo.cache_rollback import cache_blocks_deferral, loop_cache, rollback_one_step, why_not_rollbackable
from .state.call_state import CALL, CallState, active_controller, active_draft, compiling
from .undo.module_state import why_stateful
from .config import FIELD, _mark, check_flag, flag_of
from .control.stock_path import runs_stock, warn_stock
from .state import concurrency
from .loops import dynamic_loop, static_loop
from .sync_free import padding_check
from . import path_report
from .control.controller import AsyncStop
from .patching import MARKER
from .control.peers import PeerVerdict
from .control.step_lists import ExtraStepStreamer, JoiningLogitsProcessors, SideStreamCriteria


# --- generate() ------------------------------------------------------------------------------------------------
def patched_generate(original, target):
    def generate(self, *args, **kwargs):
        if kwargs.get("custom_generate") is not None:
            config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
            if kwargs.get(FIELD) is True or (FIELD not in kwargs and flag_of(config)):
                warn_stock("a `custom_generate` decoding loop is not ours to defer")
        if FIELD in kwargs:
            check_flag(kwargs[FIELD])
        report = path_report.begin(self, kwargs)  # last_path() and the logger's line
        # a fresh state for this call, also when it runs inside another generate()'s processor or criterion
        token = CALL.set(CallState(user_cache=cache_kwarg.user_cache(kwargs) is not None,
                                   slice_inputs="cache_position" not in kwargs))
        try:
            with concurrency.inside_generate():
                return original(self, *args, **kwargs)
        finally:
            CALL.reset(token)
            path_report.end(report)

    return _mark(generate, original)


def patched_padding_warning(original, target):
    def warn_if_padding_and_no_attention_mask(self, input_ids, attention_mask, *args, **kwargs):
        if not compiling():
            ctl = active_controller()
            if ctl is not None and ctl.steps > 0:
                # a decode step: checked on a host copy when the previous verdict is read (padding_check.py), not
                # with a blocking read per step
                return padding_check.check(original, self, ctl, input_ids, attention_mask, args, kwargs)
        return original(self, input_ids, attention_mask, *args, **kwargs)

    return _mark(warn_if_padding_and_no_attention_mask, original)


# --- _sample ---------------------------------------------------------------------------------------------------
def _loop_undoes_steps() -> bool:
    """The 5.17+ loop shape: `_sample` builds its stop check from our `DeferredStopCheck` subclass and itself undoes
    the steps that stop check reports (4.57-5.16: `_undo_steps_after_loop` does, after `_sample` returns)."""
    import transformers.generation.utils as gen_utils

    return getattr(getattr(gen_utils, "DeferredStopCheck", None), MARKER, False) is True


def cache_is_returned(generation_config, model_kwargs) -> bool:
    """The cache outlives `generate()`: returned in the output, or an object the caller passed in."""
    if generation_config.return_dict_in_generate:
        return True
    cache = loop_cache(model_kwargs)
    state = CALL.get()
    return bool(getattr(cache, "_is_user_defined", False) or (state is not None and state.user_cache))


def cache_out_of_sight(model, generation_config, model_kwargs) -> str | None:
    """A returned cache the loop creates in the model's own `_update_model_kwargs_for_generation` (Mamba's
    `cache_params` on 4.57-5.16): the deferred loop never sees it, so it cannot check that a step can be undone."""
    from transformers.generation.utils import GenerationMixin

    own = type(model)._update_model_kwargs_for_generation
    if own is GenerationMixin._update_model_kwargs_for_generation or loop_cache(model_kwargs) is not None:
        return None
    if not cache_is_returned(generation_config, model_kwargs):
        return None
    return (f"{type(model).__name__} keeps its cache through its own `_update_model_kwargs_for_generation`, where "
            "the deferred loop cannot check that a returned cache can give a step back")


def _why_stock(model, generation_config, synced_gpus, model_kwargs) -> str | None:
    reason = why_stateful(model)
    if reason is not None:
        return reason
    loop_undoes_steps = _loop_undoes_steps()
    if not loop_undoes_steps:
        reason = cache_out_of_sight(model, generation_config, model_kwargs)
        if reason is not None:
            return reason
    if synced_gpus:
        if not loop_undoes_steps:
            # 4.57-5.16 test the loop's device-tensor verdict on the host for `continue`: a sync we cannot remove
            return "`synced_gpus=True` is made async on transformers 5.17+ only"
        if cache_is_returned(generation_config, model_kwargs):
            # peers that finish early keep stepping on a token the extra step appended: their padding positions
            # in the cache would differ from stock's
            return "`synced_gpus=True` with a returned cache is not made async"
    cache = loop_cache(model_kwargs)
    if cache is not None and cache_is_returned(generation_config, model_kwargs):
        return cache_blocks_deferral(cache, loop_undoes_steps)
    return None


def patched_sample(original, target):
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        state = CALL.get()
        # an assistant's draft inside a deferred assisted call (assisted/draft.py): its own controller and criteria
        draft = active_draft()

        def why_stock():
            reason = _why_stock(self, generation_config, synced_gpus, model_kwargs)
            return reason if draft is None else draft.why_stock(reason)

        if state is None or state.ctl is not None or runs_stock(generation_config, input_ids.device, why_stock):
            # no generate() of ours around this call (a direct `_sample` call), or one loop already runs in it
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

        loop_undoes_steps = _loop_undoes_steps()
        ctl = state.ctl = (AsyncStop if draft is None else draft.controller)(
            input_ids, stopping_criteria.max_length, done_when="unfinished" if loop_undoes_steps else "finished",
            streamer=streamer if loop_undoes_steps else None,
            cache_returned=cache_is_returned(generation_config, model_kwargs), loop_undoes_steps=loop_undoes_steps,
        )
        ctl.watch_hooks(self)
        ctl.watch_input_drops(self)
        if draft is None:
            ctl.follow_max_length(stopping_criteria)
        if synced_gpus:
            ctl.peers = PeerVerdict(input_ids.device)
        if draft is not None:
            stopping_criteria = draft.criteria(stopping_criteria)
        loop_streamer = streamer if (loop_undoes_steps or streamer is None) else ExtraStepStreamer(streamer, ctl)
        # a static cache on 5.17+: the package's own loop, inputs advanced in place and the step's tail replayed
        loop_plan = None if draft is not None or not loop_undoes_steps else static_loop.plan_loop(
            self, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs)
        # a dynamic cache on 5.17+: the package's lean loop, each step's inputs made from the previous step's
        lean_plan = None if loop_plan is not None or not loop_undoes_steps else dynamic_loop.plan_loop(
            self, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs)
        # last before the `try`: on a model not yet known this watches the first forward, and `close` must end it
        ctl.watch_positions(self, input_ids, model_kwargs)
        try:
            if loop_plan is not None:
                outputs = static_loop.run(self, input_ids, stopping_criteria, generation_config, streamer,
                                          model_kwargs, ctl, loop_plan)
            elif lean_plan is not None:
                outputs = dynamic_loop.run(self, input_ids, generation_config, streamer, model_kwargs, ctl, lean_plan)
            else:
                outputs = original(self, input_ids, JoiningLogitsProcessors(logits_processor, ctl),
                                   SideStreamCriteria(stopping_criteria, ctl), generation_config,
                                   synced_gpus=synced_gpus, streamer=loop_streamer, **model_kwargs)
                outputs = own_sequences(ctl, outputs) if loop_undoes_steps else outputs
        except BaseException:
            ctl.abort()
            raise
        finally:
            state.ctl = None
            ctl.close()
        path_report.deferred_loop(ctl)
        if not loop_undoes_steps:
            outputs = _undo_steps_after_loop(ctl, outputs, model_kwargs)
        return outputs

    return _mark(_sample, original)


def patched_has_unfinished_sequences(original, target):
    def _has_unfinished_sequences(self, this_peer_finished, synced_gpus, device=None, *args, **kwargs):
        ctl = active_controller()
        if ctl is None or ctl.loop_undoes_steps and not synced_gpus:
            return original(self, this_peer_finished, synced_gpus, device, *args, **kwargs)
        if synced_gpus:
            if ctl.peers is None:
                return original(self, this_peer_finished, synced_gpus, device, *args, **kwargs)
            # 5.17+: every peer reduces its device verdict and reads the previous step's sum, so all peers stop
            # at the same call, one step late (undone like any lagged stop)
            return not ctl.peers.done(ctl, this_peer_finished)
        if isinstance(this_peer_finished, torch.Tensor):
            # 4.57-5.16 call this once per step with the step's verdict as a device tensor
            return not ctl.record(this_peer_finished, None, ctl.last_length + 1)
        return not this_peer_finished  # the call before the first step

    return _mark(_has_unfinished_sequences, original)


def _undo_steps_after_loop(ctl: AsyncStop, outputs, model_kwargs):
    """Undo the extra step in what a 4.57-5.16 `_sample` returned (5.17+ does this itself)."""
    steps = ctl.finish()
    if not steps:
        return outputs
    rollback_loop_cache(ctl, outputs, model_kwargs)
    if isinstance(outputs, torch.Tensor):
        return own_sequences(ctl, outputs[..., :-steps])
    outputs.sequences = outputs.sequences[..., :-steps]
    trim_recorded(outputs, steps)
    return own_sequences(ctl, outputs)


def own_sequences(ctl: AsyncStop, outputs):
    """After transformers' own loop undid the extra step: its `sequences` is a view of the extra step's ids without
    their last column, where stock returns the last step's `input_ids` itself (contiguous, and the very tensor the
    criteria were handed then). That tensor is `ctl.last_ids`: the extra step's `torch.cat` read it, never wrote it."""
    ids = getattr(ctl, "last_ids", None)  # set by SideStreamCriteria at each step that ran the criteria
    if not ctl.extra or ids is None or ctl.peers is not None:
        return outputs
    sequences = outputs if isinstance(outputs, torch.Tensor) else outputs.sequences
    if sequences.shape != ids.shape:
        return outputs  # not the undone step's view (a case this does not know): leave transformers' result
    if isinstance(outputs, torch.Tensor):
        return ids
    outputs.sequences = ids
    return outputs


def rollback_loop_cache(ctl: AsyncStop, outputs, model_kwargs) -> None:
    """Give the loop's cache (returned, or in `model_kwargs`) back the undone extra step, where it can."""
    cache = None if isinstance(outputs, torch.Tensor) else cache_kwarg.of_output(outputs)
    cache = loop_cache(model_kwargs) if cache is None else cache
    if cache is not None and why_not_rollbackable(cache) is None:
        rollback_one_step(cache, ctl.extra_position())


def trim_recorded(outputs, steps: int) -> None:
    """Drop what the undone steps appended to a generate output's per-step records."""
    for name in ("scores", "logits", "attentions", "hidden_states", "decoder_attentions", "cross_attentions",
                 "decoder_hidden_states"):
        recorded = getattr(outputs, name, None)
        if isinstance(recorded, tuple) and recorded:
            setattr(outputs, name, recorded[:-steps])
