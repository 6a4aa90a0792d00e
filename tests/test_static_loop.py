"""With the flag and a static cache (5.17+), the package's own decode loop runs (`static_loop/`): the forward's inputs
are advanced in place and, on CUDA, the rest of the step is replayed from CUDA graphs. Every output equals unpatched
stock transformers: sequences, scores, logits, the returned cache, what processors, criteria and streamers see, and
the RNG state afterwards.

The CPU tests (forced deferred path) run the same loop with the tail eager; the CUDA tests also capture it.
"""

from __future__ import annotations

import contextlib
import os
import unittest
import warnings
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StaticCache, StoppingCriteriaList

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
from transformers_async_stop import graph_safe
from transformers_async_stop.loops import static_loop
from transformers_async_stop.loops.static_loop import eligibility, inputs, tail

LOOP_RELEASES = TRANSFORMERS_VERSION >= (5, 17)
CUDA = torch.cuda.is_available()
needs_loop = unittest.skipUnless(LOOP_RELEASES, "the static-cache loop is taken on transformers 5.17+")
needs_cuda = unittest.skipUnless(CUDA and LOOP_RELEASES, "needs a CUDA device and transformers 5.17+")


class LoopSpy:
    """Counts the loop's calls, whether their inputs were advanced in place, and the tail's captured graphs."""

    def __init__(self):
        self.runs = 0
        self.in_place = []
        self.captured = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        real_run, real_build, real_capture = static_loop.loop.run, inputs.StepInputs.build.__func__, \
            tail.Tail._capture

        def run(*args, **kwargs):
            self.runs += 1
            return real_run(*args, **kwargs)

        def build_(cls, *args, **kwargs):
            made = real_build(cls, *args, **kwargs)
            self.in_place.append(made[1] is not None)
            return made

        def capture(this, *args, **kwargs):
            scores = real_capture(this, *args, **kwargs)
            self.captured += scores is not None
            return scores

        from transformers_async_stop import generation
        self._stack.enter_context(mock.patch.object(generation.static_loop, "run", run))
        self._stack.enter_context(mock.patch.object(inputs.StepInputs, "build", classmethod(build_)))
        self._stack.enter_context(mock.patch.object(tail.Tail, "_capture", capture))
        return self

    def __exit__(self, *exc):
        self._stack.close()




def stock_then_loop(test, run):
    """`run(None)` on unpatched stock, then `run(True)`, which must take the static-cache loop once; both results."""
    with stock():
        ref = run(None)
    with LoopSpy() as spy:
        on = run(True)
    test.assertEqual(spy.runs, 1)
    return ref, on


@needs_loop
class StaticLoopEqualsStock(LoopContract, unittest.TestCase):
    LOOP_KWARGS = {"cache_implementation": "static"}  # a static cache

    def stock_then_loop(self, run):
        return stock_then_loop(self, run)

    @parameterized.expand([(family, sampling, padded) for family in ("llama", "qwen2", "gpt2")
                           for sampling in (False, True) for padded in (False, True)])
    @pytest.mark.core
    def test_the_loop_runs_with_inputs_advanced_in_place_and_equals_stock(self, family, sampling, padded):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=padded)
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"),
                                      **loop_kwargs(model, ids, mask, sampling, cache_implementation="static"))
        self.assertEqual(spy.runs, 1)
        self.assertEqual(spy.in_place, [True])

    @pytest.mark.core
    def test_a_returned_user_static_cache_gives_the_extra_step_back(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        eos = eos_ids_finishing_at(model, ids, mask, [3, 4])

        def run(flag):
            cache = StaticCache(config=model.config, max_cache_len=32)
            kw = {} if flag is None else dict(async_stopping_criteria=flag)
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                 eos_token_id=eos, pad_token_id=PAD, **kw)
            return out, cache

        (ref, ref_cache), (on, on_cache) = stock_then_loop(self, run)
        self.assertLess(ref.shape[1], ids.shape[1] + 12, "the rows must stop before max_new_tokens")
        assert_same(self, ref, on)
        assert_same(self, ref_cache, on_cache)

    @pytest.mark.core
    def test_inputs_the_loop_cannot_advance_are_rebuilt_by_stock_every_step(self):
        model = build("llama", attn="eager")  # no mask plan for eager attention: stock builds every step's mask
        ids, mask = prompt(batch=3, left_pad=True)
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"),
                                      **loop_kwargs(model, ids, mask, sampling=True, cache_implementation="static"))
        self.assertEqual((spy.runs, spy.in_place), (1, [False]))

    @parameterized.expand([
        ("switched_off", {eligibility.STATIC_LOOP_ENV: "0"}, {}, "sdpa"),
        ("attentions", {}, dict(return_dict_in_generate=True, output_attentions=True), "eager"),
        ("dynamic_cache", {}, dict(cache_implementation=None), "sdpa"),
    ])
    def test_where_the_loop_does_not_apply_the_deferred_path_runs_and_equals_stock(self, _, env, extra, attn):
        model = build("llama", attn=attn)
        ids, mask = prompt(batch=2)
        kw = dict(max_new_tokens=6, pad_token_id=PAD, cache_implementation="static",
                  eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, None]))
        kw.update(extra)
        with mock.patch.dict(os.environ, env), LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device("cpu"), **kw)
        self.assertEqual(spy.runs, 0)


