"""The sources behind T5's and mT5's graphed decoder forward ("piecewise forward (t5)", "(mt5)"): rows of
`piecewise_rows.py`, kept here for that file's length. Each is (family, modeling module, {source: {digest: releases}}).
"""

# T5's decoder (T5ForConditionalGeneration), 5.17.0-5.24.0 (read on each of 5.17.0, 5.18.0, 5.19.0, 5.20.2, 5.21.1,
# 5.22.2, 5.23.0, 5.24.0; 5.17-5.23 the same but for annotations and docstrings). What each decision in Python depends
# on, for a decode step handed `decoder_input_ids`, `encoder_outputs` (a `BaseModelOutput`), a plain
# `EncoderDecoderCache` whose every layer's cross-attention is written (`is_updated`), no labels, no encoder
# `attention_mask` (generate() makes none for an encoder-decoder; a step given one stays eager) and no decoder mask
# (the recording's is the 4D sentinel); it takes no positions:
# - `T5ForConditionalGeneration.forward`: `encoder_outputs` given, a `BaseModelOutput` (the encoder does not run),
#   `labels` None (no shift, no loss), `scale_decoder_outputs` (a config branch), `lm_head`; the output carries the
#   encoder's outputs as given (a replay's too, `recording.Recording.output`). 5.23 changes annotations;
# - `T5Stack.forward` (the decoder, `is_decoder`): ids given (`embed_tokens`, in piece 0), a cache given (no new
#   one); `create_causal_mask` returns the 4D sentinel as it is (each replay's mask is the package's, from the
#   step's: None, SDPA's own path for one query); `create_bidirectional_mask(..., attention_mask=None,
#   encoder_hidden_states=...)` with no cache: `_preprocess_mask_arguments` takes the encoder's length as kv_length,
#   `sdpa_mask` (`allow_is_bidirectional_skip`, no padding mask: `_ignore_bidirectional_mask_sdpa` True without a
#   device read) returns None, baked into the recording as stock computes it at every step under SDPA without a mask
#   (the layer index it reads from no cache is 0: `find_first_full_attention_index` from 5.23, the `is_sliding` test
#   before); the position biases handed from layer to layer (below); dropouts identities in eval;
# - `T5Block.forward`: the self-attention sublayer, the cross-attention one (`encoder_hidden_states` given at every
#   step), the FF one; the fp16 clamps are device ops (`torch.where` on a 0-d tensor, `torch.clamp` with tensor
#   bounds: no host read) under a dtype branch (the key's dtype);
# - `T5Attention.forward`: `past_seen_tokens = cache.get_seq_length(layer_idx)` is a host read of the self-attention
#   cache's length before the update (`EncoderDecoderCache.get_seq_length`), used only by `compute_bias`; the
#   self-attention updates `self_attention_cache` (run eagerly at each replay); layer 0 (`has_relative_attention_bias`)
#   then calls `self.compute_bias(1, key_length, device=..., past_seen_tokens=past_seen_tokens)` with the grown
#   length: a growing shape, so a recording runs it eagerly and checks its arguments are these host values, and every
#   replay calls the class's method again with the step's (`attention.Cut.bias`); the stack hands its result to every
#   later layer's self-attention as `position_bias` (checked by identity). The cross-attention (`is_updated` True: no
#   op, no update) reads the cross-attention cache layer's keys and values (each replay the step's own cache's); in
#   layer 0 its `position_bias` is `torch.zeros((1, n_heads, 1, encoder_length))` made inside the piece (the encoder's
#   length is part of the recording's key), handed to every later cross-attention (checked by identity, held by the
#   recording). The attention gets `scaling=1.0`, `dropout=0.0` outside training, `position_bias=`; 5.24 renames the
#   cache `cache` and passes `kwargs=kwargs` to `cache.update`;
# - `T5LayerNorm.forward` (a weight-dtype branch), `T5LayerFF.forward`, `T5DenseActDense.forward` /
#   `T5DenseGatedActDense.forward` (`is_gated_act`, fixed at init; `wo` kept in fp32 by `_keep_in_fp32_modules`: a
#   dtype branch), `ACT2FN[config.dense_act_fn]`: torch's ReLU (T5) or `NewGELUActivation` ("gelu_new": T5 v1.1,
#   Flan-T5), read; another activation's class is not, and default-deny keeps it eager;
# - `compute_bias` itself runs eagerly at each replay (stock's code, whatever it computes), digested for the
#   arguments a replay hands it (query length, key length, device, `past_seen_tokens`)
T5 = ("t5", "transformers.models.t5.modeling_t5", {
    "T5Attention.forward": {"ba160432565f": "5.17.0-5.23.0", "e8b34f4b98ef": "5.24.0"},
    "T5Attention.compute_bias": {"e29454d4bb45": "5.17.0-5.24.0"},
    "T5LayerSelfAttention.forward": {"16a3cc961bb7": "5.17.0-5.23.0", "08d1ae99bb1a": "5.24.0"},
    "T5LayerCrossAttention.forward": {"bf4e97219c63": "5.17.0-5.23.0", "87b9add8f52f": "5.24.0"},
    "T5Block.forward": {"663b9362d737": "5.17.0-5.23.0", "4a2868f51430": "5.24.0"},
    "T5Stack.forward": {"cf7dbec8f0f0": "5.17.0-5.23.0", "daf68a2b4ec7": "5.24.0"},
    "T5ForConditionalGeneration.forward": {"3bae6d87547c": "5.17.0-5.22.2", "a062b3b66cf2": "5.23.0",
                                           "e97a5521b8f2": "5.24.0"},
    "T5LayerFF.forward": {"af8ceeb3e8f5": "5.17.0-5.24.0"},
    "T5DenseActDense.forward": {"a05abaeef58a": "5.17.0-5.24.0"},
    "T5DenseGatedActDense.forward": {"2e665a92d5d4": "5.17.0-5.24.0"},
    "T5LayerNorm.forward": {"34dcae840cd4": "5.17.0-5.24.0"},
    "transformers.activations:NewGELUActivation.forward": {"23d0bb14245b": "5.17.0-5.24.0"},
    "transformers.masking_utils:create_bidirectional_mask": {"2f3cd7a79b93": "5.17.0-5.19.0",
                                                            "28df122ed8ef": "5.20.2-5.22.2",
                                                            "64e79524d7d8": "5.23.0", "0f1d1f22bb0f": "5.24.0"},
    "transformers.masking_utils:_ignore_bidirectional_mask_sdpa": {"a0fdba5caabb": "5.17.0",
                                                                  "5d5f81caad7d": "5.18.0-5.24.0"},
    "transformers.cache_utils:EncoderDecoderCache.get_seq_length": {"5c12fd181ee0": "5.17.0-5.24.0"},
    "transformers.cache_utils:Cache.get_seq_length": {"f0db0f879ef6": "5.17.0-5.22.2", "744955eaa379": "5.23.0-5.24.0"},
    "transformers.cache_utils:DynamicLayer.get_seq_length": {"a134511137c7": "5.17.0-5.24.0"},
    # the loop's own `_sample` pins the releases (T5's sources above are older than the dynamic-cache loop)
    "transformers.generation.utils:GenerationMixin._sample": {"61160ef8c121": "5.17.0-5.23.0", "9e153ccbcefb": "5.24.0"},
})

