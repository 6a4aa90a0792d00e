"""A dynamic cache reset mid-call is left as stock leaves it when the call stops there (the usage fuzzer's seed 5120).

`cache.reset()` from a processor drops every layer's tensors (`is_initialized = False`). Where the call stops at that
step, stock's cache stays reset. The flag's extra forward initialised the layers again, and the undo's crop left them
initialised and empty (`keys` of length 0 instead of None). The step whose cache was reset is read at once: no
extra forward runs on it.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from models import PAD, build, stock

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]])


class ResetAt(LogitsProcessor):
    def __init__(self, cache, at):
        self.cache, self.at, self.step = cache, at, 0

    def __call__(self, input_ids, scores):
        if self.step == self.at:
            self.cache.reset()
        self.step += 1
        return scores


class StopAt(StoppingCriteria):
    def __init__(self, at):
        self.at, self.step = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        done = self.step >= self.at
        self.step += 1
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


def state(cache):
    return [(layer.is_initialized, None if layer.keys is None else tuple(layer.keys.shape),
             None if layer.values is None else layer.values.tolist()) for layer in cache.layers]


def run(flag, stop_at, do_sample):
    model = build("llama")
    cache = DynamicCache(config=model.config)
    extra = {"async_stopping_criteria": True} if flag else {}
    torch.manual_seed(11)
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=do_sample,
                         eos_token_id=None, pad_token_id=PAD, past_key_values=cache,
                         logits_processor=LogitsProcessorList([ResetAt(cache, 1)]),
                         stopping_criteria=StoppingCriteriaList([StopAt(stop_at)]), **extra)
    return out.tolist(), state(cache), torch.rand(2).tolist()


class CacheResetMidCallLeftAsStock(unittest.TestCase):
    @parameterized.expand([(1, False), (1, True), (2, False)])
    def test_cache_and_sequences_equal_stock(self, stop_at, do_sample):
        with stock():
            ref = run(False, stop_at, do_sample)
        self.assertEqual(ref, run(True, stop_at, do_sample))


if __name__ == "__main__":
    unittest.main()
