"""Sync-free `CacheLayerMixin.reorder_cache` (beam search with a StaticCache).

Copied from transformers v5.0.0 / v5.23.0 `CacheLayerMixin.reorder_cache` (identical). Difference: stock asks
`if self.get_seq_length() > 0`, and a static layer's length is a device tensor (`cumulative_length` in 5.17+, a
count of non-zero positions in 5.0), so every beam-search step read it once per layer. An initialised static layer
is reordered without asking: when it holds nothing, its buffers are zeros and reordering zeros gives the same
zeros. Layers whose length is a host int keep the stock check.
"""

from __future__ import annotations

from .config import _mark


def patched_reorder_cache(original, target):
    def reorder_cache(self, beam_idx, *args, **kwargs):
        if getattr(self, "is_compileable", False) and getattr(self, "is_initialized", False):
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))
            return None
        return original(self, beam_idx, *args, **kwargs)

    return _mark(reorder_cache, original)
