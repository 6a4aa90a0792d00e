"""The sources behind the piecewise-graphed decode forward (`piecewise/`), per model family, 5.17.0-5.24.0 (OPT 5.18+).

A replay runs none of the forward's Python: every decision these sources make is baked in at the recording. Each was
read for decisions that depend on the length or the step: none, for a decode step of a full-attention model with a
static rope type, an SDPA attention and a `DynamicCache`, beyond the cache update and the attention call (run eagerly
at each replay) and the mask (`piecewise/forward._attention_mask`). Between the releases below they differ in the
rotary embedding's arithmetic (5.17-5.18: a matmul under disabled autocast; 5.19+: a broadcast product), the logits
slicing helper (5.21+), `dynamic_rope_update`'s body (only active for dynamic/longrope, which step aside) and
docstrings. 5.24.0 differs from 5.23.0 in:
- the cache's name (`past_key_values` -> `cache` in every forward, `create_causal_mask`, `_preprocess_mask_arguments`
  and the output dataclasses; `deprecate_kwarg` wrappers take the old name): read through `cache_kwarg.py`;
- the attention forwards call `cache.update(k, v, layer_idx, kwargs=kwargs)`: `Cache.update` hands `kwargs` to
  `DynamicLayer.update`'s `**kwargs`, which ignores it (both unchanged), so the recording takes that call
  (`recorder._plain_update`) and a replay's `update(cache, k, v, layer_idx)` is the same;
- the rotary embeddings' forward loses `@torch.no_grad()`: the path runs only with gradients disabled;
- `_preprocess_mask_arguments` returns early for a `PagedAttentionCache` (never a `DynamicCache`), and
  `create_causal_mask` reorders its packed-sequence branch (only without a cache).
"""

from .piecewise_bart_rows import BART_ROWS
from .shortcuts import Shortcut
from .piecewise_t5_rows import MT5 as _MT5
from .piecewise_t5_rows import T5 as _T5

