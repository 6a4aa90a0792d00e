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

Not foreseen here: a write past the end by code the round does not count (a cache whose counter another thread or a
callback moves mid-call); those run as stock's.
"""

from __future__ import annotations

import torch

from ...undo.cache_rollback import cache_end, capacity


class StaticCacheOverflow(ValueError, IndexError):
    """A round of assisted decoding would write past the end of a static cache (raised before its forward).

    An `IndexError` too: stock's forward raises that on the CPU, where the same round writes out of bounds."""


class Room:
    """The call's static cache: its length, and where the next forward writes (host ints). Inert for a cache that
    grows."""

    __slots__ = ("capacity", "end")

    def __init__(self, cache):
        self.capacity = capacity(cache) if cache is not None else None
        self.end = None
        if self.capacity is None:
            return
        end = cache_end(cache, None)
        if isinstance(end, torch.Tensor):
            end = int(end[0])  # once per call: a fresh cache's counter is a CPU zero; a used one's, one read
        self.end = end

    def check(self, model_inputs: dict) -> None:
        """Before a verify forward: raise where the tokens it is fed would be written past the cache's end."""
        if self.end is None:
            return
        width = _fed(model_inputs)
        if width is not None and self.end + width > self.capacity:
            raise StaticCacheOverflow(
                f"assisted decoding: this round's forward writes {width} tokens at cache positions {self.end} to "
                f"{self.end + width - 1}, past the end of the static cache (max_cache_len={self.capacity}). Stock's "
                f"forward would index out of bounds here (an IndexError on the CPU, a device-side assert on CUDA that "
                f"leaves the CUDA context unusable); it was not launched. Give the cache at least "
                f"{self.end + width} positions, or ask for fewer new tokens.")

    def advance(self, model_inputs: dict, removed: int) -> None:
        """After the round: the forward wrote its tokens, and the crop gave `removed` positions back."""
        if self.end is None:
            return
        width = _fed(model_inputs)
        self.end = None if width is None else self.end + width - removed


def _fed(model_inputs: dict) -> int | None:
    """How many positions the forward writes: the length of the tokens (or embeddings) it is fed."""
    for key in ("input_ids", "inputs_embeds"):
        value = model_inputs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    return None
