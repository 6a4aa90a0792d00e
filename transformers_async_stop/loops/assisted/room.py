"""A static cache's room in assisted decoding, counted on the host: no verify forward is launched that writes past
the cache's end.

5.24.0 takes a static cache in assisted decoding (its layers can be cropped). Each round's verify forward writes its
K = candidates + 1 tokens where the layer's counter points, and stock never compares that with the cache's length:
a round that reaches past `max_cache_len` indexes past the end of the keys and values. On the CPU that is an
`IndexError` from `index_copy_`; on CUDA a device-side assert, which leaves the process's CUDA context unusable (every
later CUDA call fails, and with the flag the process aborted: issue 37). How far a round reaches is known on the host
before the forward: where the cache ended after the previous round (the prefill's start is the cache's counter, read
once per call where it was already written; counted on from there), plus the tokens the forward is fed. Where that
is past the end, `Room.check` raises `StaticCacheOverflow` instead of launching the forward, so the process and its
CUDA context stay usable. Rounds that fit run as stock's, and return stock's output.

Which rounds reach past the end (issue 43 lists the paths):
- full-attention layers (`StaticLayer`): a round whose forward is fed more tokens than the cache has left: a user
  `StaticCache` too small for the call (its prefill, the first round, or a later round), a second turn on the same
  cache (5.24's first round feeds the whole sequence again after what the cache holds), and, with
  `cache_implementation="static"` (`max_cache_len = max_length - 1`), prompt lookup's last round: its candidates are
  not capped by the remaining length (a draft model's are, `max_length - cur_len - 1`, so its rounds always fit);
- sliding-window layers (`StaticSlidingWindowLayer`, a model whose every layer has a sliding window, Mistral's
  default, with a cache no longer than the window): a forward that passes `max_cache_len` does not fail, the layer
  slides, but only its host counter `cumulative_length_int` moves: its device counter `cumulative_length`, where its
  in-bounds writes go, stays. The round's crop then moves both back, so the device counter falls behind, below zero
  after enough rounds, and the next forward that fits in the layer writes at that counter: out of bounds. Both
  counters are followed here (one read per call of the device one, where the layer was written), and the raise is
  exactly where stock's `index_copy_` indexes out of bounds (taken where the layer's `update` and `crop` are the ones
  read, `targets.SHORTCUTS` "static sliding layer counters"; elsewhere such a cache runs as stock's);
- the draft model's own cache is never static across rounds: the assistant is called with `cache_implementation`
  unset, and an assistant whose own `generation_config` asks for a static cache gets one in the first round and
  stock raises a `ValueError` in the second (the flag raises the same); within its one round it is sized for the
  draft, and the deferred draft's extra step (a draft stopped by EOS or confidence), where it takes one, would
  write at least one position short of its end. The verify loop itself takes no extra step (its stop is folded into
  the round's read).

Not foreseen here: a write past the end by code the round does not count (a cache whose counter another thread or a
callback moves mid-call); those run as stock's.
"""

from __future__ import annotations

import torch

from ...release_checks.verified import matches
from ...undo.cache_rollback import _layers, cache_end, capacity

SLIDING = "static sliding layer counters"


class StaticCacheOverflow(ValueError, IndexError):
    """A round of assisted decoding would write past the end of a static cache (raised before its forward).

    An `IndexError` too: stock's forward raises that on the CPU, where the same round writes out of bounds."""


