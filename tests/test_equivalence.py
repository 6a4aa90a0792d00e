"""Flag on (one-step-late path, forced on CPU) vs flag off vs stock transformers: identical outputs.

Every comparison is against stock transformers with all patches removed (`models.stock()`), not only against our
own flag-off path.
"""

from __future__ import annotations

import unittest

import pytest

import torch
from parameterized import parameterized
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from models import PAD, PROMPT_LEN, assert_same, build, eos_ids_finishing_at, generate_and_draw, prompt, stock

FAMILIES = ("llama", "gpt2", "qwen2")
FULL_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)


class StopWhenLongEnoughAsPythonBool(StoppingCriteria):
    """A legacy user criterion that returns a Python bool (a host read the user brought in)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.length


class StopOnTokenAsLong(StoppingCriteria):
    """A user criterion that returns a long tensor (stock promotes the combined verdict to long)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] == self.token).long()


class StopOnToken(StoppingCriteria):
    """A user criterion that returns a per-row bool tensor."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


_run = generate_and_draw


def _scenario(name, model, family):
    """(prompt ids, mask, generate kwargs, expect an early stop)."""
    ids, mask = prompt(batch=3, left_pad=name == "left_padding")
    kw = dict(max_new_tokens=14)
    early = name in ("eos_rows_differ", "eos_all_rows_same_step", "left_padding")
    if name in ("eos_rows_differ", "left_padding", "sampling"):
        kw["eos_token_id"] = eos_ids_finishing_at(model, ids, mask, [2, 5, 7])
    elif name == "eos_all_rows_same_step":
        ids, mask = ids[:1].repeat(3, 1), mask[:1].repeat(3, 1)
        kw["eos_token_id"] = eos_ids_finishing_at(model, ids[:1], mask[:1], [4])
    elif name == "eos_never":
        kw["eos_token_id"] = eos_ids_finishing_at(model, ids, mask, [None, None, None])
    elif name == "max_length":
        kw = dict(max_length=PROMPT_LEN + 7, eos_token_id=eos_ids_finishing_at(model, ids, mask, [None, None, None]))
    elif name == "min_new_tokens":
        kw["eos_token_id"] = eos_ids_finishing_at(model, ids, mask, [1, 2, 3])
        kw["min_new_tokens"] = 5
    elif name == "user_criterion_tensor":
        token = eos_ids_finishing_at(model, ids, mask, [3, 3, 3])[0]
        kw["stopping_criteria"] = StoppingCriteriaList([StopOnToken(token)])
        kw["eos_token_id"] = None
    elif name == "user_criterion_python_bool":
        kw["stopping_criteria"] = StoppingCriteriaList([StopWhenLongEnoughAsPythonBool(PROMPT_LEN + 5)])
    elif name == "user_criterion_long_tensor":
        token = eos_ids_finishing_at(model, ids, mask, [2, 4, 6])[0]
        kw["stopping_criteria"] = StoppingCriteriaList([StopOnTokenAsLong(token)])
        kw["eos_token_id"] = None
    if name == "sampling":
        kw.update(do_sample=True, top_k=20, temperature=1.3)
    return ids, mask, kw, early


SCENARIOS = ("eos_rows_differ", "eos_all_rows_same_step", "eos_never", "max_length", "min_new_tokens",
             "left_padding", "user_criterion_tensor", "user_criterion_python_bool", "user_criterion_long_tensor",
             "sampling")


class FlagOnEqualsStock(unittest.TestCase):
    @parameterized.expand([(f, s) for f in FAMILIES for s in SCENARIOS])
    def test_outputs_match_stock(self, family, scenario):
        model = build(family)
        ids, mask, kw, early = _scenario(scenario, model, family)
        with stock():
            ref, ref_after, ref_forwards = _run(model, ids, mask, None, **kw, **FULL_OUTPUTS)
        off, off_after, _ = _run(model, ids, mask, False, **kw, **FULL_OUTPUTS)
        on, on_after, on_forwards = _run(model, ids, mask, True, **kw, **FULL_OUTPUTS)
        assert_same(self, ref, off, "flag off")
        assert_same(self, ref, on, "flag on")
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        self.assertTrue(torch.equal(ref_after, off_after))
        # The deferred path really ran: a stop seen one step late costs exactly one extra forward, undone.
        stopped_early = ref.sequences.shape[1] < ids.shape[1] + kw.get("max_new_tokens", 10**9) and (
            "max_length" not in kw or ref.sequences.shape[1] < kw["max_length"])
        self.assertEqual(on_forwards - ref_forwards, 1 if stopped_early else 0)
        if early:
            self.assertTrue(stopped_early, "scenario meant to stop early did not")

    @parameterized.expand([(f,) for f in FAMILIES])
    @pytest.mark.core
    def test_plain_tensor_output_matches_stock(self, family):
        model = build(family)
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [3, 3, 3])
        with stock():
            ref, _, _ = _run(model, ids, mask, None, max_new_tokens=10, eos_token_id=eos)
        on, _, _ = _run(model, ids, mask, True, max_new_tokens=10, eos_token_id=eos)
        self.assertListEqual(ref.tolist(), on.tolist())


class AttentionsMatchStock(unittest.TestCase):
    @parameterized.expand([(f,) for f in FAMILIES])
    def test_attentions_match_stock(self, family):
        model = build(family, attn="eager")  # SDPA returns no attention weights
        ids, mask = prompt(left_pad=True)
        kw = dict(max_new_tokens=10, eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, 3, 4]),
                  output_attentions=True, **FULL_OUTPUTS)
        with stock():
            ref, _, _ = _run(model, ids, mask, None, **kw)
        on, _, _ = _run(model, ids, mask, True, **kw)
        self.assertIsNotNone(ref.attentions)
        assert_same(self, ref, on)


class CachesMatchStock(unittest.TestCase):
    @parameterized.expand([("llama",), ("qwen2",)])
    @pytest.mark.core
    def test_static_cache_rolled_back(self, family):
        model = build(family)
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [2, 4, 3])
        kw = dict(max_new_tokens=10, eos_token_id=eos, cache_implementation="static", **FULL_OUTPUTS)
        with stock():
            ref, _, _ = _run(model, ids, mask, None, **kw)
        on, _, forwards = _run(model, ids, mask, True, **kw)
        assert_same(self, ref, on)

    @parameterized.expand([("llama",), ("gpt2",)])
    @pytest.mark.core
    def test_user_cache_rolled_back(self, family):
        model = build(family)
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [2, 4, 3])
        with stock():
            ref_cache = DynamicCache(config=model.config)
            ref, _, _ = _run(model, ids, mask, None, max_new_tokens=10, eos_token_id=eos, past_key_values=ref_cache)
        on_cache = DynamicCache(config=model.config)
        on, _, _ = _run(model, ids, mask, True, max_new_tokens=10, eos_token_id=eos, past_key_values=on_cache)
        self.assertListEqual(ref.tolist(), on.tolist())
        assert_same(self, ref_cache, on_cache, "user cache")
        self.assertEqual(on_cache.get_seq_length(), on.shape[1] - 1)


class SeededSamplingContinues(unittest.TestCase):
    def test_second_call_after_a_stopped_one_samples_the_same(self):
        """No reseed between calls: the extra step's draws were given back, so call 2 sees stock's RNG state."""
        model = build("llama")
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [1, 2, 2])
        kw = dict(max_new_tokens=8, eos_token_id=eos, do_sample=True, top_k=4, pad_token_id=PAD)

        def two_calls(flag):
            torch.manual_seed(7)
            extra = {} if flag is None else {"async_stopping_criteria": flag}
            first = model.generate(ids, attention_mask=mask, **kw, **extra)
            second = model.generate(ids, attention_mask=mask, **kw, **extra)
            return first, second

        with stock():
            ref = two_calls(None)
        on = two_calls(True)
        self.assertListEqual(ref[0].tolist(), on[0].tolist())
        self.assertListEqual(ref[1].tolist(), on[1].tolist())


if __name__ == "__main__":
    unittest.main()


class SlidingWindowCache(unittest.TestCase):
    """A window smaller than the generation, so the cache overwrites state: exact on every release, deferred where
    the cache can record its past (5.17+), stock with one warning where it cannot and the cache is returned."""

    @pytest.mark.core

    def test_returned_sliding_window_cache_matches_stock(self):
        import warnings

        from transformers_async_stop import StockPathWarning

        model = build("mistral", sliding_window=4)
        ids, mask = prompt()
        kw = dict(max_new_tokens=12, eos_token_id=eos_ids_finishing_at(model, ids, mask, [3, 6, 5]),
                  **FULL_OUTPUTS)
        with stock():
            ref, ref_after, ref_forwards = _run(model, ids, mask, None, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on, on_after, on_forwards = _run(model, ids, mask, True, **kw)
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_after, on_after))
        stock_path = [w for w in caught if issubclass(w.category, StockPathWarning)]
        deferred = on_forwards == ref_forwards + 1
        self.assertNotEqual(bool(stock_path), deferred, "either deferred, or stock with a warning")
        self.assertLessEqual(len(stock_path), 1)

    def test_sliding_window_cache_not_returned_is_deferred(self):
        model = build("mistral", sliding_window=4)
        ids, mask = prompt()
        kw = dict(max_new_tokens=12, eos_token_id=eos_ids_finishing_at(model, ids, mask, [3, 6, 5]))
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, None, **kw)
        on, _, on_forwards = _run(model, ids, mask, True, **kw)
        self.assertListEqual(ref.tolist(), on.tolist())
        if ref.shape[1] < ids.shape[1] + 12:
            self.assertEqual(on_forwards, ref_forwards + 1)
