"""Sync-free `_cache_dependant_input_preparation` (transformers 4.57-5.2; removed upstream in 5.3).

Copied from transformers v5.0.0 `GenerationMixin._cache_dependant_input_preparation`. Differences:
- inside `generate()` (and only when the caller did not pass its own `cache_position`), the ids to feed are the last
  `cache_position.shape[0]` ids. `generate()` always builds `cache_position` as the tail of `input_ids`, so this
  selects the same values as stock's `input_ids[:, cache_position]` / tail slice, without reading
  `cache_position[-1]` on the host (a blocking device read every decode step). 5.3 made the same change upstream
  (huggingface/transformers#44130, `next_sequence_length`).
- everything else (embeddings, export, calls outside `generate()`) goes to the original.
"""

from __future__ import annotations

import torch

from transformers.utils import is_torchdynamo_exporting

from ..state.call_state import CALL
from ..config import _mark


def patched_cache_dependant_input_preparation(original, target):
    def _cache_dependant_input_preparation(self, input_ids, inputs_embeds, cache_position, *args, **kwargs):
        if (
            not torch.compiler.is_compiling()
            and not is_torchdynamo_exporting()  # torch.compiler.is_exporting is 2.7+
            and (state := CALL.get()) is not None
            and state.slice_inputs
            and inputs_embeds is None
            and isinstance(input_ids, torch.Tensor)
            and isinstance(cache_position, torch.Tensor)
            and input_ids.shape[1] > 0
            and cache_position.shape[0] > 0  # nothing to feed: stock's own check raises (a fully cached input)
        ):
            if cache_position.shape[0] != input_ids.shape[1]:
                input_ids = input_ids[:, -cache_position.shape[0]:]
            return inputs_embeds, input_ids
        return original(self, input_ids, inputs_embeds, cache_position, *args, **kwargs)

    return _mark(_cache_dependant_input_preparation, original)
