"""The sources behind the graphed decoder forward of BART and its modular copies (mBART, Marian, Pegasus, Blenderbot,
BlenderbotSmall), 5.17.0-5.24.0.

Read on each of 5.17.0, 5.18.0, 5.19.0, 5.20.2, 5.21.1, 5.22.2, 5.23.0 and 5.24.0, for a decode step of the
conditional-generation class handed `decoder_input_ids` (one token), `encoder_outputs` (a `BaseModelOutput`: the
encoder does not run), the encoder's `attention_mask` or None, a plain `EncoderDecoderCache` whose every layer's
cross-attention is written (`is_updated`), no labels, and, in a recording, the 4D sentinel as `decoder_attention_mask`:
- `<Family>ForConditionalGeneration.forward` (`MarianMTModel`'s): `labels` None (the loss branch); the LM head on the
  decoder's last hidden state, plus `final_logits_bias` (a buffer, compared before each replay); the output carries the
  encoder's outputs as given (a replay's too, `recording.Recording.output`);
- `<Family>Model.forward`: `decoder_input_ids` given (no `shift_tokens_right`); `encoder_outputs` given, a
  `BaseModelOutput`: the encoder does not run; the decoder gets `encoder_outputs[0]` (its `last_hidden_state`) and the
  encoder's `attention_mask` as `encoder_attention_mask`;
- `<Family>Decoder.forward`: ids given (the embedding, Marian's `embed_scale` product, in piece 0); a cache given.
  `cache_length = cache.get_seq_length()` (`EncoderDecoderCache.get_seq_length`: the self-attention cache's) is a host
  read of the length, baked into a recording. It feeds (a) `position_ids = arange(seq_length) + cache_length`, which
  stock hands to `embed_positions(..., cache_length, position_ids=position_ids)`: the recording hands that call the
  positions buffer instead (`recorder._Recorder.positions`, checked to be called once, with a tensor of the buffer's
  shape, dtype and device), which every replay fills with stock's own value from the same host length; the tensor the
  decoder made is left unread; (b) the mask of ones made when `attention_mask` is None, a branch no recording takes
  (the sentinel is given); (c) the embedding's `cache_length` argument, read only without `position_ids`. So no
  output depends on the baked value. `create_causal_mask` returns the 4D sentinel as it is (each replay's mask is the
  package's, from the step's, as for every family). `create_bidirectional_mask(config, inputs_embeds,
  attention_mask=encoder_attention_mask, encoder_hidden_states=...)`: intercepted at the recording (its keywords kept
  with markers for the step's encoder mask and states, `masks.recorded_cross_kwargs`) and called again by each replay,
  stock's function looked up in the module, with the step's own: stock's cross-attention mask at every step (with a
  2D encoder mask its SDPA skip check reads the device, as stock's does). mBART, Pegasus and Blenderbot end with a
  `layer_norm`; BlenderbotSmall normalises the word embeddings before adding the positions;
  the layerdrop branch runs only in training (eager);
- `<Family>LearnedPositionalEmbedding.forward` (BART, mBART) with `position_ids`: `embedding(position_ids + offset)`
  (mBART's after `unsqueeze(0)`), the offset (2) a plain attribute; Blenderbot's and BlenderbotSmall's:
  `embedding(position_ids)`; `<Family>SinusoidalPositionalEmbedding.forward`
  (Marian, Pegasus): `embedding(position_ids)`. Of shape (n, d) or (1, n, d), added to the (batch, n, d) embeddings:
  the same two values per element. A position past the table indexes past it as in stock (the controller reads each
  verdict before a forward past it: `undo/position_table.py`);
- `<Family>ScaledWordEmbedding.forward` (BART, mBART, Blenderbot): the embedding times `embed_scale`, an attribute
  (Marian and BlenderbotSmall multiply torch's embedding by their decoder's `embed_scale` in the decoder);
- `<Family>DecoderLayer.forward`: the self-attention, then the cross-attention block (`encoder_hidden_states is not
  None`: given at every step), the MLP (`ACT2FN[config.activation_function]`: GELU read here; torch's ReLU and SiLU,
  Pegasus' and Marian's released configs', are on default-deny's torch list; another activation's class keeps the
  forward eager), dropouts with `training=self.training`, pre-norm (mBART, Pegasus, Blenderbot) or post-norm (BART,
  Marian, BlenderbotSmall) by class;
- `<Family>Attention.forward`: q scaled inside the attention (`scaling=self.scaling`, a float); the self-attention
  reads `is_updated` and updates the `self_attention_cache` (run eagerly at each replay); the cross-attention, with
  `is_updated` True, takes `cross_attention_cache.layers[layer].keys/values` with no op and no update (each replay
  reads the step's own cache's; the recording checks by identity that the attention got them, and its mask is the
  cross mask call's). 5.24 passes `kwargs=kwargs` to `cache.update` (`recorder._plain_update`).
5.18 drops a docstring line of the generation class's forward; 5.23 changes annotations and the layerdrop condition
(`and self.layerdrop > 0.0`); 5.24 renames the cache `cache` (and the embeddings' `past_key_values_length`
`cache_length`).
"""

