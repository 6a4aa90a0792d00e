"""The decode-step attention mask of a static cache, built in two kernels per step (flag on, transformers 5.17+).

With a compileable cache, `prepare_inputs_for_generation` builds the 4D mask eagerly before every forward:
`create_masks_for_generate` -> `create_causal_mask` -> `sdpa_mask`, about twenty small kernels and a long chain of
Python decisions (config lookups, cache sizes, mask functions), the largest piece of `generate()`'s host time per
step after the forward itself. For one decode step of a causal model with full-attention static layers and SDPA,
all of it reduces to

    mask[b, 0, 0, j] = (j <= q_offset) & padding[b, j]

where `q_offset` is the cache's device counter (`get_query_offset`) and `padding` is the 2D attention mask right-
padded with zeros to the cache length (absent when transformers dropped an all-ones mask). A `MaskPlan`, made once
per flag-on call for the loop's cache, keeps `arange(cache length)` and the padded mask (one new column copied per
step) and builds exactly that tensor: same values, dtype, shape and contiguity as stock's.

Copied from transformers v5.17.0-v5.24.0 (`create_masks_for_generate`, `create_causal_mask`,
`_preprocess_mask_arguments`, `sdpa_mask`, `prepare_padding_mask`, `causal_mask_function`, `padding_mask_function`,
`and_masks`, `_non_vmap_expansion_sdpa`, `Cache.get_query_offset`, `Cache.get_mask_sizes`, `StaticLayer`'s sizes),
restricted to that path (5.24 renames their `past_key_values` parameter `cache`, keeps `past_key_values` as a
deprecated keyword, leaves a `PagedAttentionCache` early and reorders the packed-sequence mask functions: none of it on
this path). Differences: nothing is recomputed that is constant for the call. Everything else (prefill,
another attention implementation, sliding or chunked layers, or/and mask functions, a 4D mask, a model with its own
`create_masks_for_generate`, a release whose sources differ from the ones read) calls the original.

The plan is found through the cache object `prepare_inputs_for_generation` passes, not through ambient state, so a
`generate()` nested in a processor (another cache) never sees it.
"""

from __future__ import annotations

import weakref

import torch

from ..release_checks import cache_kwarg
from ..state.call_state import compiling
from ..config import _mark
from ..release_checks.verified import matches

_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class MaskPlan:
    """Per call and cache: the constant parts of the decode-step mask."""

    __slots__ = ("cache", "length", "keyed", "kv", "padding", "known", "last", "text")

    def __init__(self, cache, length: int, keyed: bool, device: torch.device, text=None):
        self.cache = weakref.ref(cache)
        self.text = text  # the text config whose sdpa implementation the plan was made for
        self.length = length  # kv length of every full-attention static layer (`max_cache_len`)
        self.keyed = keyed  # the config has `layer_types`: stock returns {"full_attention": mask}
        self.kv = torch.arange(length, device=device)[None, None, None, :]
        self.padding = None  # (B, length) bool: the 2D mask, right-padded with zeros
        self.known = 0  # columns of `padding` copied from the 2D mask so far
        self.last = None  # the last mask returned (static_loop checks that the plan made its first decode mask)

    def mask(self, inputs_embeds, attention_mask, past_key_values):
        """The 4D mask of one decode step, or None where the plan does not apply (the original runs)."""
        batch = inputs_embeds.shape[0]
        if inputs_embeds.shape[1] != 1:
            return None
        if self.text is not None and getattr(self.text, "_attn_implementation", None) != "sdpa":
            # `set_attn_implementation` called mid-call (a processor, a criterion): stock builds that
            # implementation's mask (eager's is additive floats) from the next forward on
            return None
        offset = past_key_values.get_query_offset(0)
        if not isinstance(offset, torch.Tensor):
            return None  # an empty layer (stock: 0); never at a decode step
        causal = self.kv <= offset.to(inputs_embeds.device)
        if attention_mask is None:
            mask = causal.expand(batch, -1, 1, self.length)  # stock: a broadcast view; the caller makes it contiguous
        else:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
                return None
            width = attention_mask.shape[-1]
            if width > self.length or width < self.known:
                return None
            if self.padding is None:
                self.padding = torch.zeros((batch, self.length), dtype=torch.bool, device=inputs_embeds.device)
            if width > self.known:
                # the columns the loop appended since the last step (stock: ones); copied, not assumed
                self.padding[:, self.known:width] = attention_mask[:, self.known:width]
                self.known = width
            mask = causal & self.padding[:, None, None, :]
        self.last = {"full_attention": mask} if self.keyed else mask
        return self.last


def _full_attention_config(config) -> bool | None:
    """None if the plan cannot reproduce this config's masks; else whether they come keyed by layer type."""
    text = config.get_text_config()
    if not getattr(text, "is_causal", True) or getattr(text, "_attn_implementation", None) != "sdpa":
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return True if set(layer_types) == {"full_attention"} else None
    if getattr(text, "sliding_window", None) is not None or getattr(text, "attention_chunk_size", None) is not None:
        return None
    return False


def register(model, cache, device: torch.device) -> bool:
    """Make the plan for a flag-on call's cache, where it applies. Returns whether it does."""
    from transformers import masking_utils
    from transformers.cache_utils import Cache, StaticLayer

    if not isinstance(cache, Cache) or not matches("static decode mask"):
        return False
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not StaticLayer for layer in layers):
        return False
    if (type(cache).get_query_offset is not Cache.get_query_offset
            or type(cache).get_mask_sizes is not Cache.get_mask_sizes
            or masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not masking_utils.sdpa_mask):
        return False
    keyed = _full_attention_config(model.config)
    lengths = {layer.max_cache_len for layer in layers}
    if keyed is None or len(lengths) != 1:
        return False
    _PLANS[cache] = MaskPlan(cache, lengths.pop(), keyed, device, model.config.get_text_config())
    return True


def release(cache) -> None:
    _PLANS.pop(cache, None)


def patched_create_masks_for_generate(original, target):
    def create_masks_for_generate(*args, **kwargs):
        # `prepare_inputs_for_generation` passes keywords only (5.17+: `inputs_embeds`; older: `input_embeds`)
        if not compiling() and _PLANS and not args:
            # the running release's name (5.24: `cache`); a deprecated `past_key_values=` runs the original
            plan = _plan_of(cache_kwarg.get(kwargs))
            if (plan is not None and kwargs.get("or_mask_function") is None
                    and kwargs.get("and_mask_function") is None and kwargs.get("block_sequence_ids") is None
                    and isinstance(kwargs.get("inputs_embeds"), torch.Tensor)):
                mask = plan.mask(kwargs["inputs_embeds"], kwargs.get("attention_mask"), cache_kwarg.get(kwargs))
                if mask is not None:
                    return mask
        return original(*args, **kwargs)

    return _mark(create_masks_for_generate, original)


def _plan_of(cache):
    try:
        return _PLANS.get(cache) if cache is not None else None
    except TypeError:  # not weak-referenceable: never one of ours
        return None
