"""`_update_model_kwargs_for_generation` of a decode step with fewer kernels (flag on, transformers 5.5.4+).

Copied from transformers v5.5.4-v5.23.0 `GenerationMixin._update_model_kwargs_for_generation` (one source over that
range) and v5.24.0's (the same but for the cache: 5.24 copies `outputs["cache"]` to `model_kwargs["cache"]`, where
5.5-5.23 look the cache up under every name of `ALL_CACHE_NAMES`), for one new token. Differences, same values, dtypes
and shapes:
- the next position ids are `position_ids[..., -1:] + 1` (stock: `arange(1).view(...) + position_ids[..., -1:] + 1`,
  three kernels for the same integers);
- the column of ones appended to the attention mask is made once per call (stock: `new_ones` every step).
Any other call (several new tokens, a model with its own `_update_model_kwargs_for_generation`, a release whose
source differs) runs the original.
"""

from __future__ import annotations

import torch

from ..release_checks import cache_kwarg
from ..release_checks.verified import matches


class KwargsUpdate:
    """Made once per flag-on decoding loop, where the shortcut applies (`for_model`)."""

    __slots__ = ("cache_names", "ones")

    def __init__(self):
        from transformers.generation.utils import ALL_CACHE_NAMES

        # 5.24: only `cache` is copied (the other names of `ALL_CACHE_NAMES` are never looked up there)
        self.cache_names = ("cache",) if cache_kwarg.name() == "cache" else tuple(ALL_CACHE_NAMES)
        self.ones = None  # the (batch, 1) column of ones of the attention mask's dtype and device

    @classmethod
    def for_model(cls, model) -> "KwargsUpdate | None":
        from transformers.generation.utils import GenerationMixin

        if type(model)._update_model_kwargs_for_generation is not GenerationMixin._update_model_kwargs_for_generation:
            return None  # the model has its own
        if not matches("update model kwargs"):
            return None
        return cls()

    def __call__(self, outputs, model_kwargs: dict, is_encoder_decoder: bool = False) -> dict:
        for possible_cache_name in self.cache_names:
            if possible_cache_name in outputs:
                if possible_cache_name in ("past_buckets_states", "mems"):
                    cache_name = "past_key_values"
                else:
                    cache_name = possible_cache_name
                model_kwargs[cache_name] = getattr(outputs, possible_cache_name)
                break
        if (token_type_ids := model_kwargs.get("token_type_ids")) is not None:
            model_kwargs["token_type_ids"] = torch.cat([token_type_ids, token_type_ids[:, -1:]], dim=-1)
        if (mm_token_type_ids := model_kwargs.get("mm_token_type_ids")) is not None:
            model_kwargs["mm_token_type_ids"] = torch.cat(
                [mm_token_type_ids, mm_token_type_ids.new_zeros((mm_token_type_ids.shape[0], 1))], dim=-1
            )
        position_ids_key = "position_ids" if not is_encoder_decoder else "decoder_position_ids"
        if (position_ids := model_kwargs.get(position_ids_key)) is not None:
            model_kwargs[position_ids_key] = torch.cat([position_ids, position_ids[..., -1:] + 1], dim=-1)
        attention_mask_key = "attention_mask" if not is_encoder_decoder else "decoder_attention_mask"
        if (attention_mask := model_kwargs.get(attention_mask_key)) is not None:
            ones = self.ones
            if (ones is None or ones.shape[0] != attention_mask.shape[0] or ones.dtype != attention_mask.dtype
                    or ones.device != attention_mask.device):
                ones = self.ones = attention_mask.new_ones((attention_mask.shape[0], 1))
            model_kwargs[attention_mask_key] = torch.cat([attention_mask, ones], dim=-1)
        return model_kwargs
