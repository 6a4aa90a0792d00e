"""Stopping criteria that do what stock allows but the one-step-late loops did not expect (issue 25, items 3 and 6):

- a criterion returning shape `(batch, 1)` (`input_ids[:, -1:] == token`, a common slip): stock broadcasts it
  against its `(batch,)` seed, so `unfinished_sequences` becomes `(batch, batch)` and the call stops when that is all
  zeros (or raises at the next `torch.cat` where finished rows get the pad token); the flag must do the same;
- a criterion that edits `input_ids[:, -1]` in place: stock's next forward gets the edited token (its input
  preparation slices `input_ids` after the criteria ran), so the edit changes everything after it.

Each is run on the package's dynamic-cache loop and on transformers' own loop with the deferred stop check (the
dynamic-cache loop switched off), greedy and sampling, against unpatched stock: sequences, scores, the RNG state
after the call, or the exception. On CUDA, transformers' own loop ran the criteria on a side stream, after the next
forward had been queued on the main one: `CudaCriteriaEdits` checks the edit is fed there too.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

from models import PAD, assert_same, build, eos_ids_finishing_at, prompt, stock
from transformers_async_stop.loops.dynamic_loop import eligibility

LOOPS = {"dynamic_loop": {}, "own_loop": {eligibility.DYNAMIC_LOOP_ENV: "0"}}


class LastTokenIs(StoppingCriteria):
    """Stops a row whose last token is a multiple of `mod`, answering with shape (batch, 1)."""

    def __init__(self, mod):
        self.mod = mod

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1:] % self.mod == 0


class EditLastToken(StoppingCriteria):
    """Never stops; at each call from `start` on, rewrites the last token of every row in place (a token of its
    own choosing, made on the device from the token itself)."""

    def __init__(self, start=2):
        self.start, self.calls = start, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls >= self.start:
            input_ids[:, -1] = (input_ids[:, -1] * 7 + 3) % 45 + 3
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _run(model, ids, mask, criterion, flag, sampling, device, **kw):
    torch.manual_seed(0)
    try:
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, do_sample=sampling,
                             stopping_criteria=StoppingCriteriaList([criterion]), return_dict_in_generate=True,
                             output_scores=True, **kw, **({} if flag is None else dict(async_stopping_criteria=flag)))
        result = (out.sequences, out.scores)
    except Exception as error:  # stock's own exception must be the flag's
        result = (type(error).__name__, str(error))
    return result, torch.rand(3, device=device)


class CriteriaEditsEqualStock(unittest.TestCase):
    device = "cpu"

    def _compare(self, loop, make_criterion, sampling, model=None, ids=None, mask=None, **kw):
        if model is None:
            model = build("llama", device=self.device)
            ids, mask = prompt(batch=3, left_pad=True, device=self.device)
        with stock():
            ref = _run(model, ids, mask, make_criterion(), None, sampling, self.device, **kw)
        with mock.patch.dict(os.environ, LOOPS[loop]):
            on = _run(model, ids, mask, make_criterion(), True, sampling, self.device, **kw)
        assert_same(self, ref, on)
        return ref

    @parameterized.expand([(loop, sampling) for loop in LOOPS for sampling in (False, True)])
    @pytest.mark.core
    def test_a_batch_by_one_verdict_without_eos_stops_as_stock(self, loop, sampling):
        ref = self._compare(loop, lambda: LastTokenIs(3), sampling, max_new_tokens=16, eos_token_id=None)
        # every row hit a multiple of 3 before the last step: stock stopped on the broadcast verdict
        self.assertLess(ref[0][0].shape[1], 6 + 16)

    @parameterized.expand([(loop, sampling) for loop in LOOPS for sampling in (False, True)])
    def test_a_batch_by_one_verdict_with_eos_raises_as_stock(self, loop, sampling):
        model = build("llama", device=self.device)
        ids, mask = prompt(batch=3, left_pad=True, device=self.device)
        eos = eos_ids_finishing_at(model, ids, mask, [3, None, None])
        ref = self._compare(loop, lambda: LastTokenIs(5), sampling, max_new_tokens=10, eos_token_id=eos)
        self.assertIsInstance(ref[0][0], str, "stock raises at the step after the broadcast verdict")

    @parameterized.expand([(loop, sampling, batch) for loop in LOOPS for sampling in (False, True)
                           for batch in (1, 3)])
    def test_a_batch_by_one_verdict_that_stops_with_eos_stops_as_stock(self, loop, sampling, batch):
        # issue 31 (fuzzer seed 1620): every row stops at the first step on a (batch, 1) verdict; stock stops there,
        # and the extra step transformers' own loop ran ahead multiplied its tokens by the (batch, batch)
        # `unfinished_sequences` and raised at `torch.cat` ('got 2 and 3')
        model = build("llama", device=self.device)
        ids, mask = prompt(batch=batch, left_pad=True, device=self.device)
        ref = self._compare(loop, lambda: LastTokenIs(1), sampling, max_new_tokens=6, eos_token_id=[PAD + 1],
                            model=model, ids=ids, mask=mask)
        self.assertEqual(ref[0][0].shape[1], ids.shape[1] + 1, "stock stops after one step")

    @parameterized.expand([(loop, sampling) for loop in LOOPS for sampling in (False, True)])
    @pytest.mark.core
    def test_a_criterion_editing_the_last_token_in_place_feeds_the_edit_as_stock(self, loop, sampling):
        model = build("llama", device=self.device)
        ids, mask = prompt(batch=3, left_pad=True, device=self.device)
        eos = eos_ids_finishing_at(model, ids, mask, [4, 6, None])
        self._compare(loop, EditLastToken, sampling, max_new_tokens=10, eos_token_id=eos)


@unittest.skipUnless(torch.cuda.is_available(), "CUDA only")
class CudaCriteriaEdits(CriteriaEditsEqualStock):
    """The same on the GPU: transformers' own loop queues the next forward on the main stream while the criteria ran
    on the side stream."""

    device = "cuda"


if __name__ == "__main__":
    unittest.main()