class GraphSafety(unittest.TestCase):
    def test_built_in_warpers_and_declared_processors_are_graph_safe_and_others_are_not(self):
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        class Mine(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores.softmax(-1)

        declared = Mine()
        self.assertIs(graph_safe(declared), declared)
        self.assertTrue(eligibility._is_graph_safe(declared))
        self.assertTrue(eligibility._is_graph_safe(TemperatureLogitsWarper(0.7)))
        self.assertTrue(eligibility._is_graph_safe(TopPLogitsWarper(0.9)))

        class Sub(TemperatureLogitsWarper):  # a subclass may have its own __call__
            pass

        # without `purity` (which judges undeclared processors on their first call), only these are capturable
        with mock.patch.object(eligibility, "_purity_guard", return_value=None):
            self.assertFalse(eligibility._is_graph_safe(Mine()))
            self.assertFalse(eligibility._is_graph_safe(Sub(0.7)))
            self.assertFalse(eligibility._is_graph_safe(RepetitionPenaltyLogitsProcessor(1.2)))
        if LOOP_RELEASES:  # the penalty's device form is (`processors/forms.py`)
            form = eligibility.forms.device_form(RepetitionPenaltyLogitsProcessor(1.2))
            self.assertIsNotNone(form)
            self.assertTrue(eligibility._is_graph_safe(form))


# --- on CUDA: the tail captured into CUDA graphs ------------------------------------------------------------------
@needs_cuda
class CudaCapturedTail(unittest.TestCase):
    DEVICE = "cuda"  # the CPU under the graph emulation: test_emulated_captures.py

    @parameterized.expand([(sampling, padded, compiled) for sampling in (False, True) for padded in (False, True)
                           for compiled in (False, True) if not (compiled and padded)])
    def test_the_captured_tail_equals_stock(self, sampling, padded, compiled):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1 if compiled else 3, left_pad=padded, device=self.DEVICE)
        kw = loop_kwargs(model, ids, mask, sampling, finishing=(5,) if compiled else (3, 5, None),
                         cache_implementation="static")
        if not compiled:
            kw.update(disable_compile=True)
        with LoopSpy() as spy:
            assert_flag_matches_stock(self, model, ids, mask, torch.device(self.DEVICE), **kw)
        self.assertEqual(spy.runs, 1)
        self.assertGreater(spy.captured, 0, "the tail was never captured")

    def test_declared_and_provably_pure_processors_are_captured_an_impure_one_is_not_all_equal_stock(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=2, device=self.DEVICE)

        class Softmax(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores.softmax(-1)

        class LastTokenDown(LogitsProcessor):  # reads input_ids' values: a replay would read a stale view
            def __call__(self, input_ids, scores):
                return scores.scatter_add(1, input_ids[:, -1:], torch.full_like(scores[:, :1], -1.0))

        # declared, undeclared but proven pure (static_loop/purity/), and impure
        for processor, captured in ((graph_safe(Softmax()), True), (Softmax(), True), (LastTokenDown(), False)):
            kw = dict(max_new_tokens=12, pad_token_id=PAD, cache_implementation="static", disable_compile=True,
                      do_sample=True, logits_processor=LogitsProcessorList([processor]),
                      eos_token_id=eos_ids_finishing_at(model, ids, mask, [4, None]))
            with self.subTest(processor=type(processor).__name__, captured=captured):
                with LoopSpy() as spy:
                    assert_flag_matches_stock(self, model, ids, mask, torch.device(self.DEVICE), **kw)
                self.assertEqual(spy.captured > 0, captured)

    def test_zero_syncs_per_decode_step_with_the_captured_tail(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)

        def per_step(**extra):
            def call(n):
                return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                              pad_token_id=PAD, cache_implementation="static", **extra)
            call(24)()
            call(1)()
            return (count_syncs(call(24)) - count_syncs(call(1))) / 23

        with stock():
            stock_syncs = per_step()
        with LoopSpy() as spy:
            on_syncs = per_step(async_stopping_criteria=True)
        print(f"\nSYNCS transformers={'.'.join(map(str, TRANSFORMERS_VERSION))} case=static_loop_captured "
              f"stock={stock_syncs:.2f} flag_on={on_syncs:.2f}")
        self.assertGreater(spy.captured, 0)
        self.assertGreaterEqual(stock_syncs, 1.0)
        self.assertEqual(on_syncs, 0.0)


if __name__ == "__main__":
    warnings.simplefilter("default")
    unittest.main()