_COMMON = {
    "transformers.cache_utils:DynamicLayer.update": {"3fe48b1632f1": "5.17.0-5.24.0"},
    "transformers.cache_utils:Cache.update": {"679ec869a03c": "5.17.0-5.19.0", "7f41008b39ef": "5.20.2-5.24.0"},
    "transformers.masking_utils:_preprocess_mask_arguments": {"df23eb733c6e": "5.17.0-5.23.0", "606823244fa4": "5.24.0"},
    "transformers.masking_utils:create_causal_mask": {"08e44eae3326": "5.17.0-5.19.0", "bd4450cc85d6": "5.20.2-5.22.2", "341ee68974b1": "5.23.0", "143e39d36ae2": "5.24.0"},
    "transformers.masking_utils:sdpa_mask": {"acbbdd247878": "5.17.0-5.18.0", "2a073d7981cd": "5.19.0", "a30991b130d8": "5.20.2-5.24.0"},
    "transformers.masking_utils:_ignore_causal_mask_sdpa": {"73264261e58f": "5.17.0", "60d5f943b631": "5.18.0-5.19.0", "b3d03cfa0d76": "5.20.2-5.24.0"},
    "transformers.modeling_rope_utils:dynamic_rope_update": {"a3178e1ab4ac": "5.17.0-5.20.2", "812c0729f2a7": "5.21.1-5.22.2", "c0bc145a2182": "5.23.0-5.24.0"},
    # sliding-window layers (mistral's default window, Gemma 3's and Exaone 4's hybrid layers, Ministral): the layer's
    # update runs eagerly between the pieces, like `DynamicLayer.update` (5.17 differs only where its past is recorded:
    # the full states are returned, not the visible ones). The decode step's mask each sliding layer gets is answered
    # on the host (`masks.host_mask`), as these sources make it: no padding, a window that has not begun to slide
    # (fewer than `sliding_window - 1` positions held) gives None (`_ignore_causal_mask_sdpa`: `kv_length <
    # local_size`); from there on `sdpa_mask` materialises the window, every entry True (sliding overlay and causal
    # function over the `get_mask_sizes` aranges), `(1, 1, 1, window)` expanded to the batch without a 2D mask,
    # `(batch, 1, 1, window)` with one (`padding_mask_function` indexes it); `create_causal_mask` gives None.
    # Read on 5.17.0-5.24.0
    "transformers.cache_utils:DynamicSlidingWindowLayer.update": {"84f9dc6160a9": "5.17.0", "63d4e10e3d3d": "5.18.0-5.24.0"},
    "transformers.cache_utils:DynamicSlidingWindowLayer.get_mask_sizes": {"42f4eb2b7501": "5.17.0-5.24.0"},
    "transformers.cache_utils:DynamicSlidingWindowLayer.get_seq_length": {"080f817a7e99": "5.17.0-5.24.0"},
    "transformers.cache_utils:Cache.get_mask_sizes": {"6c372f7d47d1": "5.17.0-5.22.2", "979ed43a0b27": "5.23.0-5.24.0"},
    "transformers.cache_utils:Cache.get_query_offset": {"0890a0e73381": "5.17.0-5.24.0"},
    "transformers.masking_utils:create_sliding_window_causal_mask": {"1df4553adac5": "5.17.0-5.19.0", "86cded694378": "5.20.2-5.22.2", "410bd7e79f27": "5.23.0", "e7f6a00edf5b": "5.24.0"},
    "transformers.masking_utils:sliding_window_causal_mask_function": {"6071b3da2ce1": "5.17.0-5.24.0"},
    "transformers.masking_utils:sliding_window_overlay": {"d36e026d3002": "5.17.0-5.24.0"},
    "transformers.masking_utils:and_masks": {"789b132c21d8": "5.17.0-5.24.0"},
    "transformers.masking_utils:causal_mask_function": {"e8566f1e2978": "5.17.0-5.24.0"},
    "transformers.masking_utils:padding_mask_function": {"5682e7f76fc8": "5.17.0-5.24.0"},
    "transformers.masking_utils:prepare_padding_mask": {"ad0de58050a9": "5.17.0-5.24.0"},
    "transformers.masking_utils:_non_vmap_expansion_sdpa": {"5a75af9fba8f": "5.17.0-5.24.0"},
}
_FAMILIES = (  # family, modeling module, then each of its sources (qualified name -> {digest: releases})
    ("llama", "transformers.models.llama.modeling_llama", {
        "LlamaAttention.forward": {"c0fd8e0b732b": "5.17.0-5.23.0", "15034ca19bd8": "5.24.0"},
        "LlamaDecoderLayer.forward": {"461ed20abeb5": "5.17.0-5.23.0", "c58bc6a3bd65": "5.24.0"},
        "LlamaModel.forward": {"aa5e80868d38": "5.17.0-5.22.2", "3bc97b32d434": "5.23.0", "6ad906eadeb4": "5.24.0"},
        "LlamaForCausalLM.forward": {"70b8a70f207c": "5.17.0-5.20.2", "88ab78d8a65e": "5.21.1-5.22.2", "c1729a1872c8": "5.23.0", "7c3c3983abb9": "5.24.0"},
        "LlamaRotaryEmbedding.forward": {"36aa3216b123": "5.17.0", "05b8d52cfa8f": "5.18.0", "2b71104c384d": "5.19.0-5.23.0", "0197c13cb9f7": "5.24.0"},
        "LlamaMLP.forward": {"b4e9c2637c7f": "5.17.0-5.24.0"},
        "LlamaRMSNorm.forward": {"d676bfe9af0e": "5.17.0-5.24.0"},
        "transformers.activations:SiLUActivation.forward": {"daf20c34b63e": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"ea234325c15d": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
    }),
    ("mistral", "transformers.models.mistral.modeling_mistral", {
        "MistralAttention.forward": {"8c961e165cda": "5.17.0-5.23.0", "4f9a18cc72b2": "5.24.0"},
        "MistralDecoderLayer.forward": {"461ed20abeb5": "5.17.0-5.23.0", "c58bc6a3bd65": "5.24.0"},
        "MistralModel.forward": {"b237e110b64c": "5.17.0-5.22.2", "dc333785d7df": "5.23.0", "0a953917a1d6": "5.24.0"},
        "MistralForCausalLM.forward": {"cb3ef7d01ef6": "5.17.0-5.20.2", "17d5053f7fe8": "5.21.1-5.22.2", "d212cdaee547": "5.23.0", "ed35883a09a5": "5.24.0"},
        "MistralRotaryEmbedding.forward": {"36aa3216b123": "5.17.0", "05b8d52cfa8f": "5.18.0", "2b71104c384d": "5.19.0-5.23.0", "0197c13cb9f7": "5.24.0"},
        "MistralMLP.forward": {"b4e9c2637c7f": "5.17.0-5.24.0"},
        "MistralRMSNorm.forward": {"d676bfe9af0e": "5.17.0-5.24.0"},
        "transformers.activations:SiLUActivation.forward": {"daf20c34b63e": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"ea234325c15d": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
    }),
    ("qwen2", "transformers.models.qwen2.modeling_qwen2", {
        "Qwen2Attention.forward": {"4015c9477db5": "5.17.0-5.23.0", "19fc6c09f70a": "5.24.0"},
        "Qwen2DecoderLayer.forward": {"461ed20abeb5": "5.17.0-5.23.0", "c58bc6a3bd65": "5.24.0"},
        "Qwen2Model.forward": {"040ee3766c9f": "5.17.0-5.22.2", "af291875cf36": "5.23.0", "4098825e5a45": "5.24.0"},
        "Qwen2ForCausalLM.forward": {"10095c638162": "5.17.0-5.20.2", "67993adf9efd": "5.21.1-5.22.2", "da4cda5e6f6d": "5.23.0", "d57926925356": "5.24.0"},
        "Qwen2RotaryEmbedding.forward": {"87d2b6f6ab34": "5.17.0", "c7ebca22877a": "5.18.0", "2b71104c384d": "5.19.0-5.23.0", "0197c13cb9f7": "5.24.0"},
        "Qwen2MLP.forward": {"b4e9c2637c7f": "5.17.0-5.24.0"},
        "Qwen2RMSNorm.forward": {"d676bfe9af0e": "5.17.0-5.24.0"},
        "transformers.activations:SiLUActivation.forward": {"daf20c34b63e": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"ea234325c15d": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
    }),
    ("qwen3", "transformers.models.qwen3.modeling_qwen3", {
        "Qwen3Attention.forward": {"95140604894f": "5.17.0-5.23.0", "fc750afd3f26": "5.24.0"},
        "Qwen3DecoderLayer.forward": {"461ed20abeb5": "5.17.0-5.23.0", "c58bc6a3bd65": "5.24.0"},
        "Qwen3Model.forward": {"040ee3766c9f": "5.17.0-5.22.2", "af291875cf36": "5.23.0", "4098825e5a45": "5.24.0"},
        "Qwen3ForCausalLM.forward": {"9275ccb07d13": "5.17.0", "1fda4b6632e6": "5.18.0-5.20.2", "fc92307cda6a": "5.21.1-5.22.2", "1069d246bbcd": "5.23.0", "3917225085c9": "5.24.0"},
        "Qwen3RotaryEmbedding.forward": {"87d2b6f6ab34": "5.17.0", "c7ebca22877a": "5.18.0", "2b71104c384d": "5.19.0-5.23.0", "0197c13cb9f7": "5.24.0"},
        "Qwen3MLP.forward": {"b4e9c2637c7f": "5.17.0-5.24.0"},
        "Qwen3RMSNorm.forward": {"d676bfe9af0e": "5.17.0-5.24.0"},
        "transformers.activations:SiLUActivation.forward": {"daf20c34b63e": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"ea234325c15d": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
    }),
    # Phi-3: Mistral's base forward (the mask function chosen by `sliding_window`: a window steps aside), fused
    # `qkv_proj` sliced into q/k/v and `gate_up_proj` chunked (fixed shapes), a partial-rotary `apply_rotary_pos_emb`
    # (the rotary width is the cos table's, fixed at init), dropouts that are identities in eval mode. 5.23's MLP
    # differs in its annotation only
    ("phi3", "transformers.models.phi3.modeling_phi3", {
        "Phi3Attention.forward": {"975f1916d08c": "5.17.0-5.23.0", "56228160fb9f": "5.24.0"},
        "Phi3DecoderLayer.forward": {"daaa63565aa0": "5.17.0-5.23.0", "95f20d9c7c28": "5.24.0"},
        "Phi3Model.forward": {"b237e110b64c": "5.17.0-5.22.2", "dc333785d7df": "5.23.0", "0a953917a1d6": "5.24.0"},
        "Phi3ForCausalLM.forward": {"5938979648ac": "5.17.0-5.20.2", "5ec1fe5f1f52": "5.21.1-5.22.2", "ac1e14a5befb": "5.23.0", "5cb7498725e9": "5.24.0"},
        "Phi3RotaryEmbedding.forward": {"36aa3216b123": "5.17.0", "05b8d52cfa8f": "5.18.0", "2b71104c384d": "5.19.0-5.23.0", "0197c13cb9f7": "5.24.0"},
        "Phi3MLP.forward": {"d43226978125": "5.17.0-5.22.2", "82162c293dac": "5.23.0-5.24.0"},
        "Phi3RMSNorm.forward": {"d676bfe9af0e": "5.17.0-5.24.0"},
        "transformers.activations:SiLUActivation.forward": {"daf20c34b63e": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"0d2d41fdeeda": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
    }),
    # GPT-2: no rotary; the learned position table `wpe` is read in piece 0 from the positions buffer; `c_attn` (a
    # Conv1D: addmm over a view) split into q/k/v; cross-attention only with `add_cross_attention` (steps aside);
    # `reorder_and_upcast_attn` only under eager attention; a 4D mask skips the reshape of a 2D one and
    # `warn_if_padding_and_no_attention_mask` returns at once for any mask (a step without one steps aside: the check
    # reads the ids on the host). 5.23 differs in annotations only
    ("gpt2", "transformers.models.gpt2.modeling_gpt2", {
        "GPT2Attention.forward": {"bc1f4c5bcfcf": "5.17.0-5.22.2", "4042d688a365": "5.23.0", "266c93b28b36": "5.24.0"},
        "GPT2Block.forward": {"c0950432d0d5": "5.17.0-5.22.2", "bdfba8ae99f4": "5.23.0", "1d937ce81633": "5.24.0"},
        "GPT2Model.forward": {"119f51a6e043": "5.17.0-5.22.2", "4d378054377c": "5.23.0", "044fd7f33a06": "5.24.0"},
        "GPT2LMHeadModel.forward": {"ad802d07fa1f": "5.17.0-5.20.2", "3b7988a13896": "5.21.1-5.22.2", "871652701669": "5.23.0", "4a2c51c6ad48": "5.24.0"},
        "GPT2MLP.forward": {"c88c423cabff": "5.17.0-5.22.2", "a875d1914604": "5.23.0-5.24.0"},
        "transformers.pytorch_utils:Conv1D.forward": {"70e4c291a2dc": "5.17.0-5.24.0"},
        "transformers.activations:NewGELUActivation.forward": {"23d0bb14245b": "5.17.0-5.24.0"},
        "transformers.modeling_utils:PreTrainedModel.warn_if_padding_and_no_attention_mask": {"9ffe0ea27d5b": "5.17.0-5.24.0"},
    }),
    # Gemma 3 (text), full-attention layers only: the rotary embedding is called once per layer type (a set, fixed by
    # the config) with that type's static frequencies; q/k RMS norms; the embedding scaled by a buffer; the mask
    # mapping's sliding entry (`create_sliding_window_causal_mask`, which returns the 4D sentinel as it is) is read by
    # no full layer; the final logit soft-capping is a config branch. 5.20 changes only the sliding mask's packed-
    # sequence branch (no cache), 5.23 annotations
    ("gemma3", "transformers.models.gemma3.modeling_gemma3", {
        "Gemma3Attention.forward": {"6e90b6366068": "5.17.0-5.23.0", "a587b2149a76": "5.24.0"},
        "Gemma3DecoderLayer.forward": {"78a7d4e25e48": "5.17.0-5.22.2", "06827e6c4404": "5.23.0", "f0e376e68238": "5.24.0"},
        "Gemma3TextModel.forward": {"90af3d0f9dff": "5.17.0-5.22.2", "97c81a903bde": "5.23.0", "da568ee36512": "5.24.0"},
        "Gemma3ForCausalLM.forward": {"7fa4142552a6": "5.17.0-5.20.2", "995da50b9561": "5.21.1-5.22.2", "931e74ef7885": "5.23.0", "ac85009833df": "5.24.0"},
        "Gemma3RotaryEmbedding.forward": {"13f36c90e2ab": "5.17.0", "8119db5a6a44": "5.18.0", "8ea608d3afdf": "5.19.0-5.23.0", "94181ac8fda3": "5.24.0"},
        "Gemma3MLP.forward": {"b4e9c2637c7f": "5.17.0-5.24.0"},
        "Gemma3RMSNorm.forward": {"3a8c77aca757": "5.17.0-5.24.0"},
        "Gemma3TextScaledWordEmbedding.forward": {"af332c9fd666": "5.17.0-5.24.0"},
        "apply_rotary_pos_emb": {"ea234325c15d": "5.17.0-5.24.0"},
        "rotate_half": {"f714a4b1160c": "5.17.0-5.24.0"},
        "transformers.masking_utils:create_sliding_window_causal_mask": {"1df4553adac5": "5.17.0-5.19.0", "86cded694378": "5.20.2-5.22.2", "410bd7e79f27": "5.23.0", "e7f6a00edf5b": "5.24.0"},
        "transformers.activations:GELUTanh.forward": {"35866b531b89": "5.17.0-5.24.0"},
    }),
)


# the dynamic-cache loop's undo of its extra step in a returned cache with sliding-window layers
# (`cache_rollback.StepSnapshot`): these bind new tensors and counters to the layer's attributes and write into none
# they held (a sliding layer's `update`: `torch.cat`, then a slice of it; 5.17 returns the full states where its past
# is recorded), so the attributes as they were before the step are the flag-off run's. Read on 5.17.0-5.24.0 (5.24's
# `DynamicLayer.lazy_initialization` changes its annotations only)
_SLIDING_UNDO = {
    "transformers.cache_utils:DynamicSlidingWindowLayer.update": {"84f9dc6160a9": "5.17.0", "63d4e10e3d3d": "5.18.0-5.24.0"},
    "transformers.cache_utils:DynamicSlidingWindowLayer.lazy_initialization": {"ae8618ba56a1": "5.17.0-5.24.0"},
    "transformers.cache_utils:DynamicLayer.update": {"3fe48b1632f1": "5.17.0-5.24.0"},
    "transformers.cache_utils:DynamicLayer.lazy_initialization": {"de1375a15450": "5.17.0-5.23.0", "a828302291d9": "5.24.0"},
    # the loop's own `_sample` pins the releases: the layers' sources above are the same on 5.15-5.16, where the
    # dynamic-cache loop does not run (the drift test: a shortcut matches only where it claims)
    "transformers.generation.utils:GenerationMixin._sample": {"61160ef8c121": "5.17.0-5.23.0", "9e153ccbcefb": "5.24.0"},
}


# OPT, 5.18.0-5.24.0 (read on each of 5.17.0, 5.18.0, 5.19.0, 5.20.2, 5.21.1, 5.22.2, 5.23.0, 5.24.0). What each
# decision in Python depends on, for a decode step handed `input_ids`, `position_ids`, a `DynamicCache`, no labels:
# - `OPTForCausalLM.forward` calls `self.model.decoder` itself (`OPTModel.forward`, read for the default-deny, passes
#   through); `labels` is None (the loss branch: the recording takes no labels); the logits slice by `logits_to_keep`,
#   an int in the key (5.17-5.20 inline, 5.21+ `slice_logits_to_keep`); `.contiguous()`;
# - `OPTDecoder.forward`: ids given (`view(-1, shape[-1])`, fixed shapes), a cache given. `past_seen_tokens =
#   cache.get_seq_length()` is a host read of the length, baked into a recording: it feeds only (a) `seq_length` and
#   `torch.ones(batch, past_seen_tokens + n)` when `attention_mask` is None, a branch no recording takes (its mask is
#   the 4D sentinel, `graphs.py`) and whose ones, in stock, reach only (b) and (c); (b) the `position_ids is None`
#   branch, which no recording or replay takes (each is handed the step's `position_ids`; a step without them stays
#   eager, `forward._step`); (c) `embed_positions(mask, past_seen_tokens, position_ids=...)`, which reads neither
#   once `position_ids` is given. So no output depends on the baked value. `create_causal_mask` gets the step's own
#   `attention_mask` in stock (the sentinel in a recording, returned as it is; each replay's mask is the package's,
#   from the step's mask, as for every family). `project_in` / `project_out` (a word embedding narrower than the
#   hidden size, OPT-350m) and `final_layer_norm` (`do_layer_norm_before and not _remove_final_layer_norm`) are
#   `is not None` branches on modules fixed at init (a module set or replaced is a stale recording); the layerdrop
#   branch runs only in training mode (which keeps the forward eager); `pos_embeds.to(device)`: the same device;
# - `OPTLearnedPositionalEmbedding.forward` with `position_ids`: `embedding(position_ids + self.offset)`, the offset
#   (2) a plain attribute (compared before each replay); in piece 0, from the positions buffer, as GPT-2's `wpe`. A
#   position past `max_position_embeddings` indexes past the table as in stock: the controller reads each verdict
#   before a forward past it (`undo/position_table.py`);
# - `OPTDecoderLayer.forward`: `do_layer_norm_before` (the config's, an attribute set at init: norms before or after
#   the attention and the MLP), dropouts with `training=self.training` (identities in eval), a reshape to 2D and a view
#   back (fixed shapes), `activation_fn` = `ACT2FN[config.activation_function]` (relu: torch's `nn.ReLU`; another
#   activation's class is not read with OPT: proven per recording);
# - `OPTAttention.forward`: q scaled by `self.scaling` before the attention, which gets `scaling=1.0`; `enable_bias`
#   decides at init whether the projections have biases; the cache update and the attention run eagerly at each
#   replay; `dropout` is 0.0 outside training.
# 5.17 is not listed: when its base forward gets no `attention_mask` it hands `create_causal_mask` the ones of the
# cache's length instead of None (5.18 keeps them for the positions only), so there the family is proven per
# recording, and refused for the host read (docs/paths.md). 5.21 adds `slice_logits_to_keep`; 5.23 changes
# annotations and the layerdrop condition (`and self.layerdrop > 0.0`); 5.24 renames the cache `cache` (and
# `embed_positions`' `past_key_values_length` `cache_length`) and passes `kwargs=kwargs` to `cache.update`
_OPT = ("opt", "transformers.models.opt.modeling_opt", {
    "OPTAttention.forward": {"99c152c322d7": "5.18.0-5.23.0", "eb66e6dcaa33": "5.24.0"},
    "OPTDecoderLayer.forward": {"2aff579b3bcf": "5.18.0-5.23.0", "f6439a0f2ea9": "5.24.0"},
    "OPTDecoder.forward": {"fd7be26aab06": "5.18.0-5.22.2", "e6abde7e2434": "5.23.0", "0584671001cf": "5.24.0"},
    "OPTModel.forward": {"8f97826f5669": "5.18.0-5.22.2", "f8f21a323f96": "5.23.0", "34f787cb568f": "5.24.0"},
    "OPTForCausalLM.forward": {"713ba842334c": "5.18.0-5.20.2", "bc2416be4907": "5.21.1-5.22.2",
                               "37e4a66c978e": "5.23.0", "8cf4aec2c53c": "5.24.0"},
    "OPTLearnedPositionalEmbedding.forward": {"d07b4542d401": "5.18.0-5.23.0", "d9ff0512c592": "5.24.0"},
})


# Whisper's decoder (WhisperForConditionalGeneration), 5.17.0-5.24.0 (read on each of 5.17.0, 5.18.0, 5.19.0, 5.20.2,
# 5.21.1, 5.22.2, 5.23.0, 5.24.0; 5.17-5.22 the same). What each decision in Python depends on, for a decode step handed
# `decoder_input_ids`, `decoder_position_ids` (the piecewise forward's: stock's own values, `forward._step`),
# `encoder_outputs` (a `BaseModelOutput`), a plain `EncoderDecoderCache` whose every layer's cross-attention is written
# (`is_updated`), no labels, no decoder mask (the recording's is the 4D sentinel):
# - `WhisperForConditionalGeneration.forward`: `labels` None (the loss branch); `proj_out` on the last hidden state;
#   the output carries the encoder's `last_hidden_state`, `hidden_states` and `attentions` as given (a replay's
#   output too, `recording.Recording.output`);
# - `WhisperModel.forward`: `encoder_outputs` given, a `BaseModelOutput`: the encoder does not run (nor
#   `_mask_input_features`; the encoder's `attention_mask` is read only there); `encoder_outputs[0]` handed to the
#   decoder as `encoder_hidden_states`;
# - `WhisperDecoder.forward`: ids given (the embedding in piece 0); a cache given (no new cache). `cache_length =
#   cache.get_seq_length()` (`EncoderDecoderCache.get_seq_length`: the self-attention cache's) is a host read of the
#   length, baked into a recording: it feeds only the `position_ids is None` branch (never taken: every recording and
#   replay is handed the positions, stock's `arange(n) + cache_length` repeated over the batch, filled from the same
#   host length) and `embed_positions(ids, cache_length, position_ids=...)`, which reads it only without
#   `position_ids`. So no output depends on the baked value. With `position_ids` the embedding is
#   `self.weight[position_ids]` (an index in piece 0, from the positions buffer), of shape (batch, n, d) where stock's
#   slice is (n, d): `inputs_embeds + positions` adds the same two values per element. `create_causal_mask` returns
#   the 4D sentinel as it is (each replay's mask is the package's, from the step's, as for every family); the
#   layerdrop branch runs only in training (eager); each layer gets `encoder_attention_mask=None`;
# - `WhisperDecoderLayer.forward`: the self-attention, then the cross-attention block (`encoder_hidden_states is not
#   None`: given at every step), the MLP (`ACT2FN[config.activation_function]`: GELU read here; another activation's
#   class is not read with Whisper, and default-deny keeps it eager), dropouts with `training=self.training`;
# - `WhisperAttention.forward`: q scaled before the attention (`scaling=1.0`); the self-attention reads the
#   `EncoderDecoderCache`'s `is_updated` and updates its `self_attention_cache` (run eagerly at each replay); the
#   cross-attention sets `is_updated[layer] = True` (already True: the step is eager otherwise) and, `is_updated`
#   being True, takes `cross_attention_cache.layers[layer].keys/values` with no op and no update: each replay reads
#   the step's own cache's (`recording.Recording.replay`), and the recording checks by identity that the attention got
#   them, unchanged since the step began;
# - `WhisperPositionalEmbedding.forward`: the `position_ids` branch. 5.23 changes annotations and the layerdrop
#   condition (`and self.layerdrop > 0.0`); 5.24 renames the cache `cache` (and the embedding's
#   `past_key_values_length` `cache_length`) and passes `kwargs=kwargs` to `cache.update`
_WHISPER = ("whisper", "transformers.models.whisper.modeling_whisper", {
    "WhisperAttention.forward": {"589f084030ea": "5.17.0-5.23.0", "80d8edd51b83": "5.24.0"},
    "WhisperDecoderLayer.forward": {"b752b95ef76e": "5.17.0-5.22.2", "bfa5ebbc7e3a": "5.23.0",
                                    "9ab638e44ec5": "5.24.0"},
    "WhisperDecoder.forward": {"804a90056871": "5.17.0-5.22.2", "6caac02ae421": "5.23.0", "71c2affcde70": "5.24.0"},
    "WhisperModel.forward": {"f82f710d0f84": "5.17.0-5.22.2", "38e44ce627f2": "5.23.0", "b41b120d4818": "5.24.0"},
    "WhisperForConditionalGeneration.forward": {"866de4b20c23": "5.17.0-5.22.2", "d690fe14ca43": "5.23.0",
                                                "4f5adcdebf83": "5.24.0"},
    "WhisperPositionalEmbedding.forward": {"b0e6ffcd05a2": "5.17.0-5.23.0", "58edc088160a": "5.24.0"},
    "transformers.activations:GELUActivation.forward": {"35866b531b89": "5.17.0-5.24.0"},
    "transformers.cache_utils:EncoderDecoderCache.get_seq_length": {"5c12fd181ee0": "5.17.0-5.24.0"},
})

def _source(module: str, name: str) -> str:
    return name if ":" in name else f"{module}:{name}"  # a source outside the modeling module is named in full


def _family_row(family, module, sources, present="5.17-5.24") -> Shortcut:
    return Shortcut(
        f"piecewise forward ({family})",
        tuple(dict.fromkeys((*_COMMON, *(_source(module, name) for name in sources)))),  # each source once
        {**_COMMON, **{_source(module, name): digests for name, digests in sources.items()}},
        "piecewise", present=present,
        why="the eager decode forward of a dynamic cache is hundreds of launches behind Python: its shape-fixed "
            "pieces are replayed from CUDA graphs of the same kernels, the cache append and attention run eagerly",
    )


PIECEWISE_SHORTCUTS = (*(_family_row(*row) for row in _FAMILIES), _family_row(*_OPT, present="5.18-5.24"),
                       _family_row(*_WHISPER), _family_row(*_T5), _family_row(*_MT5),
                       *(_family_row(*row) for row in BART_ROWS))

PIECEWISE_SHORTCUTS += (
    Shortcut(
        "dynamic decode loop (sliding layers)", tuple(_SLIDING_UNDO), _SLIDING_UNDO,
        "dynamic_loop.eligibility.plan_loop", present="5.17-5.24",
        why="a sliding-window layer's extra decode step may drop its oldest position, which no crop gives back: the "
            "loop keeps the layers' attributes from before each step (no tensor copied) and puts them back",
    ),
)

# the shared sources alone (the masks a replay's host answers rely on, the cache updates it runs): what a family
# proven per recording needs as read (`graphs/piecewise/eligibility.why_not_model`), a hand-read family whose own
# sources drifted on a newer release included
PIECEWISE_SHORTCUTS += (
    Shortcut(
        "piecewise shared sources", tuple(_COMMON), dict(_COMMON), "piecewise", present="5.17-5.24",
        why="the mask and cache-update code every family's replay relies on, read once for all of them",
    ),
)

# transformers' generic code that every family's forward runs, read for the families proven per recording
# (`graphs/piecewise/auto/proof.py`); the rest of the generic code they run (config attribute reads, the output
# dataclasses, the deprecation wrappers) passes the mechanical rules (`auto/rules.py`). `capture_outputs`' wrapper
# reads the registry of what a model class can capture, keyed per class and filled at init; it installs hooks and
# collects only where an `output_*` flag (a keyword, or a config field, which the staleness check compares) asks for
# them, and a hook makes the forward eager (`eligibility.why_observed`). 5.17 and 5.23 differ from 5.18-5.22 only in
# the hidden-states branch (a selection by index, the config's `tie_last_hidden_states`). The output types'
# registration reads the set of types already registered with torch's pytree and adds the type once: idempotent
_GENERIC = {
    "transformers.utils.output_capturing:capture_outputs": {
        "0f38b9af778f": "5.17.0", "3e5d6a8ffc32": "5.18.0-5.22.2", "380c3364ecee": "5.23.0-5.24.0"},
    "transformers.utils.generic:_register_model_output_pytree_node": {"80182d357439": "5.17.0-5.24.0"},
}
PIECEWISE_SHORTCUTS += (
    Shortcut(
        "piecewise generic machinery (found families)", tuple(_GENERIC), _GENERIC, "piecewise.proof.verdict",
        present="5.17-5.24",
        why="the generic code every family's forward runs, read once for the families proven per recording",
    ),
)

# transformers' decoder layers derive from `GradientCheckpointingLayer`, whose own `__call__` (5.17-5.22; from 5.23
# it has none) runs `super().__call__` unless gradient checkpointing is on in training mode (the path needs eval mode
# and no gradient): read for the default-deny check of every family (`piecewise/proven.py`, `HELPER_SHORTCUTS`)
_LAYER_CALL = "transformers.modeling_layers:GradientCheckpointingLayer.__call__"
PIECEWISE_SHORTCUTS += (
    Shortcut(
        "piecewise layer call (gradient checkpointing)", (_LAYER_CALL,),
        {_LAYER_CALL: {"986f4aa53484": "5.17.0-5.22.2"}},
        "piecewise.proof.default_deny", present="5.17-5.22",
        why="a decoder layer's call passes through to the module's own call outside gradient checkpointing",
    ),
)

# Phi-3's own `prepare_inputs_for_generation`, which the dynamic-cache loop (whose decode forward this path replaces)
# calls at every step instead of making the inputs itself (`dynamic_loop/eligibility._OWN_INPUTS`). Read for what
# the loop relies on: it returns the generic preparation's inputs, except at the step where the sequence first
# reaches `original_max_position_embeddings` + 1 with a cache no longer than that: there it drops the cache (the
# generic preparation then gives the whole sequence from 5.20 on, the last token alone before) and the forward fills a
# new cache, which `_update_model_kwargs_for_generation` takes from the outputs, as in stock. 5.20 adds
# `kwargs["next_sequence_length"] = None`; 5.24 renames the cache `cache`.
# The preparation is the same back to 4.x: the loop's `_sample` (the dynamic decode loop's digests) pins the releases.
_PHI3_INPUTS = "transformers.models.phi3.modeling_phi3:Phi3ForCausalLM.prepare_inputs_for_generation"
_SAMPLE = "transformers.generation.utils:GenerationMixin._sample"
PIECEWISE_SHORTCUTS += (
    Shortcut(
        "dynamic decode loop (phi3 inputs)", (_SAMPLE, _PHI3_INPUTS),
        {_SAMPLE: {"61160ef8c121": "5.17.0-5.23.0", "9e153ccbcefb": "5.24.0"},
         _PHI3_INPUTS: {"28dba0791656": "5.17.0-5.19.0", "ca5a947f41e7": "5.20.2-5.23.0", "0fc3c62aa7ef": "5.24.0"}},
        "dynamic_loop.eligibility.own_inputs_read", present="5.17-5.24",
        why="Phi-3 prepares its own inputs (its rope switch may drop the cache): the dynamic-cache loop, and so the "
            "piecewise forward, take it with that preparation called at every step",
    ),
)
