"""Modes the deferred loop does not cover yet run stock with one warning and identical output; CPU runs stock."""

from __future__ import annotations

import os
import unittest
import warnings
from unittest import mock

import torch

from models import PAD, CountForwards, build, eos_ids_finishing_at, prompt, stock
from transformers_async_stop import FORCE_ENV, StockPathWarning


def generate_with_warnings(model, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        out = model.generate(*args, **kwargs)
    return out, [w for w in caught if issubclass(w.category, StockPathWarning)]


class StockPathWithOneWarning(unittest.TestCase):
    def assert_stock_with_warning(self, model, mode_words, *args, **kwargs):
        with stock():
            torch.manual_seed(0)
            ref = model.generate(*args, **kwargs)
        out, caught = generate_with_warnings(model, *args, async_stopping_criteria=True, **kwargs)
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertIn(mode_words, str(caught[0].message))
        self.assertListEqual(ref.tolist(), out.tolist())

    def test_assisted_decoding_with_a_user_criterion(self):
        # assisted decoding itself is deferred (tests/test_assisted.py); a user criterion keeps it stock (phase 1)
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Never(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        model, assistant = build("llama"), build("llama", seed=5)
        ids, mask = prompt(batch=1)
        self.assert_stock_with_warning(model, "assisted decoding", ids, attention_mask=mask,
                                       assistant_model=assistant, max_new_tokens=8, pad_token_id=PAD,
                                       stopping_criteria=StoppingCriteriaList([Never()]))

    def test_prompt_lookup_with_a_forbidding_processor(self):
        model = build("llama")
        ids, mask = prompt(batch=1)
        self.assert_stock_with_warning(model, "prompt lookup", ids, attention_mask=mask, no_repeat_ngram_size=3,
                                       prompt_lookup_num_tokens=2, max_new_tokens=8, pad_token_id=PAD)

class OtherDevices(unittest.TestCase):
    def test_cpu_without_force_runs_stock_silently(self):
        model = build("llama")
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [1, 2, 2])
        with mock.patch.dict(os.environ, {FORCE_ENV: "0"}):
            counter = CountForwards(model)
            out, caught = generate_with_warnings(model, ids, attention_mask=mask, max_new_tokens=10,
                                                 eos_token_id=eos, pad_token_id=PAD, async_stopping_criteria=True)
            counter.close()
        with stock():
            counter = CountForwards(model)
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD)
            counter_ref = counter.count
            counter.close()
        self.assertEqual(caught, [])
        self.assertListEqual(ref.tolist(), out.tolist())
        self.assertEqual(counter.count, counter_ref)  # no lag on CPU: nothing to gain there


class Failures(unittest.TestCase):
    def test_a_raising_criterion_propagates_and_the_next_call_works(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Boom(StoppingCriteria):
            def __init__(self):
                self.calls = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    raise RuntimeError("boom")
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        model = build("llama")
        ids, mask = prompt()
        with self.assertRaisesRegex(RuntimeError, "boom"):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD,
                           stopping_criteria=StoppingCriteriaList([Boom()]), async_stopping_criteria=True)
        from transformers_async_stop.state.call_state import CALL

        self.assertIsNone(CALL.get())  # the call's state went with it
        with stock():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD,
                             async_stopping_criteria=True)
        self.assertListEqual(ref.tolist(), out.tolist())


if __name__ == "__main__":
    unittest.main()


class UserCriteriaThatReadTheDevice(unittest.TestCase):
    def test_a_criterion_returning_a_python_bool_is_exact_and_named_in_one_warning(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        class LegacyLengthCheck(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return bool(input_ids.shape[1] >= 10)

        model = build("llama")
        ids, mask = prompt()
        kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=PAD,
                  stopping_criteria=StoppingCriteriaList([LegacyLengthCheck()]))
        with stock():
            ref = model.generate(ids, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, async_stopping_criteria=True, **kw)
        named = [w for w in caught if "LegacyLengthCheck" in str(w.message)]
        self.assertEqual(len(named), 1)
        self.assertListEqual(ref.tolist(), out.tolist())


class BeamSearchWithStaticCache(unittest.TestCase):
    """Flag off: the static cache's reorder no longer reads its device counter, with the same results as stock."""

    def test_reorder_without_the_length_read_matches_stock(self):
        from models import assert_same

        model = build("llama")
        ids, mask = prompt()
        kw = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=7, pad_token_id=PAD,
                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
        with stock():
            ref = model.generate(ids, **kw)
        out = model.generate(ids, **kw)
        for name in ("sequences", "sequences_scores", "scores", "beam_indices", "past_key_values"):
            assert_same(self, getattr(ref, name), getattr(out, name), name)
