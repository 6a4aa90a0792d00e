"""A greedy verify round's acceptance replayed from one CUDA graph per width (`loops/assisted/acceptance_graph.py`,
issue 38): bit-exact against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state
after the call, the streamer's tokens), and `last_path().acceptance` says which rounds replayed and why the others
did not. On CUDA (skipped without it) and on the CPU with the graphs emulated; the CPU without the emulation says
why it stays eager."""

from __future__ import annotations

import os
import unittest
import warnings
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.loops.assisted import acceptance_graph
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate

RELEASES = (4, 57) <= TRANSFORMERS_VERSION <= (5, 24)  # the releases of the package's assisted loop
CUDA = torch.cuda.is_available() and RELEASES
# a prompt that repeats: prompt lookup finds candidates of several widths, and none (width 1) in some rounds
REPEATS = [[3, 4, 5, 6, 3, 4, 5, 7, 3, 4]]
# an EOS id for prompt lookup: 4.57-5.0's lookup generator compares the candidates with the EOS ids (`isin`), and
# raises without one
LOOKUP_EOS = 1


class TokenLog:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.tolist())

    def end(self):
        self.tokens.append("end")


class _Cases:
    DEVICE = "cuda"

    def setUp(self):
        self.enterContext(mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"}))
        self.target = build("llama", device=self.DEVICE)
        self.helper = build("llama", seed=1, device=self.DEVICE)
        # drafts of one length: every round after the first two replays (a confidence threshold or the "heuristic"
        # schedule make widths that a call may see once each: those rounds stay eager, "width K seen once")
        self.helper.generation_config.num_assistant_tokens_schedule = "constant"
        self.helper.generation_config.num_assistant_tokens = 3
        self.helper.generation_config.assistant_confidence_threshold = 0.0
        self.ids = prompt(batch=1, device=self.DEVICE)[0]

    def _against_stock(self, ids=None, **kwargs):
        ids = self.ids if ids is None else ids
        mask = torch.ones_like(ids)
        kwargs = {"max_new_tokens": 30, "do_sample": False, "eos_token_id": None, **kwargs}
        with stock():
            ref, ref_after = _generate(self.target, ids, mask, None, **kwargs)
        out, after = _generate(self.target, ids, mask, True, **kwargs)
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
        return tas.last_path()

    def test_a_greedy_draft_round_replays_its_acceptance_and_equals_stock(self):
        path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_prompt_lookup_of_several_widths_replays_and_equals_stock(self):
        ids = torch.tensor(REPEATS, device=self.DEVICE)
        path = self._against_stock(ids, prompt_lookup_num_tokens=3, eos_token_id=LOOKUP_EOS)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_eos_among_the_candidates_and_a_clipped_last_round_equal_stock(self):
        # the EOS id is one the draft proposes: some rounds cut after it, the call stops on it or on its length
        for eos, new in ((int(self.ids[0, -1]), 31), (5, 17), ([5, 9], 23)):
            path = self._against_stock(assistant_model=self.helper, eos_token_id=eos, max_new_tokens=new)
            self.assertIsNotNone(path.acceptance)

    def test_the_streamer_gets_stocks_tokens(self):
        logs = []
        for flag in (None, True):
            log = TokenLog()
            context = stock() if flag is None else mock.patch.dict(os.environ, {})
            with context:
                _generate(self.target, self.ids, torch.ones_like(self.ids), flag, assistant_model=self.helper,
                          max_new_tokens=20, do_sample=False, eos_token_id=None, streamer=log)
            logs.append(log.tokens)
        self.assertEqual(logs[0], logs[1])
        self.assertTrue(tas.last_path().acceptance.startswith("graphed"), tas.last_path().acceptance)

    def test_a_user_processor_writing_the_logits_in_place_equals_stock(self):
        class Halve(LogitsProcessor):
            def __call__(self, input_ids, scores):
                scores[:, ::2] /= 2
                return scores

        path = self._against_stock(assistant_model=self.helper, logits_processor=LogitsProcessorList([Halve()]))
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_sampling_keeps_the_acceptance_eager_and_equals_stock(self):
        torch.manual_seed(0)
        path = self._against_stock(assistant_model=self.helper, do_sample=True)
        self.assertEqual(path.acceptance, "eager: sampling (its random draws stay eager)")

    def test_the_switch_keeps_every_round_eager_and_says_so(self):
        with mock.patch.dict(os.environ, {acceptance_graph.ENV: "0"}):
            path = self._against_stock(assistant_model=self.helper)
        self.assertEqual(path.acceptance, f"eager: {acceptance_graph.ENV}=0")

    def test_the_widths_per_call_are_capped(self):
        ids = torch.tensor(REPEATS, device=self.DEVICE)
        with mock.patch.object(acceptance_graph, "MAX_WIDTHS", 1):
            path = self._against_stock(ids, prompt_lookup_num_tokens=3, eos_token_id=LOOKUP_EOS)
        self.assertIn("more than 1 widths in one call", path.acceptance)

    def test_a_failed_capture_runs_the_rest_eagerly_with_a_warning_and_equals_stock(self):
        def refused(self, inputs):
            raise RuntimeError("refused on purpose")

        with mock.patch.object(acceptance_graph.GraphedAcceptance, "_body", refused), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(any("could not be captured" in str(w.message) for w in caught))
        self.assertIn("eager: the acceptance could not be captured", path.acceptance)

    def test_an_interrupt_inside_the_capture_propagates_and_the_next_call_equals_stock(self):
        def interrupted(self, inputs):
            raise KeyboardInterrupt

        with mock.patch.object(acceptance_graph.GraphedAcceptance, "_body", interrupted):
            with self.assertRaises(KeyboardInterrupt):
                _generate(self.target, self.ids, torch.ones_like(self.ids), True, assistant_model=self.helper,
                          max_new_tokens=30, do_sample=False, eos_token_id=None)
        torch.manual_seed(0)
        self._against_stock(assistant_model=self.helper, do_sample=True)
        path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_the_graphs_are_freed_with_the_call(self):
        made = []
        original = acceptance_graph.GraphedAcceptance.__init__

        def keep(self, *args, **kwargs):
            original(self, *args, **kwargs)
            made.append(self)

        with mock.patch.object(acceptance_graph.GraphedAcceptance, "__init__", keep):
            self._against_stock(assistant_model=self.helper)
        self.assertEqual(len(made), 1)
        self.assertGreater(made[0].replayed, 0)
        self.assertEqual((made[0].graphs, made[0].pool), ({}, None))


@unittest.skipUnless(CUDA, "CUDA and the releases of the package's assisted loop")
class AcceptanceGraphOnCuda(_Cases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the releases of the package's assisted loop")
class AcceptanceGraphEmulatedOnCpu(_Cases, unittest.TestCase):
    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())
        super().setUp()


@unittest.skipUnless(RELEASES, "the releases of the package's assisted loop")
class AcceptanceOnTheCpu(unittest.TestCase):
    def test_the_cpu_keeps_the_acceptance_eager_and_says_why(self):
        target, helper = build("llama"), build("llama", seed=1)
        ids = prompt(batch=1)[0]
        _generate(target, ids, torch.ones_like(ids), True, assistant_model=helper, max_new_tokens=10,
                  do_sample=False, eos_token_id=None)
        self.assertEqual(tas.last_path().acceptance, "eager: not CUDA (cpu)")
