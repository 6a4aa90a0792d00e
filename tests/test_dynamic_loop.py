"""With the flag and a dynamic cache (5.17+), the package's lean decode loop runs (`dynamic_loop/`): each step's
forward inputs are made from the previous step's. Every output equals unpatched stock transformers: sequences,
scores, logits, the returned cache, what the model's forward and attention layers get (values, dtype, shape,
strides), what processors, criteria and streamers see, and the RNG state afterwards.

Where the installed sources are not the ones the loop was read against (`targets.SHORTCUTS` "dynamic decode loop"),
or a call's conditions are not met, the deferred path runs and equals stock too.
"""

from __future__ import annotations

import contextlib
import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from loop_callbacks import Collect, LoopContract, Recorder, StopAfterRepeat, loop_kwargs
from models import (
    PAD,
    TRANSFORMERS_VERSION,
    assert_flag_matches_stock,
    assert_same,
    build,
    count_syncs,
    eos_ids_finishing_at,
    prompt,
    stock,
)
from transformers_async_stop.loops import dynamic_loop
from transformers_async_stop.loops.dynamic_loop import eligibility, inputs
from transformers_async_stop.release_checks.verified import matches

# taken exactly where its sources were checked; every other release must fall back to the deferred path
TAKEN = TRANSFORMERS_VERSION >= (5, 17) and matches("dynamic decode loop")
needs_loop = unittest.skipUnless(TAKEN, "the dynamic-cache loop is taken on transformers 5.17-5.23")
needs_cuda = unittest.skipUnless(torch.cuda.is_available() and TAKEN, "needs a CUDA device and transformers 5.17-5.23")


class LoopSpy:
    """Counts the loop's calls and whether their inputs were made from the previous step's."""

    def __init__(self):
        self.runs = 0
        self.lean = []
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        real_run, real_build = dynamic_loop.run, inputs.DecodeInputs.build.__func__

        def run(*args, **kwargs):
            self.runs += 1
            return real_run(*args, **kwargs)

        def build_(cls, *args, **kwargs):
            made = real_build(cls, *args, **kwargs)
            self.lean.append(made[1] is not None)
            return made

        self._stack.enter_context(mock.patch.object(dynamic_loop, "run", run))
        self._stack.enter_context(mock.patch.object(inputs.DecodeInputs, "build", classmethod(build_)))
        return self

    def __exit__(self, *exc):
        self._stack.close()


class ForwardSpy:
    """What the model's forward and its first attention layer get, each call: every tensor's values, dtype, shape
    and strides (the 4D mask included, as the attention sees it)."""

    def __init__(self, model):
        self.calls = []
        attention = next(m for name, m in model.named_modules() if name.endswith(("self_attn", "attn")))
        self._handles = [model.register_forward_pre_hook(self._hook("forward"), with_kwargs=True),
                         attention.register_forward_pre_hook(self._hook("attention"), with_kwargs=True)]

    def _hook(self, where):
        def hook(module, args, kwargs):
            seen = {}
            for key, value in list(enumerate(args)) + sorted(kwargs.items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor) or value is None:
                    seen[str(key)] = _describe(value)
            self.calls.append((where, seen))
        return hook

    def close(self):
        for handle in self._handles:
            handle.remove()


def _describe(tensor):
    if tensor is None:
        return None
    return tensor.detach().clone(), tensor.dtype, tuple(tensor.shape), tensor.stride()




def stock_then_loop(test, run, taken=True):
    """`run(None)` on unpatched stock, then `run(True)`, which must take the loop once (where it is taken)."""
    with stock():
        ref = run(None)
    with LoopSpy() as spy:
        on = run(True)
    test.assertEqual(spy.runs, 1 if (taken and TAKEN) else 0)
    return ref, on


def _flag(flag):
    return {} if flag is None else dict(async_stopping_criteria=flag)


