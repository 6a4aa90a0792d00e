"""The static cache's decode mask follows `set_attn_implementation` called mid-call (the usage fuzzer's seed 5154).

The per-call static mask plan (static_mask.py) reproduces sdpa's boolean decode mask. A processor that switches the
model to eager attention mid-call makes stock build eager's additive float mask from the next forward on; the plan
kept handing eager attention the boolean one, and the attention weights differed from stock's in the last bits.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList

from models import PAD, TRANSFORMERS_VERSION, build, stock

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]])


class SwitchAt(LogitsProcessor):
    def __init__(self, model, at, to):
        self.model, self.at, self.to, self.step = model, at, to, 0

    def __call__(self, input_ids, scores):
        if self.step == self.at:
            self.model.set_attn_implementation(self.to)
        self.step += 1
        return scores


def run(flag, to, at, do_sample):
    model = build("llama", attn="sdpa" if to == "eager" else "eager")
    extra = {"async_stopping_criteria": True} if flag else {}
    torch.manual_seed(5)
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, do_sample=do_sample,
                         eos_token_id=None, pad_token_id=PAD, cache_implementation="static", output_attentions=True,
                         output_scores=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([SwitchAt(model, at, to)]), **extra)
    return out


class StaticMaskFollowsAttnImplementation(unittest.TestCase):
    @parameterized.expand([("eager", 0, False), ("eager", 1, True), ("sdpa", 0, False)])
    def test_attentions_and_scores_equal_stock(self, to, at, do_sample):
        with stock():
            ref = run(False, to, at, do_sample)
        got = run(True, to, at, do_sample)
        self.assertTrue(torch.equal(ref.sequences, got.sequences))
        for a, b in zip(ref.scores, got.scores):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(len(ref.attentions), len(got.attentions))
        for step, (a, b) in enumerate(zip(ref.attentions, got.attentions)):
            if TRANSFORMERS_VERSION < (5, 17) and (a is None or b is None):
                # before 5.17 stock returns no attentions for a step run under sdpa; the flag must return none there too
                self.assertIs(a, b, step)
                continue
            for layer, (x, y) in enumerate(zip(a, b)):
                self.assertTrue(torch.equal(x, y), (step, layer, (x - y).abs().max()))


if __name__ == "__main__":
    unittest.main()
