"""A stopping criterion that runs its own forward into the user's `StaticCache` (or resets and refills it) leaves the
call, its returned cache and the cache's later use as stock leaves them (issue 31).

A `StaticLayer` writes where its counter says, and the criterion's forward moves that counter past the 2D mask's
width. Stock builds each step's mask from that counter and the 2D mask padded with zeros past its width: the position
the criterion wrote is then left out of every later step's attention. The static-cache loop advanced its own mask
assuming ones past the prompt, so its later steps attended to that position: other keys and values in the cache
(and other tokens when sampling). Run on the static-cache loop (eager tail on the CPU, and under the emulation of
CUDA graphs), greedy and sampling, left-padded or not, against unpatched stock.
"""

from __future__ import annotations

import unittest

import pytest

import torch
from parameterized import parameterized
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList

import transformers_async_stop
from models import PAD, assert_same, build, stock
from transformers_async_stop.testing.emulation import emulated

# heavy: the whole of it runs on 5.17.0 and 5.24.0 in CI (noxfile `SLOW_ON`), the rest of the releases skip it
pytestmark = pytest.mark.slow

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 13, 14]])


class ForwardsIntoTheCache(StoppingCriteria):
    """At call `at`, runs the model on the cache itself: `forward` feeds the last token (the cache's counter moves
    one past the mask), `refill` resets the cache and feeds the whole sequence, `reset` only resets it. Stops every
    row from call `stop_at` on."""

    def __init__(self, model, cache, what, at, stop_at):
        self.model, self.cache, self.what, self.at, self.stop_at, self.calls = model, cache, what, at, stop_at, 0

    def __call__(self, input_ids, scores, **kwargs):
        if self.calls == self.at:
            if self.what in ("refill", "reset"):
                self.cache.reset()
            if self.what == "forward":
                self.model(input_ids[:, -1:], past_key_values=self.cache, use_cache=True)
            elif self.what == "refill":
                self.model(input_ids, past_key_values=self.cache, use_cache=True)
        done = self.calls >= self.stop_at
        self.calls += 1
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def run(model, what, at, stop_at, sampling, left_pad, flag):
    mask = torch.ones_like(PROMPT)
    if left_pad:
        mask[1, :2] = 0
    cache = StaticCache(config=model.config, max_cache_len=32)
    torch.manual_seed(11)
    out = model.generate(PROMPT, attention_mask=mask, max_new_tokens=6, do_sample=sampling, eos_token_id=None,
                         pad_token_id=PAD, past_key_values=cache, return_dict_in_generate=True, output_scores=True,
                         stopping_criteria=StoppingCriteriaList([ForwardsIntoTheCache(model, cache, what, at,
                                                                                      stop_at)]),
                         **({"async_stopping_criteria": True} if flag else {}))
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    after = torch.rand(3)
    later = model(torch.tensor([[3], [4]]), past_key_values=cache).logits  # the returned cache's next use
    return out.sequences, out.scores, kept, int(cache.get_seq_length()), after, later


CASES = [(f"{what}_at{at}_stop{stop}_{'sample' if s else 'greedy'}{'_leftpad' if lp else ''}", what, at, stop, s, lp)
         for what in ("forward", "refill", "reset") for at, stop in ((1, 3), (0, 2), (1, 1))
         for s in (False, True) for lp in (False, True)]


class CriterionForwardIntoStaticCache(unittest.TestCase):
    def _compare(self, what, at, stop_at, sampling, left_pad, graphed):
        model = build("llama")
        with stock():
            ref = run(model, what, at, stop_at, sampling, left_pad, flag=False)
        if graphed:
            with emulated():
                on = run(model, what, at, stop_at, sampling, left_pad, flag=True)
        else:
            on = run(model, what, at, stop_at, sampling, left_pad, flag=True)
        self.assertEqual(transformers_async_stop.last_path().path, "static loop")
        assert_same(self, ref, on)

    @parameterized.expand(CASES)
    def test_the_call_and_its_returned_cache_are_stocks(self, _, what, at, stop_at, sampling, left_pad):
        self._compare(what, at, stop_at, sampling, left_pad, graphed=False)

    @parameterized.expand([c for c in CASES if c[1] == "forward"])
    def test_the_same_under_emulated_graphs(self, _, what, at, stop_at, sampling, left_pad):
        self._compare(what, at, stop_at, sampling, left_pad, graphed=True)


if __name__ == "__main__":
    unittest.main()
