"""transformers 5.17+: the deferred loop's stop check is a subclass of upstream's own `DeferredStopCheck`.

5.17+ `_sample` builds its stop check from the module global `DeferredStopCheck` (when `is_supported`, else the
synchronous `StopCheck`), calls it at the end of every step and undoes the steps `finish()` reports. Replacing
that global with the subclass below makes every `_sample` call of a flag-on `generate()` use our controller;
any other call (flag off, an assistant, another release's code path) gets upstream's behaviour unchanged.
"""

from __future__ import annotations

from ..undo.cache_rollback import (clear_cropped_slots, contiguous_after_crop, holds_static_layers, rollback_one_step,
                             why_not_rollbackable)
from ..state.call_state import active_controller
from ..patching import MARKER


def patched_deferred_class(original, target):
    class AsyncDeferredStopCheck(original):
        """Copied from transformers v5.23.0 `DeferredStopCheck` (identical in 5.17; 5.24's `finish()` also finds an
        `EncoderDecoderCache`'s layers, as ours below). Differences:

        - used on any device when `async_stopping_criteria=True` (upstream: MPS only); without the flag, or on a
          call our `_sample` wrapper did not take over, every method is upstream's;
        - the verdict copy (`unfinished_sequences` itself, one copy instead of `max() == 0` and a copy) and the
          token copy are made on the side stream the criteria ran on; the host reads them at the next step's
          logits processors, not here (`AsyncStop`);
        - a StaticCache (not croppable upstream before 5.24; 5.24's crop leaves the undone step's keys and values
          where stock has zeros) is rolled back in place (`cache_rollback.rollback_one_step`), and the slots a crop
          gives back in static layers are cleared (`cache_rollback.clear_cropped_slots`);
        - the extra step's random draws are given back;
        - an `EncoderDecoderCache` (no `.layers`) is handled through its decoder's `self_attention_cache`;
        - after an exception the recorded past of a returned cache is trimmed and its recording switched off,
          leaving the cache as the synchronous stop check leaves it.
        """

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs):
            ctl = active_controller()
            if ctl is None:
                return original.is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs)
            # our `_sample` wrapper already checked the cache; an assistant gets a controller only as the draft of a
            # deferred assisted call (assisted/draft.py)
            return not is_assistant or getattr(ctl, "drafting", False)

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None, *args, **kwargs):
            ctl = self._ctl = active_controller()
            if ctl is None:
                super().__init__(input_ids, max_length, cache, cache_is_returned, streamer, *args, **kwargs)
                return
            # `max_length` and the streamer are the ones our `_sample` wrapper gave the controller already
            ctl.deferred_check = self
            ctl.see_cache(cache)
            self.streamer = streamer
            self.cache = cache if cache_is_returned else None
            # a full static cache is rolled back in place, never cropped step by step: 5.24 makes it croppable, but its
            # per-step `crop(0)` would be a kernel per layer and step, and its crop leaves the undone step's values
            self._static = (self.cache is not None and why_not_rollbackable(self.cache) is None
                            and holds_static_layers(self.cache))
            self._recorded = self.cache is not None and not self._static and not ctl.synchronous
            if self._recorded:
                self.cache.activate_past_recording()

        def __call__(self, unfinished_sequences, tokens, length):
            ctl = self._ctl
            if ctl is None:
                return super().__call__(unfinished_sequences, tokens, length)
            stopping = ctl.record(unfinished_sequences, tokens, length)
            if not stopping and self._recorded:
                self.cache.crop(0)  # upstream: trim the recorded past back to the window
            return stopping

        def finish(self):
            ctl = self._ctl
            if ctl is None:
                return super().finish()
            try:
                steps_to_undo = ctl.finish()
            except BaseException:
                # the last step's tokens reach the streamer in `ctl.finish()`, after `close()` let go of this check
                # (`ctl.abort` no longer finds it): a streamer raising there leaves the returned cache as `abort`
                # would, its recorded past trimmed and its recording off (usage fuzzer, found families, seed 15329)
                if self.cache is not None:
                    self._undo(1 if (ctl.extra or ctl.overran) else 0)
                raise
            if self.cache is not None:
                self._undo(steps_to_undo)
            return steps_to_undo

        def abort(self):
            """An exception left the loop: leave a returned cache as the synchronous stop check leaves it (no
            recorded past; without a forward stock never reached, if one ran)."""
            ctl = self._ctl
            if ctl is None or self.cache is None:
                return
            self._undo(1 if ctl.overran else 0)

        def _undo(self, steps: int):
            """Give the returned cache back the last `steps` (0 or 1) steps and stop recording its past."""
            if self._recorded:
                self.cache.crop(-steps)
                clear_cropped_slots(self.cache, steps)  # 5.24's static layers: the crop moved only the counters
                if steps:
                    contiguous_after_crop(self.cache)  # stock's layers hold contiguous tensors, not the crop's slices
                self._stop_recording()
            elif steps:
                rollback_one_step(self.cache, self._ctl.extra_position())

        def _stop_recording(self):
            # an EncoderDecoderCache has no `.layers` (upstream's finish() failed there): its decoder's do
            for layer in getattr(self.cache, "self_attention_cache", self.cache).layers:
                if hasattr(layer, "record_past"):
                    layer.record_past = False

    AsyncDeferredStopCheck.__name__ = original.__name__
    AsyncDeferredStopCheck.__qualname__ = original.__qualname__
    AsyncDeferredStopCheck.__module__ = original.__module__
    AsyncDeferredStopCheck.__wrapped__ = original
    setattr(AsyncDeferredStopCheck, MARKER, True)
    return AsyncDeferredStopCheck