class Room:
    """The call's static cache: its length, and where the next forward writes (host ints). Inert for a cache that
    grows."""

    __slots__ = ("capacity", "end", "windows")

    def __init__(self, cache):
        self.capacity = capacity(cache) if cache is not None else None
        self.end = None
        self.windows = _windows(cache) if cache is not None else []
        if self.capacity is None:
            return
        end = cache_end(cache, None)
        if isinstance(end, torch.Tensor):
            end = int(end[0])  # once per call: a fresh cache's counter is a CPU zero; a used one's, one read
        self.end = end

    def check(self, model_inputs: dict) -> None:
        """Before a verify forward: raise where the tokens it is fed would be written past the cache's end."""
        if self.end is None and not self.windows:
            return
        width = _fed(model_inputs)
        if width is None:
            return
        if self.end is not None and self.end + width > self.capacity:
            raise StaticCacheOverflow(
                f"assisted decoding: this round's forward writes {width} tokens at cache positions {self.end} to "
                f"{self.end + width - 1}, past the end of the static cache (max_cache_len={self.capacity}). Stock's "
                f"forward would index out of bounds here (an IndexError on the CPU, a device-side assert on CUDA that "
                f"leaves the CUDA context unusable); it was not launched. Give the cache at least "
                f"{self.end + width} positions, or ask for fewer new tokens.")
        for size, written, counter in self.windows:
            if _indexed(size, written, width) and (counter < 0 or counter + width > size):
                raise StaticCacheOverflow(
                    f"assisted decoding: this round's forward writes {width} tokens into the static cache's "
                    f"sliding-window layers (max_cache_len={size}) at positions {counter} to {counter + width - 1}, "
                    f"outside the cache: an earlier round outgrew the cache, the layers slid, and the rounds' crops "
                    f"left their write position behind their length ({written}). Stock's forward would index out of "
                    f"bounds here (an IndexError on the CPU, a device-side assert on CUDA that leaves the CUDA "
                    f"context unusable); it was not launched. Give the cache as many positions as the call's "
                    f"sequence and its last draft reach, or ask for fewer new tokens.")

    def advance(self, model_inputs: dict, removed: int) -> None:
        """After the round: the forward wrote its tokens, and the crop gave `removed` positions back."""
        if self.end is None and not self.windows:
            return
        width = _fed(model_inputs)
        if width is None:
            self.end, self.windows = None, []  # not followed any further: such rounds run as stock's
            return
        if self.end is not None:
            self.end = self.end + width - removed
        for window in self.windows:
            size, written, counter = window
            if _indexed(size, written, width):
                counter += width  # `StaticSlidingWindowLayer.update`: only its in-bounds branch moves this counter
            window[1], window[2] = written + width - removed, counter - removed


def _indexed(size: int, written: int, width: int) -> bool:
    """Does 5.24's `StaticSlidingWindowLayer.update` write these tokens with `index_copy_` at its device counter (not
    full, and not becoming full: its other branches concatenate and keep the last `size`, and cannot fail)?"""
    return written < size and written + width <= size


def _windows(cache) -> list:
    """[max_cache_len, cumulative_length_int, cumulative_length] of the cache's sliding static layers, one entry per
    group that moves together (same length and host counter), read once per call; [] where there are none, or where
    their sources are not the ones read."""
    layers, _ = _layers(cache)
    try:
        from transformers.cache_utils import StaticSlidingWindowLayer
    except ImportError:
        return []
    sliding = [layer for layer in layers or () if isinstance(layer, StaticSlidingWindowLayer)]
    if not sliding or not matches(SLIDING):
        return []
    groups = {}
    for layer in sliding:
        kind = type(layer)
        if kind.update is not StaticSlidingWindowLayer.update or kind.crop is not StaticSlidingWindowLayer.crop:
            continue  # a subclass with its own update or crop: not modelled here (stock's behaviour)
        size, written = layer.max_cache_len, layer.cumulative_length_int
        if not (isinstance(size, int) and isinstance(written, int)):
            continue
        if (size, written) not in groups:
            counter = layer.cumulative_length
            # once per call and group: a fresh layer's counter is a CPU zero; a written one's, one read
            counter = int(counter.reshape(-1)[0]) if isinstance(counter, torch.Tensor) else int(counter)
            groups[(size, written)] = [size, written, counter]
    return list(groups.values())


def _fed(model_inputs: dict) -> int | None:
    """How many positions the forward writes: the length of the tokens (or embeddings) it is fed."""
    for key in ("input_ids", "inputs_embeds"):
        value = model_inputs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    return None
