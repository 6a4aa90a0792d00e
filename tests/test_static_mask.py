"""With the flag, a static cache's decode-step mask comes from a per-call plan (5.17+): the same tensor as stock's
`create_masks_for_generate`, step by step, and the same generate() output.

Every decode-step mask the plan returns is compared, inside the run, with what stock transformers' own
`create_masks_for_generate` returns for the same arguments: values, dtype, shape, strides.
"""

from __future__ import annotations

import unittest

import pytest
from unittest import mock

import torch
import transformers.generation.utils as gen_utils
from parameterized import parameterized

from models import PAD, TRANSFORMERS_VERSION, assert_same, build, eos_ids_finishing_at, prompt, stock
from transformers_async_stop import patching
from transformers_async_stop.sync_free import static_mask
from transformers_async_stop.loops.static_loop.eligibility import STATIC_LOOP_ENV

PLAN_RELEASES = TRANSFORMERS_VERSION >= (5, 17)


def _same_mask(test, ours, ref):
    if ref is None or ours is None:
        test.assertIs(ours, ref)
        return
    if isinstance(ref, dict):
        test.assertIsInstance(ours, dict)
        test.assertEqual(list(ours), list(ref))
        for key in ref:
            _same_mask(test, ours[key], ref[key])
        return
    test.assertEqual((ours.dtype, ours.shape, ours.stride()), (ref.dtype, ref.shape, ref.stride()))
    test.assertTrue(torch.equal(ours, ref), "the plan's mask differs from stock's")


# the plan builds every decode step's mask on the deferred path; the static-cache loop (tests/test_static_loop.py)
# asks it for the first decode step only and advances that mask in place
@mock.patch.dict("os.environ", {STATIC_LOOP_ENV: "0"})
class StaticDecodeMaskEqualsStock(unittest.TestCase):
    @parameterized.expand([(family, padded) for family in ("llama", "qwen2", "mistral") for padded in (False, True)])
    @pytest.mark.core
    def test_each_step_mask_and_the_output_equal_stock(self, family, padded):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=padded)
        kw = dict(attention_mask=mask, max_new_tokens=9, pad_token_id=PAD, cache_implementation="static",
                  eos_token_id=eos_ids_finishing_at(model, ids, mask, [3, 5, 6]), return_dict_in_generate=True,
                  output_scores=True)
        original = patching.original("generation.utils.create_masks_for_generate")
        patched = gen_utils.create_masks_for_generate
        planned = []

        def checked(*args, **kwargs):
            result = patched(*args, **kwargs)
            reference = original(*args, **kwargs)
            _same_mask(self, result, reference)
            return result

        real_mask = static_mask.MaskPlan.mask

        def counted(plan, *args):
            result = real_mask(plan, *args)
            planned.append(result is not None)
            return result

        with stock():
            ref = model.generate(ids, **kw)
        with mock.patch.object(gen_utils, "create_masks_for_generate", checked), \
                mock.patch.object(static_mask.MaskPlan, "mask", counted):
            out = model.generate(ids, async_stopping_criteria=True, **kw)
        assert_same(self, ref, out)
        if PLAN_RELEASES:
            # every decode step (one extra, undone, after an EOS stop) took the plan
            self.assertGreaterEqual(len(planned), out.sequences.shape[1] - ids.shape[1] - 1)
            self.assertTrue(all(planned))
        else:
            self.assertEqual(planned, [])  # the sources differ from the ones the plan was read against

    def test_no_plan_without_the_flag_or_outside_a_call(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        with mock.patch.object(static_mask, "register", wraps=static_mask.register) as register:
            model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD,
                           cache_implementation="static")
        register.assert_not_called()
        model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, cache_implementation="static",
                       async_stopping_criteria=True)
        self.assertEqual(len(static_mask._PLANS), 0, "a plan outlived its generate() call")


if __name__ == "__main__":
    unittest.main()
