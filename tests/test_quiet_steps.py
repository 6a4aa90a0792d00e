"""Issue 32: the graphed forward skips its per-step staleness checks only where nothing but code the package has read
can have run since the last full check (`graphs/piecewise/quiet.py`).

The call's side: every processor and criterion exactly one of transformers' own pure classes, called through its
class's own `__call__`; no streamer, no user signal handler, no gc callback. The step's side: one thread, no trace,
profile or monitoring function, nothing freed by the cyclic collector. Each condition is pinned by a case that
breaks it. The integration tests run the dynamic-cache loop under the CUDA-graph emulation and compare with stock;
pytest-xdist's workers hold an IO thread of their own, so the single-thread condition is stood in for where a test
needs the skip to happen (`_one_thread`).
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import unittest
from unittest import mock

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import eligibility, quiet, staleness
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)


def _pure():
    return ([lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(5), lp.TopPLogitsWarper(0.9)],
            [sc.MaxLengthCriteria(20), sc.EosTokenCriteria(3)])


class UserTopK(lp.TopKLogitsWarper):
    pass


class UserCriterion(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class CallSide(unittest.TestCase):
    def test_transformers_own_pure_processors_and_criteria_are_read_code(self):
        processors, criteria = _pure()
        self.assertTrue(quiet.between_steps_read(LogitsProcessorList(processors), StoppingCriteriaList(criteria),
                                                 None))

    def test_a_streamer_is_user_code(self):
        processors, criteria = _pure()
        self.assertFalse(quiet.between_steps_read(processors, criteria, object()))

    def test_a_subclass_or_a_processor_holding_a_user_callable_is_not_read(self):
        processors, criteria = _pure()
        for extra in (UserTopK(3), lp.PrefixConstrainedLogitsProcessor(lambda batch, ids: [1, 2], 1)):
            with self.subTest(type(extra).__name__):
                self.assertFalse(quiet.between_steps_read(processors + [extra], criteria, None))

    def test_a_user_criterion_is_not_read(self):
        processors, criteria = _pure()
        self.assertFalse(quiet.between_steps_read(processors, criteria + [UserCriterion()], None))

    def test_a_call_rebound_on_the_class_or_set_on_the_instance_is_not_read(self):
        processors, criteria = _pure()
        own = lp.TopKLogitsWarper.__call__
        with mock.patch.object(lp.TopKLogitsWarper, "__call__", lambda self, ids, scores: own(self, ids, scores)):
            self.assertFalse(quiet.between_steps_read(processors, criteria, None))
        self.assertTrue(quiet.between_steps_read(processors, criteria, None))
        processors[1].__call__ = lambda ids, scores: scores  # what the package's planned call would look up
        self.assertFalse(quiet.between_steps_read(processors, criteria, None))

    def test_a_user_signal_handler_or_gc_callback_is_not_read(self):
        processors, criteria = _pure()
        previous = signal.signal(signal.SIGUSR1, lambda *args: None)
        try:
            self.assertFalse(quiet.between_steps_read(processors, criteria, None))
        finally:
            signal.signal(signal.SIGUSR1, previous)
        callback = lambda phase, info: None  # noqa: E731
        gc.callbacks.append(callback)
        try:
            self.assertFalse(quiet.between_steps_read(processors, criteria, None))
        finally:
            gc.callbacks.remove(callback)
        self.assertTrue(quiet.between_steps_read(processors, criteria, None))


def _one_thread():
    return mock.patch.object(quiet.threading, "active_count", return_value=1)


def _vouch_with_no_garbage(state):
    """Vouch with no cyclic garbage left from earlier tests in this process: a collection triggered by the next
    allocation would free it, and rightly break the vouch."""
    gc.collect()
    state.vouch()


class StepSide(unittest.TestCase):
    def test_nothing_vouches_before_a_full_check(self):
        with _one_thread():
            self.assertFalse(quiet.Quiet(True).still())

    def test_a_call_with_user_code_is_never_vouched_for(self):
        state = quiet.Quiet(False)
        state.vouch()
        with _one_thread():
            self.assertFalse(state.still())

    def test_a_vouched_step_stays_quiet_until_something_else_could_run(self):
        state = quiet.Quiet(True)
        _vouch_with_no_garbage(state)
        with _one_thread():
            self.assertTrue(state.still())
            state.lapse()
            self.assertFalse(state.still())

    def test_another_thread_breaks_it(self):
        state = quiet.Quiet(True)
        state.vouch()
        release = threading.Event()
        thread = threading.Thread(target=release.wait)
        thread.start()
        try:
            self.assertFalse(state.still())
        finally:
            release.set()
            thread.join()

    def test_a_trace_or_profile_function_breaks_it(self):
        state = quiet.Quiet(True)
        for setter in (sys.settrace, sys.setprofile):
            with self.subTest(setter.__name__), _one_thread():
                _vouch_with_no_garbage(state)
                previous = sys.gettrace() if setter is sys.settrace else sys.getprofile()
                setter(lambda *args: None)
                try:
                    still = state.still()
                finally:
                    setter(previous)
                self.assertFalse(still)
                self.assertTrue(state.still())

    def test_an_object_freed_by_the_cyclic_collector_breaks_it(self):
        state = quiet.Quiet(True)
        state.vouch()

        class Cycle:
            pass

        first, second = Cycle(), Cycle()
        first.other, second.other = second, first
        del first, second
        gc.collect()
        with _one_thread():
            self.assertFalse(state.still())
            _vouch_with_no_garbage(state)
            self.assertTrue(state.still())


class Knob(StoppingCriteria):
    """A user criterion that turns a model attribute the replay bakes in (the final norm's epsilon) at one length."""

    def __init__(self, model, length):
        self.model, self.length = model, length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.model.model.norm.variance_epsilon = 0.5
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict("os.environ", {eligibility.PIECEWISE_ENV: "1"})
class QuietCallsSkipTheChecks(unittest.TestCase):
    """The dynamic-cache loop under the emulation: how often the staleness comparison runs, and the outputs."""

    def setUp(self):
        self.enterContext(emulated())
        self.model = build("llama").eval()
        self.ids, self.mask = prompt(batch=1)

    def _run(self, flag, **kwargs):
        torch.manual_seed(3)
        extra = {"async_stopping_criteria": True} if flag else {}
        with torch.no_grad():
            return self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=10, pad_token_id=PAD,
                                       eos_token_id=None, return_dict_in_generate=True, output_scores=True,
                                       **extra, **kwargs)

    def _counted(self, **kwargs):
        """(output, how many times `ModelGraphs.changed` ran, the path's forward) of a flag-on call."""
        calls = []
        own = staleness.ModelGraphs.changed

        def counting(graphs):
            calls.append(1)
            return own(graphs)

        gc.collect()  # earlier tests' cyclic garbage, freed mid-call, would (rightly) make a step check in full
        with mock.patch.object(staleness.ModelGraphs, "changed", counting):
            out = self._run(True, **kwargs)
        return out, len(calls), tas.last_path().forward

    def test_a_call_of_transformers_own_processors_compares_once_and_equals_stock(self):
        kwargs = dict(do_sample=True, top_k=5, temperature=0.8)
        with stock():
            want = self._run(False, **kwargs)
        with _one_thread():
            got, compared, path = self._counted(**kwargs)
        assert_same(self, want, got)
        self.assertTrue(path.startswith("graphed"), path)
        # the first decode step records, the second compares in full and vouches, the rest skip
        self.assertEqual(compared, 1, path)

    def test_another_thread_keeps_every_comparison(self):
        release = threading.Event()
        thread = threading.Thread(target=release.wait)
        thread.start()
        try:
            _, compared, path = self._counted(do_sample=False)
        finally:
            release.set()
            thread.join()
        replayed = int(path.split(": ")[1].split(" ")[0])  # "graphed (N pieces): K decode steps"
        self.assertEqual(compared, replayed - 1, path)  # every replay but the recording's own step

    def test_a_user_criterion_keeps_every_comparison_and_its_change_is_seen(self):
        length = self.ids.shape[1] + 5
        with stock():
            want = self._run(False, do_sample=False, stopping_criteria=StoppingCriteriaList([Knob(self.model,
                                                                                                   length)]))
        self.model.model.norm.variance_epsilon = self.model.config.rms_norm_eps
        with _one_thread():
            got, compared, path = self._counted(do_sample=False,
                                                stopping_criteria=StoppingCriteriaList([Knob(self.model, length)]))
        assert_same(self, want, got)
        self.assertGreater(compared, 1, path)


if __name__ == "__main__":
    unittest.main()