_SHARED = {
    "BartAttention.forward": {"251b295eabb0": "5.17.0-5.23.0", "25ea23538911": "5.24.0"},
    "transformers.activations:GELUActivation.forward": {"35866b531b89": "5.17.0-5.24.0"},
    "transformers.cache_utils:EncoderDecoderCache.get_seq_length": {"5c12fd181ee0": "5.17.0-5.24.0"},
}
_LEARNED = {"b73ef13c1d9c": "5.17.0-5.23.0", "ac36eea0ac7a": "5.24.0"}
_LEARNED_NO_OFFSET = {"9040f687c04d": "5.17.0-5.23.0", "442b00a86fe0": "5.24.0"}  # Blenderbot's, BlenderbotSmall's
_SINUSOIDAL = {"059b1f4eb19a": "5.17.0-5.23.0", "d369b3721c95": "5.24.0"}
_SCALED = {"fde2a0ebfb79": "5.17.0-5.24.0"}
_POST_NORM_LAYER = {"9d4370956dc4": "5.17.0-5.23.0", "8620d211a757": "5.24.0"}  # BART's, Marian's
_PRE_NORM_LAYER = {"90532af1a113": "5.17.0-5.22.2", "6ae62ede3a4f": "5.23.0", "323a07c5e504": "5.24.0"}  # mBART's


def _row(name, prefix, generation, digests):
    """(family, modeling module, {source: digests}) in `piecewise_rows._family_row`'s form; `digests` per source
    kind: attention, layer, decoder, model, generation class, position table (its class), word embedding or None."""
    attention, layer, decoder, model, head, (table, table_digests), embedding = digests
    sources = {f"{prefix}Attention.forward": attention, f"{prefix}DecoderLayer.forward": layer,
               f"{prefix}Decoder.forward": decoder, f"{prefix}Model.forward": model, f"{generation}.forward": head,
               f"{table}.forward": table_digests}
    if embedding is not None:
        sources[f"{prefix}ScaledWordEmbedding.forward"] = embedding
    for source, shared in _SHARED.items():
        if ":" in source:
            sources[source] = shared
    return name, f"transformers.models.{name}.modeling_{name}", sources


