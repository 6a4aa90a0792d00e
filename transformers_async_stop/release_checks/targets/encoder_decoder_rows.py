"""The sources behind encoder-decoder calls on the dynamic-cache loop (`loops/dynamic_loop/encoder_decoder.py`), one
row per family taken.

The loop itself is the one "dynamic decode loop" pins (`_sample`, `prepare_inputs_for_generation` and
`_update_model_kwargs_for_generation`: their encoder-decoder branches were read with the rest). What it relies on of
each family's own code is read here:
- the attention's forward writes the cross-attention cache only where the `EncoderDecoderCache`'s `is_updated` is not
  set for its layer (the prefill's forward sets it): a decode step, the undone extra one included, writes one position
  of the self-attention cache and nothing else, so that cache's crop undoes it
  (`cache_rollback.rollback_one_step`);
- the decoder's forward, handed an `EncoderDecoderCache`, keeps it (a new cache is made only where it gets none, or
  Whisper's a bare `DynamicCache`), and the model returns it: the cache the loop keeps in its inputs stays the one
  stock's `_update_model_kwargs_for_generation` would take from the outputs at every step;
- Whisper's own `prepare_inputs_for_generation`: where `decoder_attention_mask` is None (short-form generation, and
  long-form without conditioning on previous tokens: Whisper's `generate` pops it) it calls the generic preparation
  with the same arguments; with a decoder mask it makes `decoder_position_ids` from it, and the loop then calls it at
  every step. 5.24 renames the cache `cache` (the keyword deprecation decorator: transformers' own code).
BART, mBART, Marian, Pegasus, Blenderbot and BlenderbotSmall share one attention source (copies); each has its own
decoder (Blenderbot's and BlenderbotSmall's read in 5.17.0-5.24.0 on 2026-11-29, session 4). mT5 is T5's code under
its own names (its attention and stack sources are T5's, digest for digest). Read in 5.17.0, 5.23.0
and 5.24.0; digested there and in the CI's release installs of 5.18.0, 5.19.0, 5.20.2, 5.21.1 and 5.22.2
(noxfile.py `releases`): 5.23 changes the decoders' annotations and layerdrop condition, 5.24 renames the cache.
"""

from .shortcuts import SHORTCUTS as _BASE_ROWS
from .shortcuts import Shortcut

# the loop these rows extend: `_sample` of "dynamic decode loop", whose digests hold on 5.17.0-5.24.0 only. The
# families' own sources are older (BART's attention and decoder are 5.9's already, Marian's and Pegasus' 5.5's, T5's
# 5.15's, Whisper's 5.16's) and match on releases the loop does not run on: each row holds the loop's `_sample` too, so
# that it says what it claims, "present" where the loop is (the drift test's "matches outside the releases it claims"
# on 5.5.4-5.16.1)
_LOOP_SAMPLE = "transformers.generation.utils:GenerationMixin._sample"
_LOOP_SAMPLE_DIGESTS = next(row for row in _BASE_ROWS if row.name == "dynamic decode loop").digests[_LOOP_SAMPLE]

_SHARED_ATTENTION = {"251b295eabb0": "5.17.0-5.23.0", "25ea23538911": "5.24.0"}

