"""The recorded scores and logits alias as in stock (issue 25, item 8): with no processor, or processors that hand
their input back, stock's `out.scores[i]` IS `out.logits[i]` (one tensor), so an in-place edit of one (by a criterion
during the call, or by the caller afterwards) shows in the other; where a processor made a new tensor they are two.
Compared with unpatched stock, object identity included, on the dynamic-cache loop and transformers' own loop."""

from __future__ import annotations

import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from models import PAD, assert_same, build, prompt, stock
from transformers_async_stop.loops.dynamic_loop import eligibility

LOOPS = {"dynamic_loop": {}, "own_loop": {eligibility.DYNAMIC_LOOP_ENV: "0"}}


class HandBack(LogitsProcessor):
    """Edits the scores in place and returns the same tensor."""

    def __call__(self, input_ids, scores):
        scores[:, 3] += 1.0
        return scores


class EditLastScores(StoppingCriteria):
    """Never stops; adds to the last recorded scores in place (the same tensor as the last logits where they alias)."""

    def __call__(self, input_ids, scores, **kwargs):
        if scores:
            scores[-1][:, 5] -= 2.0
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


CASES = {
    "no_processor": dict(),
    "processor_handing_back": dict(logits_processor=lambda: LogitsProcessorList([HandBack()])),
    "min_new_tokens": dict(min_new_tokens=3),
    "sampling": dict(do_sample=True, top_k=6),
}


def _run(model, ids, mask, case, flag, edit):
    kw = {k: (v() if callable(v) else v) for k, v in CASES[case].items()}
    if edit:
        kw["stopping_criteria"] = StoppingCriteriaList([EditLastScores()])
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD, eos_token_id=None,
                         return_dict_in_generate=True, output_scores=True, output_logits=True, **kw,
                         **({} if flag is None else dict(async_stopping_criteria=flag)))
    aliased = [s is l for s, l in zip(out.scores, out.logits)]
    out.scores[0][:, 7] = 42.0  # the caller edits one record afterwards: it shows in the other where they alias
    return out.scores, out.logits, aliased


class ScoresAliasAsInStock(unittest.TestCase):
    @parameterized.expand([(loop, case, edit) for loop in LOOPS for case in CASES for edit in (False, True)])
    @pytest.mark.core
    def test_scores_and_logits_alias_as_in_stock(self, loop, case, edit):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)
        with stock():
            ref = _run(model, ids, mask, case, None, edit)
        with mock.patch.dict(os.environ, LOOPS[loop]):
            on = _run(model, ids, mask, case, True, edit)
        self.assertEqual(ref[2], on[2], "which steps' scores are their logits")
        assert_same(self, ref[:2], on[:2])


if __name__ == "__main__":
    unittest.main()


class KeepIds(StoppingCriteria):
    """Never stops; keeps every `input_ids` it is handed, without a copy."""

    def __init__(self):
        self.kept = []

    def __call__(self, input_ids, scores, **kwargs):
        self.kept.append(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ReturnedSequencesAreTheCriteriaIds(unittest.TestCase):
    """Stock returns its last `input_ids` itself: a criterion that kept the ids of the last step holds the very
    returned `sequences` (the usage fuzzer's NEW-1: seeds 67, 166, 174, ...; the static loop returned a copy)."""

    @parameterized.expand([(c, d, n) for c in (None, "static") for d in (False, True) for n in (1, 5)])
    def test_kept_ids_are_the_returned_sequences(self, cache, return_dict, new_tokens):
        ids, mask = prompt(batch=2)

        def run(flag):
            model = build("llama")
            keep = KeepIds()
            kw = {"async_stopping_criteria": True} if flag else {}
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=PAD, cache_implementation=cache,
                                 return_dict_in_generate=return_dict, stopping_criteria=StoppingCriteriaList([keep]),
                                 **kw)
            sequences = out.sequences if return_dict else out
            return sequences, [k is sequences for k in keep.kept], [k.tolist() for k in keep.kept]

        with stock():
            plain = run(False)
        fast = run(True)
        self.assertTrue(torch.equal(plain[0], fast[0]))
        self.assertEqual(plain[1], fast[1], "which kept tensors are the returned sequences")
        self.assertEqual(plain[2], fast[2])
