"""`last_path()` and the `transformers_async_stop` logger say which path each generate() call took, and why."""

from __future__ import annotations

import os
import threading
import unittest
import warnings
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from transformers_async_stop import CallPath, StockPathWarning, last_path

from models import PAD, TRANSFORMERS_VERSION, build, prompt
from transformers_async_stop.loops.assisted.loop import installed_port
from transformers_async_stop.testing.emulation import emulated
from transformers_async_stop.graphs.piecewise import proof

LOOP_RELEASES = TRANSFORMERS_VERSION >= (5, 17)
PIECEWISE_RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the piecewise forward's releases
# the forced CPU run's dynamic loop keeps the eager forward, and says so
CPU_DYNAMIC = "deferred, dynamic loop, forward eager: not CUDA (cpu)"


def _greedy(model, ids, mask, **kw):
    kw.setdefault("do_sample", False)
    kw.setdefault("max_new_tokens", 4)
    return model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kw)


class NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class JudgeProcessor(LogitsProcessor):
    """Runs a generate() of its own (an LLM judge) at every step, and notes the path the inner call reported."""

    def __init__(self, judge, flag):
        self.judge, self.flag, self.inner = judge, flag, []

    def __call__(self, input_ids, scores):
        ids, mask = prompt(batch=1)
        _greedy(self.judge, ids, mask, async_stopping_criteria=self.flag)
        self.inner.append(last_path())
        return scores


class LastPath(unittest.TestCase):
    def setUp(self):
        self.model = build("llama")
        self.ids, self.mask = prompt(batch=2)

    def test_cpu_without_the_force_switch_reports_stock_because_the_device_is_synchronous(self):
        with mock.patch.dict(os.environ, {tas.FORCE_ENV: "0"}):
            _greedy(self.model, self.ids, self.mask, async_stopping_criteria=True)
        path = last_path()
        self.assertEqual(path.path, "stock")
        self.assertEqual(path.reason, "CPU: the device is synchronous")
        self.assertEqual(path.method, "greedy")
        self.assertEqual(path.describe(), "stock: CPU")

    def test_forced_greedy_reports_the_deferred_path_and_its_loop(self):
        _greedy(self.model, self.ids, self.mask, async_stopping_criteria=True)
        loop = "dynamic" if LOOP_RELEASES else None  # the dynamic-cache loop is 5.17+ too
        self.assertEqual(last_path(), CallPath(path="deferred", reason=None, tail=None, graphs=0, method="greedy",
                                               loop=loop))
        self.assertEqual(last_path().describe(), CPU_DYNAMIC if loop else "deferred")

    def test_a_call_the_dynamic_loop_does_not_take_reports_transformers_loop(self):
        self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=4, pad_token_id=PAD,
                            return_dict_in_generate=True, output_hidden_states=True, async_stopping_criteria=True)
        self.assertEqual((last_path().describe(), last_path().loop), ("deferred", None))

    def test_forced_beam_search_reports_its_method(self):
        self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=4, num_beams=2, pad_token_id=PAD,
                            async_stopping_criteria=True)
        self.assertEqual((last_path().path, last_path().method), ("deferred", "beam search"))

    def test_flag_false_reports_stock_flag_off(self):
        _greedy(self.model, self.ids, self.mask, async_stopping_criteria=False)
        self.assertEqual(last_path().describe(), "stock: flag off")

    def test_a_call_that_does_not_ask_for_the_flag_leaves_the_last_report(self):
        _greedy(self.model, self.ids, self.mask, async_stopping_criteria=True)
        before = last_path()
        _greedy(self.model, self.ids, self.mask)
        self.assertIs(last_path(), before)

    def test_the_flag_in_the_models_generation_config_is_reported(self):
        self.model.generation_config.async_stopping_criteria = True
        _greedy(self.model, self.ids, self.mask, do_sample=True, top_k=4)
        self.assertEqual((last_path().path, last_path().method), ("deferred", "sample"))

    @unittest.skipUnless(LOOP_RELEASES, "the static-cache loop is taken on transformers 5.17+")
    def test_forced_static_cache_reports_the_static_loop_with_an_eager_tail_on_cpu(self):
        _greedy(self.model, self.ids, self.mask, cache_implementation="static", async_stopping_criteria=True)
        path = last_path()
        self.assertEqual((path.path, path.tail, path.graphs), ("static loop", "eager", 0))
        self.assertEqual(path.describe(), "deferred, static loop, tail eager")

    def test_a_stock_path_warning_is_the_reported_reason(self):
        draft = build("llama", seed=3)
        ids, mask = prompt(batch=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD, assistant_model=draft,
                                stopping_criteria=StoppingCriteriaList([NeverStop()]), async_stopping_criteria=True)
        messages = [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]
        self.assertEqual(len(messages), 1)
        path = last_path()
        self.assertEqual((path.path, path.method), ("stock", "assisted"))
        self.assertIn(path.reason, messages[0])
        self.assertEqual(path.describe(), f"stock: {path.reason}")

    def test_a_nested_generate_does_not_replace_the_outer_calls_report(self):
        judge = JudgeProcessor(build("gpt2", seed=5), flag=False)
        self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=3, num_beams=2, pad_token_id=PAD,
                            logits_processor=LogitsProcessorList([judge]), async_stopping_criteria=True)
        self.assertTrue(judge.inner)
        self.assertTrue(all(p.describe() == "stock: flag off" for p in judge.inner))
        self.assertEqual((last_path().path, last_path().method), ("deferred", "beam search"))

    def test_each_thread_has_its_own_last_path(self):
        _greedy(self.model, self.ids, self.mask, async_stopping_criteria=True)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(last_path()))
        thread.start()
        thread.join()
        self.assertEqual(seen, [None])
        self.assertEqual(last_path().path, "deferred")