# family: (modeling module, the conditional-generation class taken, {source: {digest: releases}})
FAMILIES = {
    "bart": ("transformers.models.bart.modeling_bart", "BartForConditionalGeneration", {
        "BartAttention.forward": _SHARED_ATTENTION,
        "BartDecoder.forward": {"74a77f91b6d2": "5.17.0-5.22.2", "9d4146c4df11": "5.23.0", "2d1002535438": "5.24.0"},
    }),
    "mbart": ("transformers.models.mbart.modeling_mbart", "MBartForConditionalGeneration", {
        "MBartAttention.forward": _SHARED_ATTENTION,
        "MBartDecoder.forward": {"d7cdf0a8a2c2": "5.17.0-5.22.2", "db5ca75d74c4": "5.23.0", "5f592000987e": "5.24.0"},
    }),
    "marian": ("transformers.models.marian.modeling_marian", "MarianMTModel", {
        "MarianAttention.forward": _SHARED_ATTENTION,
        "MarianDecoder.forward": {"1f8416a6ae7b": "5.17.0-5.22.2", "f6d52290e6c1": "5.23.0", "02314318999d": "5.24.0"},
    }),
    "pegasus": ("transformers.models.pegasus.modeling_pegasus", "PegasusForConditionalGeneration", {
        "PegasusAttention.forward": _SHARED_ATTENTION,
        "PegasusDecoder.forward": {"bd09e0096f40": "5.17.0-5.22.2", "ac02a7d4e982": "5.23.0", "9376916165a6": "5.24.0"},
    }),
    "blenderbot": ("transformers.models.blenderbot.modeling_blenderbot", "BlenderbotForConditionalGeneration", {
        "BlenderbotAttention.forward": _SHARED_ATTENTION,
        "BlenderbotDecoder.forward": {"41a33e03dfe8": "5.17.0-5.22.2", "95f7e345355e": "5.23.0",
                                      "00068bd505a6": "5.24.0"},
    }),
    "blenderbot_small": ("transformers.models.blenderbot_small.modeling_blenderbot_small",
                         "BlenderbotSmallForConditionalGeneration", {
                             "BlenderbotSmallAttention.forward": _SHARED_ATTENTION,
                             "BlenderbotSmallDecoder.forward": {"9369aa1d2186": "5.17.0-5.22.2", "16e09a0f7545": "5.23.0",
                                                                "a564b4c40bb4": "5.24.0"},
                         }),
    "t5": ("transformers.models.t5.modeling_t5", "T5ForConditionalGeneration", {
        "T5Attention.forward": {"ba160432565f": "5.17.0-5.23.0", "e8b34f4b98ef": "5.24.0"},
        "T5Stack.forward": {"cf7dbec8f0f0": "5.17.0-5.23.0", "daf68a2b4ec7": "5.24.0"},
    }),
    # mT5: T5's code under its own names (a copy: the same sources, digest for digest)
    "mt5": ("transformers.models.mt5.modeling_mt5", "MT5ForConditionalGeneration", {
        "MT5Attention.forward": {"ba160432565f": "5.17.0-5.23.0", "e8b34f4b98ef": "5.24.0"},
        "MT5Stack.forward": {"cf7dbec8f0f0": "5.17.0-5.23.0", "daf68a2b4ec7": "5.24.0"},
    }),
    "whisper": ("transformers.models.whisper.modeling_whisper", "WhisperForConditionalGeneration", {
        "WhisperAttention.forward": {"589f084030ea": "5.17.0-5.23.0", "80d8edd51b83": "5.24.0"},
        "WhisperDecoder.forward": {"804a90056871": "5.17.0-5.22.2", "6caac02ae421": "5.23.0", "71c2affcde70": "5.24.0"},
        "WhisperForConditionalGeneration.prepare_inputs_for_generation": {
            "ef4ab143b3a3": "5.17.0-5.23.0", "d5e4d3de216c": "5.24.0"},
    }),
}


def row_name(family: str) -> str:
    return f"dynamic decode loop ({family} encoder-decoder)"


ENCODER_DECODER_SHORTCUTS = tuple(
    Shortcut(
        row_name(family), (_LOOP_SAMPLE, *(f"{module}:{name}" for name in sources)),
        {_LOOP_SAMPLE: _LOOP_SAMPLE_DIGESTS, **{f"{module}:{name}": digests for name, digests in sources.items()}},
        "dynamic_loop.encoder_decoder.family_of", present="5.17-5.24",
        why="an encoder-decoder's decoder steps through the dynamic-cache loop: each step's inputs made from the "
            "previous step's, the extra step undone in the self-attention cache alone",
    )
    for family, (module, _, sources) in FAMILIES.items()
)