class DynamicLoopEqualsStock(LoopContract, unittest.TestCase):
    LOOP_KWARGS = {}  # a DynamicCache: the default

    def stock_then_loop(self, run):
        return stock_then_loop(self, run)

    @parameterized.expand([(family, sampling, padded) for family in ("llama", "qwen2", "gpt2")
                           for sampling in (False, True) for padded in (False, True)])
    @pytest.mark.core
    def test_the_loop_runs_with_lean_inputs_and_equals_stock(self, family, sampling, padded):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=padded)
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"),
                                      **loop_kwargs(model, ids, mask, sampling))
        self.assertEqual((spy.runs, spy.lean), (1, [True]) if TAKEN else (0, []))

    @parameterized.expand([("llama", False), ("llama", True), ("qwen2", True), ("gpt2", True)])
    @pytest.mark.core
    def test_the_forward_and_the_attention_get_stocks_tensors(self, family, padded):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=padded)

        def run(flag):
            spy = ForwardSpy(model)
            try:
                torch.manual_seed(0)
                out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=PAD,
                                     do_sample=True, **_flag(flag))
            finally:
                spy.close()
            return out, spy.calls

        (ref, ref_calls), (on, on_calls) = stock_then_loop(self, run)
        assert_same(self, ref, on)
        self.assertEqual(len(ref_calls), len(on_calls))
        for i, ((where_a, a), (where_b, b)) in enumerate(zip(ref_calls, on_calls)):
            self.assertEqual((where_a, sorted(a)), (where_b, sorted(b)), f"call {i}")
            for key in a:
                if a[key] is None or b[key] is None:
                    self.assertIs(a[key], b[key], f"call {i} {where_a} {key}")
                    continue
                self.assertEqual(a[key][1:], b[key][1:], f"call {i} {where_a} {key}: dtype, shape, strides")
                self.assertTrue(torch.equal(a[key][0], b[key][0]), f"call {i} {where_a} {key} differs")

    @parameterized.expand([("unpadded", False), ("padded", True)])
    @pytest.mark.core
    def test_a_returned_user_dynamic_cache_gives_the_extra_step_back(self, _, padded):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=padded)
        eos = eos_ids_finishing_at(model, ids, mask, [3, 4])

        def run(flag):
            cache = DynamicCache(config=model.config)
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                 eos_token_id=eos, pad_token_id=PAD, **_flag(flag))
            return out, cache

        (ref, ref_cache), (on, on_cache) = stock_then_loop(self, run)
        self.assertLess(ref.shape[1], ids.shape[1] + 12, "the rows must stop before max_new_tokens")
        assert_same(self, ref, on)
        assert_same(self, ref_cache, on_cache)

    @parameterized.expand([("unpadded", False), ("padded", True)])
    @pytest.mark.core
    @unittest.skipIf(TRANSFORMERS_VERSION < (5, 17), "older stock slices the new tokens by a cache position it lacks")
    def test_new_tokens_only_on_a_reused_dynamic_cache(self, _, padded):
        """A conversation kept in a DynamicCache, continued by feeding only the new turn's tokens."""
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=padded)
        eos = eos_ids_finishing_at(model, ids, mask, [3, None])
        turn = torch.randint(3, 40, (2, 3), generator=torch.Generator().manual_seed(7))

        def run(flag):
            cache = DynamicCache(config=model.config)
            torch.manual_seed(0)
            first = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                                   eos_token_id=eos, pad_token_id=PAD, do_sample=True, **_flag(flag))
            # the whole conversation's mask (what the cache holds, then the new turn), only the new ids
            full = torch.cat([mask, torch.ones_like(first[:, ids.shape[1]:]), torch.ones_like(turn)], dim=-1)
            full = full[:, : cache.get_seq_length() + turn.shape[1]]
            second = model.generate(turn, attention_mask=full, past_key_values=cache, max_new_tokens=7,
                                    eos_token_id=eos, pad_token_id=PAD, do_sample=True,
                                    return_dict_in_generate=True, output_scores=True, **_flag(flag))
            return first, second, cache, torch.rand(3)

        with stock():
            ref = run(None)
        with LoopSpy() as spy:
            on = run(True)
        self.assertEqual(spy.runs, 2 if TAKEN else 0)
        assert_same(self, ref, on)

    @pytest.mark.core
    def test_inputs_embeds(self):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)
        embeds = model.get_input_embeddings()(ids)

        def run(flag):
            torch.manual_seed(0)
            return model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD,
                                  eos_token_id=eos_ids_finishing_at(model, ids, mask, [3, None]), do_sample=True,
                                  return_dict_in_generate=True, output_scores=True, **_flag(flag))

        ref, on = stock_then_loop(self, run)
        assert_same(self, ref, on)

    def test_max_length_and_min_length_processors(self):
        model = build("qwen2")
        ids, mask = prompt(batch=3, left_pad=True)
        kw = loop_kwargs(model, ids, mask, sampling=False, finishing=(2, 3, None))
        kw.update(min_length=ids.shape[1] + 4, max_new_tokens=9)
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"), **kw)
        self.assertEqual(spy.runs, 1 if TAKEN else 0)

    @parameterized.expand([
        ("switched_off", {eligibility.DYNAMIC_LOOP_ENV: "0"}, {}, "sdpa"),
        ("attentions", {}, dict(return_dict_in_generate=True, output_attentions=True), "eager"),
        ("static_cache", {}, dict(cache_implementation="static"), "sdpa"),
    ])
    def test_where_the_loop_does_not_apply_the_deferred_path_runs_and_equals_stock(self, _, env, extra, attn):
        model = build("llama", attn=attn)
        ids, mask = prompt(batch=2)
        kw = dict(max_new_tokens=6, pad_token_id=PAD, eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, None]))
        kw.update(extra)
        with mock.patch.dict(os.environ, env), LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"), **kw)
        self.assertEqual(spy.runs, 0)

    @pytest.mark.core
    def test_a_release_whose_sources_were_not_checked_falls_back(self):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)
        kw = loop_kwargs(model, ids, mask, sampling=True, finishing=(3, None))
        real = eligibility.matches
        with mock.patch.object(eligibility, "matches", lambda name: False if name == "dynamic decode loop"
                               else real(name)), LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"), **kw)
        self.assertEqual(spy.runs, 0)