# mT5 (MT5ForConditionalGeneration), 5.17.0-5.24.0: T5's code under its own class names, digest for digest, but for
# its layer norm (its docstring's comment names MT5) and its conditional-generation forward (no `scale_decoder_outputs`
# branch: the logits are `lm_head` of the decoder's output); read as T5's above, on the same releases
MT5 = ("mt5", "transformers.models.mt5.modeling_mt5", {
    "MT5Attention.forward": {"ba160432565f": "5.17.0-5.23.0", "e8b34f4b98ef": "5.24.0"},
    "MT5Attention.compute_bias": {"e29454d4bb45": "5.17.0-5.24.0"},
    "MT5LayerSelfAttention.forward": {"16a3cc961bb7": "5.17.0-5.23.0", "08d1ae99bb1a": "5.24.0"},
    "MT5LayerCrossAttention.forward": {"bf4e97219c63": "5.17.0-5.23.0", "87b9add8f52f": "5.24.0"},
    "MT5Block.forward": {"663b9362d737": "5.17.0-5.23.0", "4a2868f51430": "5.24.0"},
    "MT5Stack.forward": {"cf7dbec8f0f0": "5.17.0-5.23.0", "daf68a2b4ec7": "5.24.0"},
    "MT5ForConditionalGeneration.forward": {"b2feef85e342": "5.17.0-5.22.2", "d15cc61084be": "5.23.0",
                                            "a5427953b4e5": "5.24.0"},
    "MT5LayerFF.forward": {"af8ceeb3e8f5": "5.17.0-5.24.0"},
    "MT5DenseActDense.forward": {"a05abaeef58a": "5.17.0-5.24.0"},
    "MT5DenseGatedActDense.forward": {"2e665a92d5d4": "5.17.0-5.24.0"},
    "MT5LayerNorm.forward": {"d0a7b2f2cc1c": "5.17.0-5.24.0"},
    # the sources outside the modeling module, as T5's
    **{name: digests for name, digests in T5[2].items() if ":" in name},
})
