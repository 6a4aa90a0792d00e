"""Beam search with the "are all beams done?" verdict read one step late.

Stock `_beam_search` (v4.57-v5.23, same loop) ends each step with
`this_peer_finished = not self._beam_search_has_unfinished_sequences(...)`: `not` on a device tensor, a blocking
read. Like `_sample`, the loop is kept as it is; the wrapper hands it wrapped logits processors and criteria, and
three helpers are wrapped:

- `_beam_search_has_unfinished_sequences` records step t's device verdict and lets the loop go on; `max_length` is
  decided on the host at the same step as stock (the running buffers are `max_length` wide).
- The logits processors of step t+1 (`JoiningLogitsProcessors`) read step t's verdict on the host. If the flag-off
  run stopped at t, step t+1 is the extra step: no processor or criterion runs in it,
  `_update_finished_beams` returns the finished beams it was given (so the loop returns the flag-off run's
  `sequences`, `beam_scores` and `beam_indices`), and a cache is not reordered (its extra position is cropped).
- `CacheLayerMixin.reorder_cache` reorders an initialised static layer without reading its device counter.

`patched_beam_search` then trims the extra step's scores, logits, attentions and hidden states, crops the returned
cache and gives back the extra step's random draws.
"""

from __future__ import annotations

import torch

from ..undo.cache_rollback import loop_cache, why_not_rollbackable
from ..state.call_state import CALL, active_controller, compiling
from .. import path_report
from ..config import _mark
from ..control.stock_path import runs_stock
from ..control.controller import AsyncStop
from ..undo.module_state import why_stateful
from ..generation import cache_is_returned, cache_out_of_sight, rollback_loop_cache, trim_recorded
from ..control.step_lists import ExtraStepCriteria, JoiningLogitsProcessors


def _why_stock(model, generation_config, synced_gpus, model_kwargs) -> str | None:
    if synced_gpus:
        return "beam search with `synced_gpus=True` is not made async"
    reason = why_stateful(model)
    if reason is not None:
        return reason
    reason = cache_out_of_sight(model, generation_config, model_kwargs)
    if reason is not None:
        return reason
    cache = loop_cache(model_kwargs)
    if cache is not None and cache_is_returned(generation_config, model_kwargs):
        reason = why_not_rollbackable(cache)
        if reason is not None:
            return f"beam search cannot roll back the returned cache by one step ({reason})"
        if hasattr(model, "_reorder_cache"):
            # the model's own reorder would reorder the returned cache in the extra step too
            return f"beam search with {type(model).__name__}'s own `_reorder_cache` and a returned cache"
    return None


def patched_beam_search(original, target):
    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        state = CALL.get()
        if state is None or state.ctl is not None or runs_stock(
                generation_config, input_ids.device,
                lambda: _why_stock(self, generation_config, synced_gpus, model_kwargs),
                "beam sample" if generation_config.do_sample else "beam search"):
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, **model_kwargs)

        returned = cache_is_returned(generation_config, model_kwargs)
        # 4.57-5.16 create the cache in the first forward: `see_cache` checks it then, and a returned cache that
        # cannot give a step back turns the controller synchronous (stock's reads, one warning)
        ctl = state.ctl = AsyncStop(input_ids, generation_config.max_length, done_when="running",
                                    cache_returned=returned)
        ctl.watch_hooks(self)
        ctl.watch_input_drops(self)  # Phi-3's rope switch: no extra step may refill a dropped cache
        ctl.watch_positions(self, input_ids, model_kwargs)  # last before the `try`, whose `close` ends its watch
        try:
            outputs = original(self, input_ids, JoiningLogitsProcessors(logits_processor, ctl),
                               ExtraStepCriteria(stopping_criteria, ctl), generation_config,
                               synced_gpus=synced_gpus, **model_kwargs)
        except BaseException:
            ctl.abort()
            raise
        finally:
            state.ctl = None
            ctl.close()
        path_report.deferred_loop(ctl)
        steps = ctl.finish()
        if steps and not isinstance(outputs, torch.Tensor):
            trim_recorded(outputs, steps)  # the finished beams themselves were kept
        if steps and returned:
            rollback_loop_cache(ctl, outputs, model_kwargs)
        return outputs

    return _mark(_beam_search, original)


def patched_beam_verdict(original, target):
    def _beam_search_has_unfinished_sequences(*args, **kwargs):
        unfinished = original(*args, **kwargs)
        ctl = active_controller()
        if ctl is None or not isinstance(unfinished, torch.Tensor):
            return unfinished
        # "some beam can still improve", one step late: the loop's `not` reads a host bool
        return not ctl.record(unfinished, None, ctl.last_length + 1)

    return staticmethod(_mark(_beam_search_has_unfinished_sequences, original))


def patched_update_finished_beams(original, target):
    def _update_finished_beams(self, sequences, topk_running_sequences, beam_scores, topk_log_probs, beam_indices,
                               *args, **kwargs):
        ctl = active_controller()
        if ctl is not None and ctl.extra:
            # the extra step: keep the beams the flag-off run finished with (`is_sent_finished` only steers steps
            # that will not run)
            is_sent_finished = kwargs.get("is_sent_finished", args[2] if len(args) > 2 else None)
            return sequences, beam_scores, beam_indices, is_sent_finished
        return original(self, sequences, topk_running_sequences, beam_scores, topk_log_probs, beam_indices,
                        *args, **kwargs)

    return _mark(_update_finished_beams, original)


def patched_reorder_cache(original, target):
    """Copied from transformers v5.0.0 / v5.23.0 `CacheLayerMixin.reorder_cache` (identical). Differences:

    - stock asks `if self.get_seq_length() > 0`, and a static layer's length is a device tensor (`cumulative_length`
      in 5.17+, a count of non-zero positions in 5.0), so every beam-search step read it once per layer. An
      initialised static layer is reordered without asking: when it holds nothing, its buffers are zeros and
      reordering zeros gives the same zeros. Layers whose length is a host int keep the stock check. Always on.
    - in the extra step of a deferred beam search nothing is reordered: the step's position is cropped afterwards.
    """

    def reorder_cache(self, beam_idx, *args, **kwargs):
        if not compiling():
            ctl = active_controller()
            if ctl is not None and ctl.extra:
                return None
            if getattr(self, "is_compileable", False) and getattr(self, "is_initialized", False):
                self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
                self.values = self.values.index_select(0, beam_idx.to(self.values.device))
                return None
        return original(self, beam_idx, *args, **kwargs)

    return _mark(reorder_cache, original)
