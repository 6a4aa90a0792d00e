"""A criterion that changes `MaxLengthCriteria.max_length` mid-call (a dynamic token budget): stock's criterion reads
the attribute at every step, so the flag's loops must stop where stock does, raised or lowered, by a criterion after
the `MaxLengthCriteria` (generate() puts it first) or by a logits processor, before the step's criteria run."""

import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from adversarial_helpers import static_cache
from models import PAD, build, stock


class Budget(StoppingCriteria):
    """Sets the budget's `max_length` to `to` when the sequence reaches `at` tokens; never stops by itself."""

    def __init__(self, budget, at, to):
        self.budget, self.at, self.to = budget, at, to

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.at:
            self.budget.max_length = self.to
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ProcessorBudget(LogitsProcessor):
    """Sets the budget's `max_length` to `to` in the step whose criteria see `at` tokens (processors run first)."""

    def __init__(self, budget, at, to):
        self.budget, self.at, self.to = budget, at, to

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] + 1 == self.at:
            self.budget.max_length = self.to
        return scores


# (name, at, to, by a processor): prompt 6, max_length 12
CHANGES = [("raised", 9, 16, False), ("raised_by_processor", 9, 16, True), ("lowered", 9, 10, False),
           ("lowered_below_length", 9, 8, False), ("lowered_below_length_by_processor", 9, 8, True),
           ("lowered_to_length_by_processor", 9, 9, True), ("raised_at_old_limit", 12, 14, False),
           ("raised_at_old_limit_by_processor", 12, 14, True)]
MODES = ("static", "dynamic", "deferred")  # deferred: hidden states keep the call in transformers' own loop
CASES = [(f"{c[0]}_{mode}_{'sample' if s else 'greedy'}", *c[1:], mode, s)
         for c in CHANGES for mode in MODES for s in (False, True)]


class MaxLengthChangedMidCall(unittest.TestCase):
    def _run(self, model, at, to, by_processor, mode, sample, flag):
        ids = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(1))
        budget = MaxLengthCriteria(12)
        criteria = StoppingCriteriaList([budget] if by_processor else [budget, Budget(budget, at, to)])
        processors = LogitsProcessorList([ProcessorBudget(budget, at, to)] if by_processor else [])
        kw = {"past_key_values": static_cache(model, 40, 2)} if mode == "static" else {}
        torch.manual_seed(7)
        out = model.generate(ids, stopping_criteria=criteria, logits_processor=processors, max_new_tokens=6, pad_token_id=PAD, do_sample=sample,
                             return_dict_in_generate=True, output_scores=True,
                             output_hidden_states=mode == "deferred", **kw, **flag)
        return out, torch.rand(3)

    @parameterized.expand(CASES)
    def test_stops_where_stock_does(self, _, at, to, by_processor, mode, sample):
        model = build("llama")
        with stock():
            want, want_rng = self._run(model, at, to, by_processor, mode, sample, {})
        got, got_rng = self._run(model, at, to, by_processor, mode, sample, {"async_stopping_criteria": True})
        torch.testing.assert_close(got.sequences, want.sequences, rtol=0, atol=0)
        self.assertEqual(len(got.scores), len(want.scores))
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(got_rng, want_rng, rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()