_ATTENTION = _SHARED["BartAttention.forward"]
BART_ROWS = (
    _row("bart", "Bart", "BartForConditionalGeneration", (
        _ATTENTION, _POST_NORM_LAYER,
        {"74a77f91b6d2": "5.17.0-5.22.2", "9d4146c4df11": "5.23.0", "2d1002535438": "5.24.0"},
        {"1ff3225883d3": "5.17.0-5.22.2", "6a63b5dfe6a5": "5.23.0", "5998f9343ca4": "5.24.0"},
        {"9a542ff239f7": "5.17.0", "34099a0c04d5": "5.18.0-5.22.2", "c28a2c6c0e96": "5.23.0",
         "faf3c729aa14": "5.24.0"},
        ("BartLearnedPositionalEmbedding", _LEARNED), _SCALED)),
    _row("mbart", "MBart", "MBartForConditionalGeneration", (
        _ATTENTION, _PRE_NORM_LAYER,
        {"d7cdf0a8a2c2": "5.17.0-5.22.2", "db5ca75d74c4": "5.23.0", "5f592000987e": "5.24.0"},
        {"81c7f847ea3b": "5.17.0-5.22.2", "e08af94f73f2": "5.23.0", "3705dbef4666": "5.24.0"},
        {"4565c4936a97": "5.17.0", "2c7a220103bf": "5.18.0-5.22.2", "636ca8e3f65e": "5.23.0",
         "9f2fc37475bf": "5.24.0"},
        ("MBartLearnedPositionalEmbedding", _LEARNED), _SCALED)),
    _row("marian", "Marian", "MarianMTModel", (
        _ATTENTION, _POST_NORM_LAYER,
        {"1f8416a6ae7b": "5.17.0-5.22.2", "f6d52290e6c1": "5.23.0", "02314318999d": "5.24.0"},
        {"7a3fad2dceb1": "5.17.0-5.22.2", "c6894f849123": "5.23.0", "9f010958be44": "5.24.0"},
        {"51df619ba92b": "5.17.0", "5b1437e18451": "5.18.0-5.22.2", "4f5842da4bc0": "5.23.0",
         "7c1291cb0cb9": "5.24.0"},
        ("MarianSinusoidalPositionalEmbedding", _SINUSOIDAL), None)),
    _row("blenderbot", "Blenderbot", "BlenderbotForConditionalGeneration", (
        _ATTENTION, _PRE_NORM_LAYER,
        {"41a33e03dfe8": "5.17.0-5.22.2", "95f7e345355e": "5.23.0", "00068bd505a6": "5.24.0"},
        {"74e341f8f583": "5.17.0-5.22.2", "aed021652e8e": "5.23.0", "c82cd3c53eda": "5.24.0"},
        {"aaaf19bd3c06": "5.17.0", "ab229a405aec": "5.18.0-5.22.2", "e4426a505612": "5.23.0",
         "f99333c77a33": "5.24.0"},
        ("BlenderbotLearnedPositionalEmbedding", _LEARNED_NO_OFFSET), _SCALED)),
    _row("blenderbot_small", "BlenderbotSmall", "BlenderbotSmallForConditionalGeneration", (
        _ATTENTION, _POST_NORM_LAYER,
        {"9369aa1d2186": "5.17.0-5.22.2", "16e09a0f7545": "5.23.0", "a564b4c40bb4": "5.24.0"},
        {"7dc7275193a2": "5.17.0-5.22.2", "20967a8a31b0": "5.23.0", "85e3f1e3a718": "5.24.0"},
        {"f158bfdc161a": "5.17.0", "bf50b6e5799a": "5.18.0-5.22.2", "899ecb89d113": "5.23.0",
         "b0b7f2f537e5": "5.24.0"},
        ("BlenderbotSmallLearnedPositionalEmbedding", _LEARNED_NO_OFFSET), None)),
    _row("pegasus", "Pegasus", "PegasusForConditionalGeneration", (
        _ATTENTION, _PRE_NORM_LAYER,
        {"bd09e0096f40": "5.17.0-5.22.2", "ac02a7d4e982": "5.23.0", "9376916165a6": "5.24.0"},
        {"52ca70a7b965": "5.17.0-5.22.2", "66a9cc2df490": "5.23.0", "dc2ac9ea6d49": "5.24.0"},
        {"905603329ec1": "5.17.0-5.22.2", "ed40a213517e": "5.23.0", "3dc8cc23a488": "5.24.0"},
        ("PegasusSinusoidalPositionalEmbedding", _SINUSOIDAL), None)),
)
