"""generate() under `torch.inference_mode()` and `torch.no_grad()`, and with a prompt made inside inference mode then
used outside it (issue 25, item 1): the flag returns stock's output in every autograd context.

Inference tensors do not track a version counter: any read of `tensor._version` on one raises. The minimum-length
processors' EOS mask (`step_lists._EosMask`) read it, so every loop raised as soon as `min_length` or
`min_new_tokens` was set. Compared with unpatched stock, greedy, sampling and beam search, dynamic cache (the
package's dynamic-cache loop on 5.17+, transformers' own loop with the deferred stop check otherwise).
"""

from __future__ import annotations

import contextlib
import unittest

import pytest
import torch
from parameterized import parameterized
from transformers import DynamicCache

from models import PAD, assert_same, build, eos_ids_finishing_at, prompt, stock

CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "prompt_from_inference_mode": contextlib.nullcontext,  # the prompt is made inside inference mode, used outside
}
METHODS = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=8, temperature=0.9),
    "beam_search": dict(do_sample=False, num_beams=2),
}
MINIMA = ("min_new_tokens", "min_length")


def _prompt(context):
    if context == "prompt_from_inference_mode":
        with torch.inference_mode():
            ids, mask = prompt(batch=2, left_pad=True)
            return ids.clone(), mask.clone()  # inference tensors
    return prompt(batch=2, left_pad=True)


class AutogradContextsEqualStock(unittest.TestCase):
    def _check(self, context, method, minimum, user_cache=False):
        model = build("llama")
        ids, mask = _prompt(context)
        eos = eos_ids_finishing_at(model, ids.clone(), mask.clone(), [2, 5])
        kw = dict(max_new_tokens=9, pad_token_id=PAD, eos_token_id=eos, return_dict_in_generate=True,
                  output_scores=True, **METHODS[method])
        kw[minimum] = 4 if minimum == "min_new_tokens" else ids.shape[1] + 4

        def run(flag):
            torch.manual_seed(0)
            cache = dict(past_key_values=DynamicCache(config=model.config)) if user_cache else {}
            with CONTEXTS[context]():
                out = model.generate(ids, attention_mask=mask, **kw, **cache,
                                     **({} if flag is None else dict(async_stopping_criteria=flag)))
            return out.sequences, out.scores, torch.rand(3)

        with stock():
            ref = run(None)
        on = run(True)
        assert_same(self, ref, on)

    @parameterized.expand([(c, m, n) for c in CONTEXTS for m in METHODS for n in MINIMA])
    @pytest.mark.core
    def test_a_minimum_length_in_every_autograd_context_equals_stock(self, context, method, minimum):
        self._check(context, method, minimum)

    @parameterized.expand([(c,) for c in CONTEXTS])
    def test_a_minimum_length_on_a_user_dynamic_cache_equals_stock(self, context):
        self._check(context, "greedy", "min_new_tokens", user_cache=True)

    @parameterized.expand([(c,) for c in CONTEXTS])
    def test_eos_ids_edited_in_place_inside_the_minimum_are_honoured(self, context):
        """The EOS mask follows an in-place edit of the processor's EOS tensor, as stock (which rebuilds it every
        step) does, also where the tensor is an inference tensor that has no version counter."""
        from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor, StoppingCriteriaList

        from loop_callbacks import ChangeAtStep

        model = build("llama")
        ids, mask = _prompt(context)
        eos = eos_ids_finishing_at(model, ids.clone(), mask.clone(), [2, 5])

        def run(flag):
            with CONTEXTS[context]():
                eos_tensor = torch.tensor([eos[0], eos[-1]])
                processor = MinNewTokensLengthLogitsProcessor(ids.shape[1], 6, eos_tensor)

                def edit():
                    eos_tensor[0] = (eos_tensor[0] + 1) % 48  # in place: the same tensor object

                criterion = ChangeAtStep(2, edit)
                out = model.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=PAD, eos_token_id=eos,
                                     logits_processor=LogitsProcessorList([processor]),
                                     stopping_criteria=StoppingCriteriaList([criterion]),
                                     return_dict_in_generate=True, output_scores=True,
                                     **({} if flag is None else dict(async_stopping_criteria=flag)))
            return out.sequences, out.scores

        with stock():
            ref = run(None)
        on = run(True)
        assert_same(self, ref, on)


if __name__ == "__main__":
    unittest.main()
