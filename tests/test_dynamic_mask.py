"""With a padded batch and a dynamic cache, the flag's decode loop hands the model a 4D mask grown by one column per
step instead of the 2D mask it rebuilds the 4D one from (`dynamic_loop/wide_mask.py`). Every attention layer gets
stock's mask (values, dtype, shape, strides) and every output equals unpatched stock transformers; where the grown
mask cannot be proven to be stock's, the model gets the 2D mask, as in stock."""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import DynamicCache, StoppingCriteriaList

from loop_callbacks import ChangeAtStep, loop_kwargs
from models import PAD, assert_flag_matches_stock, assert_same, build, eos_ids_finishing_at, prompt
from test_dynamic_loop import TAKEN, LoopSpy, stock_then_loop
from transformers_async_stop.loops.dynamic_loop import wide_mask
from transformers_async_stop.release_checks.verified import matches

GROWN = TAKEN and all(matches(f"dynamic decode mask ({family})") for family in ("llama", "qwen2", "mistral"))
needs_grown = unittest.skipUnless(GROWN, "the grown decode mask is used on transformers 5.17-5.23")


class GrownMasks:
    """Counts the calls whose decode steps were handed a grown 4D mask."""

    def __init__(self):
        self.calls = 0
        real = wide_mask.first

        def first(mask):
            self.calls += 1
            return real(mask)

        self._patch = mock.patch.object(wide_mask, "first", first)

    def __enter__(self):
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


class AttentionMasks:
    """The mask the first attention layer gets at each call: values, dtype, shape, strides. A hook on a layer (not
    on the model, whose keyword arguments would change) leaves the grown mask in use."""

    def __init__(self, model):
        self.seen = []
        layer = next(m for name, m in model.named_modules() if name.endswith("self_attn"))
        self._handle = layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.seen.append(None if mask is None else (mask.clone(), mask.dtype, tuple(mask.shape), mask.stride()))

    def close(self):
        self._handle.remove()


@needs_grown
class GrownDecodeMaskEqualsStock(unittest.TestCase):
    @parameterized.expand([(family, sampling) for family in ("llama", "qwen2", "mistral")
                           for sampling in (False, True)])
    @pytest.mark.core
    def test_a_padded_batch_gets_a_grown_mask_and_every_layer_sees_stocks(self, family, sampling):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        kw = loop_kwargs(model, ids, mask, sampling)

        def run(flag):
            spy = AttentionMasks(model)
            try:
                torch.manual_seed(0)
                out = model.generate(ids, attention_mask=mask, **kw,
                                     **({} if flag is None else dict(async_stopping_criteria=flag)))
            finally:
                spy.close()
            return out, spy.seen, torch.rand(3)

        with GrownMasks() as grown:
            (ref, ref_masks, ref_rng), (on, on_masks, on_rng) = stock_then_loop(self, run)
        self.assertEqual(grown.calls, 1)
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_rng, on_rng))
        # the flag's run makes one forward more (the step it undoes); the ones stock made see stock's masks
        self.assertGreaterEqual(len(on_masks), len(ref_masks))
        for step, (a, b) in enumerate(zip(ref_masks, on_masks)):
            self.assertIsNotNone(a, "a padded batch's stock decode step builds a mask")
            self.assertEqual(a[1:], b[1:], f"forward {step}: dtype, shape, strides")
            self.assertTrue(torch.equal(a[0], b[0]), f"forward {step}: mask values")

    @parameterized.expand([
        ("unpadded", "llama", "sdpa", False, {}),  # stock hands SDPA no mask at all
        ("eager_attention", "llama", "sdpa", True, {"attn": "eager"}),
        ("another_family", "gpt2", "sdpa", True, {}),
        ("a_hook_on_the_model", "llama", "sdpa", True, {"hook": True}),
    ])
    @pytest.mark.core
    def test_where_the_grown_mask_is_not_proven_the_model_gets_the_2d_mask(self, _, family, attn, padded, extra):
        model = build(family, attn=extra.get("attn", attn))
        handle = model.register_forward_pre_hook(lambda *a: None) if extra.get("hook") else None
        ids, mask = prompt(batch=3, left_pad=padded)
        try:
            with GrownMasks() as grown, LoopSpy() as spy:
                assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"),
                                          **loop_kwargs(model, ids, mask, sampling=True))
        finally:
            if handle is not None:
                handle.remove()
        self.assertEqual(spy.runs, 1)
        self.assertEqual(grown.calls, 0)

    @pytest.mark.core
    def test_a_criterion_that_crops_the_cache_hands_the_model_the_2d_mask_again(self):
        """The grown mask's length is checked against the cache's every step: a callback that changes the cache
        (here a criterion dropping the last position once) makes the model build its mask again, as in stock."""
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)

        def run(flag):
            cache = DynamicCache(config=model.config)
            crop_once = ChangeAtStep(4, lambda: cache.crop(-1))  # a negative count: drop that many (every release)
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=9,
                                 pad_token_id=PAD, eos_token_id=eos_ids_finishing_at(model, ids, mask, [7, None]),
                                 do_sample=True, stopping_criteria=StoppingCriteriaList([crop_once]),
                                 return_dict_in_generate=True, output_scores=True, output_logits=True,
                                 **({} if flag is None else dict(async_stopping_criteria=flag)))
            return out, cache, torch.rand(3)

        with GrownMasks() as grown:
            ref, on = stock_then_loop(self, run)
        self.assertEqual(grown.calls, 1)
        assert_same(self, ref, on)


@unittest.skipUnless(torch.cuda.is_available() and GROWN, "needs a CUDA device and transformers 5.17-5.23")
class CudaGrownDecodeMask(unittest.TestCase):
    @parameterized.expand([("greedy", False), ("sampling", True)])
    def test_a_padded_batch_on_cuda_gets_a_grown_mask_and_equals_stock(self, _, sampling):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=3, left_pad=True, device="cuda")
        with GrownMasks() as grown:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cuda"),
                                      **loop_kwargs(model, ids, mask, sampling))
        self.assertEqual(grown.calls, 1)