class Logger(unittest.TestCase):
    def test_one_info_line_per_call_that_asks_for_the_flag(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        with self.assertLogs("transformers_async_stop", "INFO") as logs:
            _greedy(model, ids, mask, async_stopping_criteria=True)
            _greedy(model, ids, mask)  # does not ask: no line
            with mock.patch.dict(os.environ, {tas.FORCE_ENV: "0"}):
                _greedy(model, ids, mask, async_stopping_criteria=True)
        deferred = CPU_DYNAMIC if LOOP_RELEASES else "deferred"
        # the per-call lines only: the once-per-process notices (a release's shortcuts that are off) come with the
        # process's first call, which is this test's when it runs first in its process (a pytest-xdist worker)
        calls = [line for line in logs.output if "generate()" in line]
        self.assertEqual(calls, [f"INFO:transformers_async_stop:generate() [greedy]: {deferred}",
                                 "INFO:transformers_async_stop:generate() [greedy]: stock: CPU"])


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class OnCuda(unittest.TestCase):
    """Unforced, as a user runs it: the paths a GPU takes."""

    def setUp(self):
        patcher = mock.patch.dict(os.environ, {tas.FORCE_ENV: "0"})
        patcher.start()
        self.addCleanup(patcher.stop)
        self.model = build("llama", device="cuda")
        self.ids, self.mask = prompt(batch=2, device="cuda")

    def test_greedy_with_a_dynamic_cache_is_deferred(self):
        _greedy(self.model, self.ids, self.mask, async_stopping_criteria=True)
        graphed = "deferred, dynamic loop, forward graphed (3 pieces)"  # 2 layers: 2 attentions, 3 pieces between
        self.assertEqual(last_path().describe(), graphed if LOOP_RELEASES else "deferred")

    @unittest.skipUnless(LOOP_RELEASES, "the static-cache loop is taken on transformers 5.17+")
    def test_a_static_cache_takes_the_static_loop_with_its_tail_captured(self):
        for _ in range(2):  # the tail is captured the second time a phase is seen
            _greedy(self.model, self.ids, self.mask, cache_implementation="static", max_new_tokens=8,
                    async_stopping_criteria=True)
        path = last_path()
        self.assertEqual((path.path, path.tail), ("static loop", "captured"))
        self.assertGreater(path.graphs, 0)
        self.assertRegex(path.describe(), r"^deferred, static loop, tail captured \(\d+ graphs?\)$")

    @unittest.skipUnless(LOOP_RELEASES, "the static-cache loop is taken on transformers 5.17+")
    def test_capture_off_leaves_the_tail_eager(self):
        with mock.patch.dict(os.environ, {"TRANSFORMERS_ASYNC_STOP_CAPTURE": "0"}):
            _greedy(self.model, self.ids, self.mask, cache_implementation="static", async_stopping_criteria=True)
        self.assertEqual(last_path().describe(), "deferred, static loop, tail eager")


class NeverStopHookAt(StoppingCriteria):
    """Never stops; registers a no-op forward hook on the model's first layer when the sequence reaches `length`."""

    def __init__(self, model, length):
        self.model, self.length, self.handle = model, length, None

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length and self.handle is None:
            self.handle = self.model.model.layers[0].register_forward_hook(lambda *args: None)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@unittest.skipUnless(PIECEWISE_RELEASES, "the piecewise forward's releases (5.17-5.24)")
@mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"})
class TheForwardIsNamed(unittest.TestCase):
    """describe() and the INFO line say whether the dynamic loop's decode forward replayed from graphs or ran eagerly
    (CUDA graphs emulated on the CPU, `testing/emulation.py`)."""

    def setUp(self):
        self.enterContext(emulated())
        self.model = build("llama")
        self.ids, self.mask = prompt(batch=1)

    def _logged(self, model, ids, mask, **kw):
        with self.assertLogs("transformers_async_stop", "INFO") as logs:
            _greedy(model, ids, mask, max_new_tokens=6, async_stopping_criteria=True, **kw)
        return [line for line in logs.output if "generate()" in line]

    def test_a_graphed_forward_says_graphed_with_its_pieces(self):
        logged = self._logged(self.model, self.ids, self.mask)
        self.assertTrue(last_path().forward.startswith("graphed (3 pieces): "), last_path().forward)
        described = "deferred, dynamic loop, forward graphed (3 pieces)"
        self.assertEqual(last_path().describe(), described)
        self.assertEqual(logged, [f"INFO:transformers_async_stop:generate() [greedy]: {described}"])

    def test_a_padded_qwen3_batch_says_graphed(self):
        from test_piecewise import build_any

        ids, mask = prompt(batch=3, left_pad=True)
        logged = self._logged(build_any("qwen3"), ids, mask)
        # the loop grows no 4D mask for Qwen3: each replay makes it from the padded 2D mask with stock's functions
        described = "deferred, dynamic loop, forward graphed (3 pieces)"
        self.assertEqual(last_path().describe(), described)
        self.assertEqual(logged, [f"INFO:transformers_async_stop:generate() [greedy]: {described}"])

    def test_a_hook_registered_before_the_call_says_eager_and_where(self):
        handle = self.model.model.layers[0].register_forward_hook(lambda *args: None)
        self.addCleanup(handle.remove)
        logged = self._logged(self.model, self.ids, self.mask)
        # a hook the call sees from its start: each verdict is read at once (the report says why), and no replay
        self.assertTrue(last_path().describe().endswith("; forward eager: a hook on LlamaDecoderLayer"),
                        last_path().describe())
        self.assertEqual(logged, [f"INFO:transformers_async_stop:generate() [greedy]: {last_path().describe()}"])

    def test_a_hook_added_mid_call_counts_the_eager_steps(self):
        criterion = NeverStopHookAt(self.model, self.ids.shape[1] + 2)
        try:
            _greedy(self.model, self.ids, self.mask, max_new_tokens=6, async_stopping_criteria=True,
                    stopping_criteria=StoppingCriteriaList([criterion]))
        finally:
            criterion.handle.remove()
        forward = last_path().forward
        self.assertRegex(forward, r"^graphed \(3 pieces\): \d+ decode steps; \d+ eager: a hook was added$")
        eager = forward.split("; ")[1].split(" ")[0]
        self.assertTrue(last_path().describe().endswith(
            f"forward graphed (3 pieces), {eager} steps eager: a hook was added"), last_path().describe())

    @unittest.skipUnless(installed_port() is not None, "this release's assisted decoding loop runs stock")
    def test_an_assisted_call_names_its_drafts_forward_and_keeps_its_method(self):
        logged = self._logged(self.model, self.ids, self.mask, assistant_model=build("llama", seed=3))
        path = last_path()
        self.assertEqual((path.path, path.method), ("deferred", "assisted"))  # not the draft's greedy
        self.assertTrue(path.forward.startswith("draft graphed (3 pieces): "), path.forward)
        self.assertTrue(path.verify.startswith("graphed (3 pieces): "), path.verify)
        described = path.describe()
        self.assertTrue(described.startswith("deferred, verify forward graphed (3 pieces)"), described)
        self.assertTrue(described.endswith(", draft forward graphed (3 pieces)"), described)
        self.assertEqual(logged, [f"INFO:transformers_async_stop:generate() [assisted]: {described}"])


class Describe(unittest.TestCase):
    def test_the_dynamic_loops_forward_is_named_short(self):
        def described(forward, path="deferred"):
            return CallPath(path, loop="dynamic" if path == "deferred" else None, forward=forward).describe()

        self.assertEqual(described("graphed (17 pieces): 127 decode steps"),
                         "deferred, dynamic loop, forward graphed (17 pieces)")
        self.assertEqual(described("graphed (17 pieces): 124 decode steps; 3 eager: a hook was added"),
                         "deferred, dynamic loop, forward graphed (17 pieces), 3 steps eager: a hook was added")
        self.assertEqual(described("graphed (17 pieces): 126 decode steps; 1 eager: training mode"),
                         "deferred, dynamic loop, forward graphed (17 pieces), 1 step eager: training mode")
        self.assertEqual(described("eager: sliding-window attention"),
                         "deferred, dynamic loop, forward eager: sliding-window attention")
        self.assertEqual(described("draft eager: not CUDA (cpu)"), "deferred, dynamic loop, draft forward eager: "
                                                                   "not CUDA (cpu)")
        self.assertEqual(described("eager: a hook on LlamaMLP", path="immediate"),
                         "immediate; forward eager: a hook on LlamaMLP")

    def test_an_assisted_calls_verify_forward_is_named_before_its_drafts(self):
        path = CallPath("deferred", method="assisted", forward="draft graphed (3 pieces): 4 decode steps",
                        verify="graphed (17 pieces): 30 rounds; 2 eager: width 5 seen once")
        self.assertEqual(path.describe(), "deferred, verify forward graphed (17 pieces), 2 rounds eager: width 5 seen "
                                          "once, draft forward graphed (3 pieces)")
        lookup = CallPath("deferred", method="prompt lookup", verify="graphed (17 pieces): 1 rounds; 1 eager: x")
        self.assertEqual(lookup.describe(), "deferred, verify forward graphed (17 pieces), 1 round eager: x")
        self.assertEqual(CallPath("deferred", verify="eager: not CUDA (cpu)").describe(),
                         "deferred, verify forward eager: not CUDA (cpu)")

    def test_the_captured_static_loop_names_its_graphs(self):
        self.assertEqual(CallPath("static loop", tail="captured", graphs=2).describe(),
                         "deferred, static loop, tail captured (2 graphs)")
        self.assertEqual(CallPath("static loop", tail="captured", graphs=1).describe(),
                         "deferred, static loop, tail captured (1 graph)")

    def test_immediate_gives_its_reason(self):
        self.assertEqual(CallPath("immediate", reason="the returned cache cannot be rolled back").describe(),
                         "immediate: the returned cache cannot be rolled back")


if __name__ == "__main__":
    unittest.main()
