"""The encoder-decoder cases (opt-in): `whisper-small`, a Whisper-small-shaped speech model, `bart-base`, a
BART-base-shaped summariser, and `t5-base`, a T5-base-shaped one.

Whisper-small's shape (12 encoder and 12 decoder layers, width 768, 12 heads, 80 mel bins, 30 s of audio: 3000
frames, a 51865-token vocabulary), bf16 on CUDA, random weights from a config (no download), transcribing one clip
in English (its generation config's language and task tokens, no timestamps), greedy b1 with the default cache (an
`EncoderDecoderCache` of two `DynamicCache`s: the decoder runs on the dynamic-cache loop with the flag, 5.17+). Every
variant generates its whole budget (`min_new_tokens`, as every case). On the CPU the model is a tiny Whisper of the
same kind (the LoRA case does the same), so that the case runs there too and is checked against stock.
"""

from __future__ import annotations

import torch
from transformers import (BartConfig, BartForConditionalGeneration, GenerationConfig, T5Config,
                          T5ForConditionalGeneration, WhisperConfig, WhisperForConditionalGeneration)

from .cases import Case

# Whisper's special tokens (multilingual vocabulary of 51865): end of text (also the pad token), start of
# transcript, English, translate, transcribe, no timestamps
_EOT, _SOT, _EN, _TRANSLATE, _TRANSCRIBE, _NO_TIMESTAMPS = 50257, 50258, 50259, 50358, 50359, 50363
_SMALL = dict(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
              decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, num_mel_bins=80,
              max_source_positions=1500, max_target_positions=448)
# the CPU's stand-in: two layers each, width 64, 30 frames (`max_source_positions` 15), the same vocabulary
_TINY = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=15,
             max_target_positions=448)


def whisper_config(tiny: bool = False) -> WhisperConfig:
    return WhisperConfig(vocab_size=51865, pad_token_id=_EOT, bos_token_id=_EOT, eos_token_id=_EOT,
                         decoder_start_token_id=_SOT, begin_suppress_tokens=None, suppress_tokens=None,
                         **(_TINY if tiny else _SMALL))


def whisper_generation_config() -> GenerationConfig:
    """What a multilingual Whisper checkpoint's generation config holds for short-form transcription (its long list
    of suppressed tokens left out: a processor of stock's, the same in every variant), and one generate() call per
    clip (`force_unique_generate_call`): random weights emit timestamp tokens after <|notimestamps|>, from which
    Whisper's `generate` would seek into the clip again and again, each seek a new call of `max_new_tokens`."""
    return GenerationConfig(
        decoder_start_token_id=_SOT, eos_token_id=_EOT, pad_token_id=_EOT, bos_token_id=_EOT, max_length=448,
        lang_to_id={"<|en|>": _EN}, task_to_id={"translate": _TRANSLATE, "transcribe": _TRANSCRIBE},
        no_timestamps_token_id=_NO_TIMESTAMPS, is_multilingual=True, begin_suppress_tokens=[220, _EOT],
        suppress_tokens=[], language="<|en|>", task="transcribe", force_unique_generate_call=True)


def build_whisper(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Whisper-small-shaped on CUDA, the tiny Whisper elsewhere."""
    torch.manual_seed(0)
    with torch.device(device):  # built on the device: initialising on the CPU first is slower than the benchmark
        model = WhisperForConditionalGeneration(whisper_config(tiny=device.type != "cuda")).to(dtype)
    model.generation_config = whisper_generation_config()
    return model.eval()


def whisper_inputs(run, model, device: torch.device) -> dict:
    """One log-mel clip per row of the batch: as many frames as the encoder takes (3000, 30 s, for Whisper-small),
    in the model's dtype."""
    config = model.config
    frames = 2 * config.max_source_positions  # the encoder's two convolutions halve them
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(run.batch, config.num_mel_bins, frames, generator=gen)
    return {"input_features": features.to(device=device, dtype=model.dtype)}


# BART-base's shape (6 encoder and 6 decoder layers, width 768, 12 heads, a 50265-token vocabulary, 1024 positions);
# the CPU's stand-in: two layers each, width 64
_BART_BASE = dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
_BART_TINY = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=128, decoder_ffn_dim=128)


def bart_config(tiny: bool = False) -> BartConfig:
    return BartConfig(vocab_size=50265, max_position_embeddings=1024, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                      decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None,
                      **(_BART_TINY if tiny else _BART_BASE))


def build_bart(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """BART-base-shaped on CUDA (random weights from a config), the tiny BART elsewhere. Its encoder gets the prompt
    of token ids and the tokenizer's mask of ones (`cases.make_inputs`), as a summarisation call does: the decoder
    makes its cross-attention mask from that mask at every step."""
    torch.manual_seed(0)
    with torch.device(device):
        model = BartForConditionalGeneration(bart_config(tiny=device.type != "cuda")).to(dtype)
    model.generation_config = GenerationConfig(decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                                               bos_token_id=0)
    return model.eval()


# T5-base's shape (12 + 12 blocks, width 768, 12 heads of 64, a feed-forward of 3072, a 32128-token vocabulary); the
# CPU's stand-in: two blocks each, width 64
_T5_BASE = dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12)
_T5_TINY = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2)


def t5_config(tiny: bool = False) -> T5Config:
    return T5Config(vocab_size=32128, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                    **(_T5_TINY if tiny else _T5_BASE))


def build_t5(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """T5-base-shaped on CUDA (random weights from a config), the tiny T5 elsewhere; its encoder gets the prompt and
    the tokenizer's mask of ones, as `build_bart`'s."""
    torch.manual_seed(0)
    with torch.device(device):
        model = T5ForConditionalGeneration(t5_config(tiny=device.type != "cuda")).to(dtype)
    model.generation_config = GenerationConfig(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    return model.eval()


def encoder_decoder_cases() -> dict[str, Case]:
    return {
        "whisper-small": Case(
            "whisper-small", build_whisper, (1,), 64, 0, "bf16", pad_token_id=_EOT, plan=(("eager", "greedy"),),
            opt_in=True, inputs=whisper_inputs,
            about="a Whisper-small-shaped speech model (12+12 layers, width 768), bf16, transcribing one 30 s clip, "
                  "greedy b1, EncoderDecoderCache (tiny on CPU)"),
        "bart-base": Case(
            "bart-base", build_bart, (1,), 64, 128, "bf16", pad_token_id=1, plan=(("eager", "greedy"),), opt_in=True,
            about="a BART-base-shaped summariser (6+6 layers, width 768), bf16, a 128-token source with its mask of "
                  "ones, greedy b1, EncoderDecoderCache (tiny on CPU)"),
        "t5-base": Case(
            "t5-base", build_t5, (1,), 64, 128, "bf16", pad_token_id=0, plan=(("eager", "greedy"),), opt_in=True,
            about="a T5-base-shaped model (12+12 blocks, width 768), bf16, a 128-token source with its mask of ones, "
                  "greedy b1, EncoderDecoderCache (tiny on CPU)"),
    }
