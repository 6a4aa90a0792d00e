"""The 4D mask of a padded batch's decode step with a dynamic cache, grown by one column per step (flag on, 5.17+).

With a left-padded batch, the model builds its 4D mask inside every forward: `create_causal_mask` ->
`_preprocess_mask_arguments` -> `sdpa_mask` (the padding and causal mask functions over four broadcast aranges), about
ten kernels and a long Python chain per step, the largest piece of the forward's host time after the layers on a
small model. For a decode step (one query) of a causal model whose cache holds only full-attention `DynamicLayer`s,
SDPA attention, and a 2D mask as long as the cache after the step, all of it reduces to

    mask[b, 0, 0, j] = padding[b, j]      (j <= q_offset = cache length, so the causal part is all True)

a contiguous `(batch, 1, 1, kv_length)` bool tensor. Step t+1's is step t's with one column of True appended (the
column `_update_model_kwargs_for_generation` appends to the 2D mask). `DecodeInputs` passes that tensor as the
forward's `attention_mask`; `create_causal_mask` returns a 4D mask as it is (`_preprocess_mask_arguments`'s early
exit), so every attention layer gets the same values, dtype, shape and strides as in stock.

Copied from transformers v5.17.0-v5.24.0 (`create_causal_mask`, `_preprocess_mask_arguments`, `sdpa_mask`,
`prepare_padding_mask`, `padding_mask_function`, `causal_mask_function`, `and_masks`, `_non_vmap_expansion_sdpa`, the
cache's `get_mask_sizes`/`get_query_offset`/`get_seq_length`, and the forwards of the model families below, which
pass the mask to `create_causal_mask` once and give its result to every layer), restricted to that path.
Differences: the mask is grown instead of rebuilt. It is used only where all of this holds, checked once per call:
- the installed sources are the ones read (`targets.SHORTCUTS` "dynamic decode mask (<family>)": the mask
  functions and cache sizes above, and the family's two forwards);
- the model is exactly one of those families' causal LMs, full attention only (Mistral without `sliding_window`,
  Qwen2 without sliding layers), SDPA with transformers' own `sdpa_mask`, the modeling module's
  `create_causal_mask` is transformers' own, the forward is not compiled, and no forward hook or wrapper on the
  model or its base model could see the mask (they would see a 4D one where stock passes the 2D one);
- the prompt mask has padding (known on the host from the call's `MaskSummary`): an all-ones mask makes stock pass
  no mask at all (SDPA's own causal path), which is left to the model;
and once per step, on the host (`Watch`): all of the above that a callback can change mid-call (a hook registered
on the model, `set_attn_implementation`, a class-level `forward` wrapper, the mask functions, a window set on the
config), and the cache's length
plus one is the mask's length (a callback that crops, resets or fills the cache). Where one changed, the loop hands
the model the 2D mask again from that step on, from which it builds its own, as stock does at every step.
"""

from __future__ import annotations

import sys

import torch

from ...release_checks.verified import matches

# the base model class of each family read: (family, modeling module, causal LM class, whether the model's mask is a
# single full-attention one)
_FAMILIES = {
    "LlamaModel": ("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM", lambda base: True),
    "MistralModel": ("mistral", "transformers.models.mistral.modeling_mistral", "MistralForCausalLM",
                     lambda base: getattr(base.config, "sliding_window", None) is None),
    "Qwen2Model": ("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM",
                   lambda base: not getattr(base, "has_sliding_layers", True)),
}


def applies(model, model_forward, cache, summary) -> "Watch | None":
    """Whether this call's decode steps can be handed a grown 4D mask (see the module docstring): the `Watch` that
    checks, before each step's mask is handed out, that it still can; None where it cannot."""
    from transformers import masking_utils

    if summary is None or not summary.padded:
        return None  # no padding: stock passes no mask to SDPA
    if model_forward != model.__call__:
        return None
    from transformers.cache_utils import DynamicLayer

    if not getattr(model.config, "is_causal", True) or not cache.layers:
        return None
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        # full-attention layers only: a config carrying `sliding_window` (a Llama so configured) makes the cache's
        # layers sliding ones, whose keys stop at the window while the grown mask covers every position (red team of
        # 2026-11-29, padded masks: a shape error where stock returns)
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None)
    family = _FAMILIES.get(type(base).__name__) if base is not None else None
    if family is None:
        return None
    name, module_name, causal_lm, single = family
    module = sys.modules.get(module_name)
    if (module is None or type(base) is not getattr(module, type(base).__name__, None)
            or type(model) is not getattr(module, causal_lm, None) or not single(base)):
        return None
    watch = Watch(model, base, prefix, module, masking_utils, single)
    if not watch.holds() or not matches(f"dynamic decode mask ({name})"):
        return None
    return watch


class Watch:
    """What a callback may change mid-call that stock would honour at its next step (a forward hook registered on
    the model, `set_attn_implementation`, a class-level `forward` wrapper, a mask function swapped): checked on the
    host before every grown mask is handed out (attribute and dict reads, no tensor). Where one changed, the model
    gets the 2D mask again from that step on and builds its own, as in stock."""

    __slots__ = ("model", "base", "prefix", "module", "masking", "forwards", "single")

    def __init__(self, model, base, prefix, module, masking_utils, single):
        self.model, self.base, self.prefix, self.module, self.masking = model, base, prefix, module, masking_utils
        # the family's single full-attention mask, read from the config at every step as the forward reads it (a
        # `sliding_window` set on a Mistral's config mid-call: red team of 2026-11-29, additive mask, hole R3)
        self.single = single
        # the forwards as they are now (the ones `matches` reads at the first decode step)
        self.forwards = (type(model).forward, type(base).forward)

    def holds(self) -> bool:
        model, base, masking_utils = self.model, self.base, self.masking
        if getattr(model.config, "_attn_implementation", None) != "sdpa" or getattr(model, self.prefix, None) is not base:
            return False
        if type(model).forward is not self.forwards[0] or type(base).forward is not self.forwards[1]:
            return False
        if not self.single(base):
            return False
        if getattr(self.module, "create_causal_mask", None) is not masking_utils.create_causal_mask:
            return False
        try:
            if masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is not masking_utils.sdpa_mask:
                return False
        except KeyError:
            return False
        return not (_observed(model) or _observed(base))


def _observed(module) -> bool:
    """A hook or an instance-level forward (accelerate's wrapper) sees the forward's keyword arguments."""
    hooks = torch.nn.modules.module
    return bool(module._forward_pre_hooks or module._forward_hooks or "forward" in module.__dict__
                or hooks._global_forward_pre_hooks or hooks._global_forward_hooks)


def first(mask: torch.Tensor) -> torch.Tensor:
    """Stock's decode-step mask for a 2D mask as long as the cache after the step: contiguous (B, 1, 1, L) bool."""
    return mask.to(torch.bool).reshape(mask.shape[0], 1, 1, mask.shape[-1])
