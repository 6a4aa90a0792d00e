"""A found family's recordings across calls (graphs/piecewise/forward.py), on the CPU with the graphs emulated.

Both tests fail on the tree they were written against (found while looking into issue 44's bench artefact); the fixes
belong to graphs/piecewise/ and loops/dynamic_loop/, which this file does not touch:

- `SecondRecordingAtTheSamePosition`: a recording of a found family that ran a function proven by the rules alone is
  kept only once "a second one, at a later position, ran the same ops" (`forward.PiecewiseForward._unproven`). The
  first run's ops wait in `ModelGraphs.first_runs`, keyed by the recording key, which holds no position. So a 2-token
  call (one decode step, at the prompt's length) followed by any call with the same prompt length records twice at
  the same position, and the second recording is kept: the confirmation compared a position with itself.
- `ExpertsSwitchedAtEveryCall`: on CUDA, transformers' `_optimize_model_for_decode` sets a mixture-of-experts model's
  `config._experts_implementation` from "grouped_mm" to "batched_mm" for the decode loop and back after it. The
  dynamic loop asks `piecewise.forward_for` before it enters that block, so the model's snapshot (taken at the first
  recording, inside the block) differs at every call's start: every call is proven again in full (`why_not_model`)
  instead of the once-per-call check of an unchanged model (`why_not_again`, issue 38). The CPU takes no switch
  (`self.device.type != "cpu"`); the test puts CUDA's rule in place.
"""

from __future__ import annotations

import contextlib
import unittest
from unittest import mock

import torch

import transformers_async_stop as tas
from family_models import build_family
from models import TRANSFORMERS_VERSION
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise import forward
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)


def _prompt(length: int = 12):
    ids = torch.arange(3, 3 + length).remainder(45).add(3)[None]
    return ids, torch.ones_like(ids)


def _flag_call(model, ids, mask, tokens: int):
    return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None, async_stopping_criteria=True)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class SecondRecordingAtTheSamePosition(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def test_a_recording_is_kept_only_after_two_positions(self):
        model = build_family("olmo")  # proven by the rules: its recordings wait for a confirmation
        ids, mask = _prompt()
        positions = []  # the decode position of every recording made
        record = forward.PiecewiseForward._record

        def recording(self, key, mask, inputs):
            positions.append(int(inputs["position_ids"][0, -1]))
            return record(self, key, mask, inputs)

        with mock.patch.object(forward.PiecewiseForward, "_record", recording):
            _flag_call(model, ids, mask, 2)  # one decode step: recorded once, at the prompt's length
            self.assertIn("recorded once, to be confirmed", tas.last_path().forward,
                          "precondition: the tiny OLMo's first recording waits for a confirmation")
            _flag_call(model, ids, mask, 8)
        kept = forward.graphs_of(model).recordings
        self.assertTrue(kept, tas.last_path().forward)
        self.assertGreater(len(set(positions)), 1,
                           f"kept after recordings at positions {positions} only: the confirmation compared a "
                           "position with itself")


@contextlib.contextmanager
def _cuda_experts_switch():
    """transformers' `_optimize_model_for_decode` as it runs on CUDA (the CPU's `device.type` test left out)."""
    from transformers.generation.utils import GenerationMixin

    @contextlib.contextmanager
    def optimize(self):
        original = self.get_experts_implementation()
        switch = "grouped_mm" in original.values()
        if switch:
            self.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
        try:
            yield
        finally:
            if switch:
                self.set_experts_implementation(original)

    with mock.patch.object(GenerationMixin, "_optimize_model_for_decode", optimize):
        yield


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class ExpertsSwitchedAtEveryCall(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def test_an_unchanged_moe_model_is_not_proven_again_at_every_call(self):
        model = build_family("mixtral")
        if "grouped_mm" not in model.get_experts_implementation().values():
            self.skipTest("this release's Mixtral does not default to grouped_mm")
        ids, mask = _prompt()
        full = []
        why_not_model = piecewise.why_not_model

        def proven(*args, **kwargs):
            full.append(1)
            return why_not_model(*args, **kwargs)

        with _cuda_experts_switch(), mock.patch.object(piecewise, "why_not_model", proven):
            _flag_call(model, ids, mask, 6)  # records (twice: a found family) and keeps
            self.assertTrue(tas.last_path().forward.startswith("graphed"),
                            f"precondition: the tiny Mixtral takes the graphed forward ({tas.last_path().forward})")
            full.clear()
            _flag_call(model, ids, mask, 6)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        self.assertEqual(full, [], "the second call of an unchanged model was proven again in full: its snapshot "
                                   "(batched_mm) was compared before `_optimize_model_for_decode` switched the "
                                   "experts from grouped_mm again")


if __name__ == "__main__":
    unittest.main()
