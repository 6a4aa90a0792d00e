"""Encoder-decoder models (T5- and BART-shaped): the decoder loop is deferred, and everything equals stock.

Upstream's `DeferredStopCheck.finish` failed here (an `EncoderDecoderCache` has no `.layers`); the plug-in reaches
the decoder's own cache through `self_attention_cache`.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DynamicCache,
    EncoderDecoderCache,
    T5Config,
    T5ForConditionalGeneration,
)

from models import VOCAB, CountForwards, assert_same, prompt, stock

PAD, START = 0, 0


def build(family: str, attn: str = "eager"):
    torch.manual_seed(0)
    if family == "t5":
        config = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                          decoder_start_token_id=START, pad_token_id=PAD, eos_token_id=1, initializer_factor=4.0)
        cls = T5ForConditionalGeneration
    else:
        config = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=PAD,
                            bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                            init_std=0.5, max_position_embeddings=64)
        cls = BartForConditionalGeneration
    config._attn_implementation = attn
    return cls(config).eval()


def _decoder_eos(model, ids, mask, step):
    """Token ids the stock greedy decoder emits first at `step` in some row (so rows stop at different steps)."""
    with stock():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    rows = out[:, 1:].tolist()
    chosen = []
    for row in rows:
        firsts = [t for k, t in enumerate(row) if t not in row[:k] and t != PAD]
        if firsts:
            chosen.append(firsts[min(step, len(firsts) - 1)])
    return list(dict.fromkeys(chosen))


class EncoderDecoderMatchesStock(unittest.TestCase):
    @parameterized.expand([(f, s) for f in ("t5", "bart") for s in ("greedy", "sampling")])
    def test_outputs_cache_and_rng_match_stock(self, family, decode):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=False)
        kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=_decoder_eos(model, ids, mask, 3),
                  pad_token_id=PAD, do_sample=decode == "sampling", return_dict_in_generate=True,
                  output_scores=True, output_logits=True, output_attentions=True, output_hidden_states=True)

        def run(flag):
            counter = CountForwards(model)
            torch.manual_seed(11)
            extra = {} if flag is None else {"async_stopping_criteria": flag}
            out = model.generate(ids, **kw, **extra)
            counter.close()
            return out, counter.count, torch.rand(3)

        with stock():
            ref, ref_forwards, ref_after = run(None)
        on, forwards, after = run(True)
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_after, after))
        stopped_early = ref.sequences.shape[1] < 1 + 12
        self.assertEqual(forwards - ref_forwards, 1 if stopped_early else 0)
        if decode == "greedy":
            self.assertTrue(stopped_early, "the reference run must stop early")

    def test_user_encoder_decoder_cache_is_rolled_back(self):
        model = build("t5")
        ids, mask = prompt(batch=2)
        eos = _decoder_eos(model, ids, mask, 2)

        def run(flag):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            extra = {} if flag is None else {"async_stopping_criteria": flag}
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD,
                                 past_key_values=cache, **extra)
            return out, cache

        with stock():
            ref, ref_cache = run(None)
        on, on_cache = run(True)
        self.assertListEqual(ref.tolist(), on.tolist())
        self.assertLess(ref.shape[1], 1 + 10, "the reference run must stop early")
        assert_same(self, ref_cache, on_cache, "user EncoderDecoderCache")


if __name__ == "__main__":
    unittest.main()
