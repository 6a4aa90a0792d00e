"""Settings that stock reads at every step are read at every step with the flag too (issue 16, item 7).

A stopping criterion (or another processor) may change a processor's settings mid-call: stock honours the change at
the next step. The flag's per-call shortcuts must not freeze them: here a criterion raises a user
`MinNewTokensLengthLogitsProcessor`'s minimum (and swaps its EOS ids) after a few steps. Compared with unpatched stock
on the dynamic cache (deferred path) and the static cache (the package's own loop on 5.17+).
"""

from __future__ import annotations

import unittest

import pytest
import torch
from parameterized import parameterized
from transformers import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    StoppingCriteriaList,
)

from loop_callbacks import ChangeAtStep
from models import PAD, PROMPT_LEN, assert_same, build, eos_ids_finishing_at, prompt, stock

CACHES = ("dynamic", "static")


def _run(model, ids, mask, eos, change, processor, cache, sampling, flag):
    criterion = ChangeAtStep(3, lambda: change(processor))
    kw = dict(max_new_tokens=12, pad_token_id=PAD, eos_token_id=eos, return_dict_in_generate=True,
              output_scores=True, logits_processor=LogitsProcessorList([processor]),
              stopping_criteria=StoppingCriteriaList([criterion]), do_sample=sampling)
    if cache == "static":
        kw["cache_implementation"] = "static"
    if flag:
        kw["async_stopping_criteria"] = True
    torch.manual_seed(7)
    out = model.generate(ids, attention_mask=mask, **kw)
    return out, torch.rand(4)


def _raise_minimum(processor):
    if isinstance(processor, MinLengthLogitsProcessor):
        processor.min_length += 8
    else:
        processor.min_new_tokens += 8


def _swap_eos(processor):
    processor.eos_token_id = torch.tensor([PAD + 3, PAD + 4])


class LiveSettingsEqualStock(unittest.TestCase):
    def _check(self, cache, sampling, kind, change):
        model = build("llama")
        ids, mask = prompt(batch=2)
        eos = eos_ids_finishing_at(model, ids, mask, [4, 5])

        def processor():
            eos_tensor = torch.tensor(eos)
            if kind == "min_length":
                return MinLengthLogitsProcessor(PROMPT_LEN + 2, eos_tensor)
            return MinNewTokensLengthLogitsProcessor(PROMPT_LEN, 2, eos_tensor)

        with stock():
            ref = _run(model, ids, mask, eos, change, processor(), cache, sampling, flag=False)
        on = _run(model, ids, mask, eos, change, processor(), cache, sampling, flag=True)
        assert_same(self, ref[0].sequences, on[0].sequences, "sequences")
        assert_same(self, ref[0].scores, on[0].scores, "scores")
        self.assertTrue(torch.equal(ref[1], on[1]), "RNG state after generate() differs")

    @parameterized.expand([(cache,) for cache in CACHES])
    @pytest.mark.core
    def test_a_minimum_raised_mid_call_is_honoured_as_in_stock(self, cache):
        self._check(cache, False, "min_new_tokens", _raise_minimum)

    @parameterized.expand([(cache, sampling, kind, change.__name__)
                           for cache in CACHES for sampling in (False, True)
                           for kind in ("min_new_tokens", "min_length")
                           for change in (_raise_minimum, _swap_eos)])
    def test_minimum_length_settings_changed_mid_call_are_honoured_as_in_stock(self, cache, sampling, kind,
                                                                                change_name):
        self._check(cache, sampling, kind, {"_raise_minimum": _raise_minimum, "_swap_eos": _swap_eos}[change_name])


if __name__ == "__main__":
    unittest.main()
