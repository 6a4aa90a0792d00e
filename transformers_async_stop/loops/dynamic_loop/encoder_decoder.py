"""Encoder-decoder calls on the dynamic-cache loop (flag on, 5.17-5.24): which ones it takes, and what differs.

Stock's `_sample` (5.17.0-5.24.0, the "dynamic decode loop" sources) runs an encoder-decoder's decoder as it runs a
decoder-only model, except (their `is_encoder_decoder` branches):
- `prepare_inputs_for_generation` hands the ids to the forward as `decoder_input_ids`, passes the decoder's own mask
  and positions as `decoder_attention_mask` / `decoder_position_ids` (where generate() was given them: it makes
  neither for an encoder-decoder), and the encoder's `attention_mask` and `encoder_outputs` as the very objects
  `model_kwargs` holds, at every step;
- `_update_model_kwargs_for_generation(..., is_encoder_decoder=True)` grows the decoder's mask and positions (the
  encoder's mask never changes);
- the result is a `GenerateEncoderDecoderOutput`, whose `encoder_attentions` / `encoder_hidden_states` are read from
  `encoder_outputs` only where attentions / hidden states are asked for (where the loop is not taken), and whose
  `cross_attentions` is None likewise.

The loop takes the conditional-generation classes of the families in `targets/encoder_decoder_rows.py` (BART, mBART,
Marian, Pegasus, Blenderbot, BlenderbotSmall, T5, mT5, Whisper), exactly those classes (a subclass may run other
code), with a plain `EncoderDecoderCache` of two plain `DynamicCache`s of full-attention `DynamicLayer`s, on a release whose family
sources are the ones read: their cross-attention is written at the prefill only, their decoder keeps the cache it is
handed. So the extra step's forward writes one position of the self-attention cache and nothing else, and its undo is
that cache's crop (`cache_rollback.rollback_one_step` reaches it through `self_attention_cache`), as on the deferred
path (docs/paths.md, "encoder-decoder"). Every other encoder-decoder call keeps the deferred path of `generation.py`.
"""

from __future__ import annotations

import sys

from ...release_checks.targets.encoder_decoder_rows import FAMILIES, row_name
from ...release_checks.verified import matches


def family_of(model) -> str | None:
    """The family of `FAMILIES` whose class `model` is (exactly), where its sources are the ones read; else None."""
    kind = type(model)
    for family, (module, name, _) in FAMILIES.items():
        if kind is getattr(sys.modules.get(module), name, None):
            return family if matches(row_name(family)) else None
    return None


def why_not_cache(cache) -> str | None:
    """None where `cache` is an `EncoderDecoderCache` of two plain `DynamicCache`s whose layers (made so far: an empty
    cache makes them lazily) are full-attention `DynamicLayer`s; else why not."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

    if type(cache) is not EncoderDecoderCache:
        return "not a plain EncoderDecoderCache"
    for inner in (cache.self_attention_cache, cache.cross_attention_cache):
        if type(inner) is not DynamicCache or getattr(inner, "is_compileable", False):
            return "its caches are not plain DynamicCaches"
        if any(type(layer) is not DynamicLayer for layer in getattr(inner, "layers", ()) or ()):
            return "a layer other than a full-attention DynamicLayer"
    return None


def own_prepare_read(model) -> bool:
    """The model's class keeps Whisper's own `prepare_inputs_for_generation` (read in its row) and that one's
    `super()` is the generic preparation (nothing between the two in the class's order)."""
    from transformers.generation.utils import GenerationMixin

    module, name, _ = FAMILIES["whisper"]
    whisper = getattr(sys.modules.get(module), name, None)
    kind = type(model)
    if whisper is None or kind is not whisper or kind.prepare_inputs_for_generation is not vars(whisper).get(
            "prepare_inputs_for_generation"):
        return False
    return getattr(super(whisper, model).prepare_inputs_for_generation, "__func__", None) is \
        GenerationMixin.prepare_inputs_for_generation


def prepares_generically(model, model_kwargs: dict) -> bool:
    """Whether the model's `prepare_inputs_for_generation`, called with `model_kwargs`, is the generic one: the
    generic one itself, or Whisper's (read) without a decoder mask, which then calls it with the same arguments.
    Whisper's with a decoder mask makes `decoder_position_ids` from that mask: the loop calls it at every step."""
    from transformers.generation.utils import GenerationMixin

    if type(model).prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation:
        return True
    return own_prepare_read(model) and model_kwargs.get("decoder_attention_mask") is None


def output(sequences, scores, raw_logits, cache):
    """Stock's return of an encoder-decoder call where attentions and hidden states were not asked for."""
    from transformers.generation.utils import GenerateEncoderDecoderOutput

    from ...release_checks import cache_kwarg

    return GenerateEncoderDecoderOutput(
        sequences=sequences, scores=scores, logits=raw_logits, encoder_attentions=None, encoder_hidden_states=None,
        decoder_attentions=None, cross_attentions=None, decoder_hidden_states=None, **cache_kwarg.output_field(cache))