@needs_loop
class DraftLoop(unittest.TestCase):
    @parameterized.expand([("greedy", False), ("sampling", True)])
    @pytest.mark.core
    def test_the_assistants_draft_loop_takes_the_lean_loop_and_equals_stock(self, _, sampling):
        model, assistant = build("llama"), build("llama", seed=1)
        ids, mask = prompt(batch=1)
        eos = eos_ids_finishing_at(model, ids, mask, [9])

        def run(flag):
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=14,
                                 eos_token_id=eos, pad_token_id=PAD, do_sample=sampling,
                                 return_dict_in_generate=True, output_scores=True, **_flag(flag))
            return out, torch.rand(3)

        with stock():
            ref = run(None)
        with LoopSpy() as spy:
            on = run(True)
        self.assertGreater(spy.runs, 1, "every round's draft runs the lean loop")
        assert_same(self, ref, on)


# --- on CUDA: the same loop, no blocking read per decode step -----------------------------------------------------
@needs_cuda
class CudaDynamicLoop(unittest.TestCase):
    @parameterized.expand([(sampling, padded) for sampling in (False, True) for padded in (False, True)])
    def test_the_loop_equals_stock_on_cuda(self, sampling, padded):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=3, left_pad=padded, device="cuda")
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cuda"),
                                      **loop_kwargs(model, ids, mask, sampling))
        self.assertEqual((spy.runs, spy.lean), (1, [True]))

    @parameterized.expand([("unpadded", False), ("padded", True)])
    def test_zero_syncs_per_decode_step(self, _, padded):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=2, left_pad=padded, device="cuda")

        def per_step(**extra):
            def call(n):
                return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                              pad_token_id=PAD, **extra)
            call(24)()
            call(1)()
            return (count_syncs(call(24)) - count_syncs(call(1))) / 23

        with stock():
            stock_syncs = per_step()
        with LoopSpy() as spy:
            on_syncs = per_step(async_stopping_criteria=True)
        print(f"\nSYNCS transformers={'.'.join(map(str, TRANSFORMERS_VERSION))} case=dynamic_loop_{_} "
              f"stock={stock_syncs:.2f} flag_on={on_syncs:.2f}")
        self.assertGreater(spy.runs, 0)
        self.assertGreaterEqual(stock_syncs, 1.0)
        self.assertEqual(on_syncs, 0.0)
