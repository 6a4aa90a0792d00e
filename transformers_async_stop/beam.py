"""Beam search with the "are all beams done?" verdict read one step late.

Stock `_beam_search` (v5.0-v5.23, same loop) ends each step with
`this_peer_finished = not self._beam_search_has_unfinished_sequences(...)`: `not` on a device tensor, a blocking
read. Like `_sample`, the loop is kept as it is and three of its helpers are wrapped instead:

- `_beam_search_has_unfinished_sequences` hands step t's device verdict to an `AsyncStop` controller and answers
  from step t-1's, already in pinned memory. `max_length` is decided on the host at the same step as stock (the
  running buffers are `max_length` wide, so no step may pass it).
- `_update_finished_beams` keeps its previous result when the previous verdict said "done":
  `torch.where(done_before, old, new)` on the device. The finished `sequences`, `beam_scores` and `beam_indices`
  that the loop returns are then the flag-off run's, whatever the extra step selected.
- `CacheLayerMixin.reorder_cache`, while a returned cache is being filled, reorders by the identity in the extra
  step, so cropping its one extra position gives back the flag-off cache.

`patched_beam_search` then trims the extra step's scores, logits, attentions and hidden states, crops the returned
cache and gives back sampling's draws.
"""

from __future__ import annotations

import contextvars

import torch

from .cache_rollback import rollback_one_step, why_not_rollbackable
from .config import _mark, runs_stock
from .generation import _cache_is_returned, trim_recorded
from .stop_check import ACTIVE, AsyncStop


class BeamLag:
    """What the wrapped beam-search helpers share during one deferred `_beam_search` call."""

    def __init__(self, ctl: AsyncStop, flat_batch: int, device: torch.device, guard_reorder: bool):
        self.ctl = ctl
        self.done_now: torch.Tensor | None = None  # the latest step's "done" (device bool), read by the next step
        # allocated once per call: the extra step's reorder becomes the identity when the cache is returned
        self.identity = torch.arange(flat_batch, device=device) if guard_reorder else None
        self._raw_idx = None
        self._guarded_idx = None

    def verdict(self, unfinished: torch.Tensor) -> bool:
        """Record this step's "some beam can still improve" (device bool); return the lagged "keep going"."""
        self.done_now = torch.logical_not(unfinished)
        return not self.ctl.step(self.done_now, None, self.ctl.last_length + 1)

    def keep_if_done_before(self, old, new):
        if self.done_now is None:
            return new  # the first step: nothing was done before it
        # `done_now` is the verdict of the step before the one calling: its own is made after this update
        return tuple(torch.where(self.done_now, o, n) for o, n in zip(old, new))

    def reorder_index(self, beam_idx: torch.Tensor) -> torch.Tensor:
        if self.identity is None or self.done_now is None:
            return beam_idx
        if beam_idx is not self._raw_idx:  # one `where` per step, shared by every layer
            self._raw_idx = beam_idx
            self._guarded_idx = torch.where(self.done_now, self.identity.to(beam_idx.device), beam_idx)
        return self._guarded_idx


BEAM: contextvars.ContextVar[BeamLag | None] = contextvars.ContextVar("transformers_async_stop_beam", default=None)


def _why_stock(model, generation_config, synced_gpus, model_kwargs) -> str | None:
    if synced_gpus:
        return "beam search with `synced_gpus=True` is not made async"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and _cache_is_returned(generation_config, model_kwargs):
        reason = why_not_rollbackable(cache)
        if reason is not None:
            return f"beam search cannot roll back the returned cache by one step ({reason})"
        if hasattr(model, "_reorder_cache"):
            return f"beam search with {type(model).__name__}'s own `_reorder_cache` and a returned cache"
    return None


def patched_beam_search(original, target):
    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        def stock():
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, **model_kwargs)

        if runs_stock(generation_config, input_ids.device,
                      lambda: _why_stock(self, generation_config, synced_gpus, model_kwargs)):
            return stock()

        ctl = AsyncStop(input_ids, generation_config.max_length, do_sample=bool(generation_config.do_sample))
        # 5.0-5.16 create the cache in the first forward: `see_cache` checks it then, and a returned cache that
        # cannot give a step back turns the controller synchronous (stock's reads, one warning)
        returned = ctl.cache_returned = _cache_is_returned(generation_config, model_kwargs)
        lag = BeamLag(ctl, input_ids.shape[0], input_ids.device, guard_reorder=returned)
        active, beam = ACTIVE.set(ctl), BEAM.set(lag)
        try:
            outputs = stock()
        finally:
            BEAM.reset(beam)
            ACTIVE.reset(active)
            ctl.close()
        steps = ctl.finish()
        if steps and not isinstance(outputs, torch.Tensor):
            trim_recorded(outputs, steps)  # the finished beams themselves were kept on the device
        if steps and returned:
            cache = None if isinstance(outputs, torch.Tensor) else getattr(outputs, "past_key_values", None)
            cache = model_kwargs.get("past_key_values") if cache is None else cache
            if cache is not None and why_not_rollbackable(cache) is None:
                rollback_one_step(cache, ctl.kept_cache_length)
        return outputs

    return _mark(_beam_search, original)


def patched_beam_verdict(original, target):
    def _beam_search_has_unfinished_sequences(*args, **kwargs):
        unfinished = original(*args, **kwargs)
        lag = BEAM.get()
        if lag is None or not isinstance(unfinished, torch.Tensor):
            return unfinished
        return lag.verdict(unfinished)

    return staticmethod(_mark(_beam_search_has_unfinished_sequences, original))


def patched_update_finished_beams(original, target):
    def _update_finished_beams(self, sequences, topk_running_sequences, beam_scores, topk_log_probs, beam_indices,
                               *args, **kwargs):
        new = original(self, sequences, topk_running_sequences, beam_scores, topk_log_probs, beam_indices,
                       *args, **kwargs)
        lag = BEAM.get()
        if lag is None:
            return new
        # the outputs: sequences, beam_scores, beam_indices; `is_sent_finished` only steers later steps
        kept = lag.keep_if_done_before((sequences, beam_scores, beam_indices), new[:3])
        return (*kept, *new[3:])

    return _mark(_update_finished_beams, original)


def patched_reorder_cache(original, target):
    """Copied from transformers v5.0.0 / v5.23.0 `CacheLayerMixin.reorder_cache` (identical). Differences:

    - stock asks `if self.get_seq_length() > 0`, and a static layer's length is a device tensor (`cumulative_length`
      in 5.17+, a count of non-zero positions in 5.0), so every beam-search step read it once per layer. An
      initialised static layer is reordered without asking: when it holds nothing, its buffers are zeros and
      reordering zeros gives the same zeros. Layers whose length is a host int keep the stock check. Always on.
    - with the flag, while a returned cache is filled, the extra step's reorder is the identity (`BeamLag`).
    """

    def reorder_cache(self, beam_idx, *args, **kwargs):
        lag = BEAM.get()
        if lag is not None:
            beam_idx = lag.reorder_index(beam_idx)
        if getattr(self, "is_compileable", False) and getattr(self, "is_initialized", False):
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))
            return None
        return original(self, beam_idx, *args, **kwargs)

    return _mark(reorder_cache, original)
