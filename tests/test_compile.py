"""Importing the package changes no compiled graph: every wrapper that can run inside a model's forward goes to the
original under torch.compile before it touches any Python state.

CPU, every CI release. Two checks, each against stock transformers (the package unpatched):
- `torch._dynamo.explain` of a prefill forward (left-padded mask) and of a decode-step forward (a filled
  DynamicCache, the grown mask) reports as many graph breaks with the package applied as without it;
- `generate()` with the model's forward compiled `fullgraph=True` (a graph break raises), a static cache and a
  left-padded batch returns stock's output, flag off and flag on.
"""

from __future__ import annotations

import unittest

import pytest
import torch
import torch._dynamo
from parameterized import parameterized
from transformers import DynamicCache

from models import PAD, assert_same, build, prompt, stock
from test_encoder_decoder import build as build_encoder_decoder


def _explain(fn, **inputs) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(**inputs).graph_break_count


def _forward_inputs(model, encoder_decoder: bool):
    ids, mask = prompt(batch=3, left_pad=True)
    if encoder_decoder:
        decoder_ids = torch.zeros((ids.shape[0], 2), dtype=torch.long)
        return [dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)]
    prefill = dict(input_ids=ids, attention_mask=mask)
    # a decode step: the cache a prefill filled, the next token, the mask grown by one column of ones
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), stock():
        model(**prefill, past_key_values=cache)
    grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    decode = dict(input_ids=ids[:, -1:], attention_mask=grown, past_key_values=cache)
    return [prefill, decode]


class NoGraphBreaksFromImport(unittest.TestCase):
    # `core` (every minor release) takes one family: `explain` costs 5-15 s per family on CI's 2 cores, half of the
    # core subset's time; the full suites run the other families (below)
    @parameterized.expand([("llama",)])
    @pytest.mark.core
    def test_explain_counts_the_same_graph_breaks_as_stock(self, family):
        self._same_graph_breaks(family)

    @parameterized.expand([("gpt2",), ("qwen2",), ("mistral",), ("bart",)])
    def test_explain_counts_the_same_graph_breaks_as_stock_in_more_families(self, family):
        self._same_graph_breaks(family)

    def _same_graph_breaks(self, family):
        encoder_decoder = family in ("t5", "bart")
        model = build_encoder_decoder(family, attn="sdpa") if encoder_decoder else build(family)
        for inputs in _forward_inputs(model, encoder_decoder):
            with torch.no_grad():
                with stock():
                    expected = _explain(model, **inputs)
                patched = _explain(model, **inputs)
            self.assertEqual(patched, expected, f"graph breaks with the package applied ({sorted(inputs)})")

    @parameterized.expand([("llama",), ("mistral",)])
    def test_generate_with_a_fullgraph_compiled_forward_equals_stock(self, family):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        kw = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=PAD, cache_implementation="static",
                  disable_compile=True, return_dict_in_generate=True, output_scores=True)
        eager_forward = model.forward
        model.forward = torch.compile(eager_forward, fullgraph=True, backend="eager")
        try:
            with stock():
                torch._dynamo.reset()
                ref = model.generate(ids, **kw)
            torch._dynamo.reset()
            for flag in (False, True):
                assert_same(self, ref, model.generate(ids, async_stopping_criteria=flag, **kw), f"flag {flag}")
        finally:
            model.forward = eager_forward
            torch._dynamo.reset()


if __name__ == "__main__":
    unittest.main()
