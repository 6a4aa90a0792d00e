"""The usage fuzzer reads a model's state after a call whose forward torch.compile's CUDA graphs ran, without crashing.

A dynamic rope recomputes `inv_freq` inside the compiled decode forward and keeps it as a buffer: the tensor is an
output of a CUDA-graph-tree run, overwritten by the next run, and torch raises when anything reads it afterwards
("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"). Stock's own model is left so
(the flag runs stock's path for a dynamic rope: `module_state.why_stateful`); the harness's read of the module state
after the call raised outside generate() and the scenario counted as crashed (CUDA usage fuzzer, seed 367, on 5.17,
5.23 and 5.24). The harness now records such a state as unreadable, the same in both runs.
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch

import usage_runner

OVERWRITTEN = ("Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
               "Stack trace: ...")

# seed 367 shrunk by the fuzzer on an H100 (5.24.0)
SEED_367 = {"seed": 367, "family": "llama", "attn": "eager", "do_sample": False, "cache": "user_static",
            "room": "roomy", "compile": True, "rope": {"type": "dynamic", "factor": 4.0, "orig": 8, "max_pos": 8},
            "turns": [{"batch": 4, "left_pad": False, "prompt_len": 8, "user_len": 5, "feed": "full",
                       "cache_position": False, "embeds": False, "max_new_tokens": 7, "eos": None, "processors": [],
                       "criteria": [], "streamer": False, "return_dict": False}]}


class ModuleStateOverwrittenByACompiledRunIsRecordedNotRaised(unittest.TestCase):
    def test_unreadable_state_is_recorded_in_both_runs(self):
        sc = dict(SEED_367, compile=False, rope=None)
        del sc["rope"]

        def unreadable(*args, **kwargs):
            raise RuntimeError(OVERWRITTEN)

        with mock.patch.object(usage_runner, "module_state", unreadable):
            status, detail = usage_runner.check(sc, "cpu")
        self.assertEqual(status, "pass", detail)

    def test_other_runtime_errors_still_raise(self):
        def broken(*args, **kwargs):
            raise RuntimeError("something else")

        with mock.patch.object(usage_runner, "module_state", broken), self.assertRaises(RuntimeError):
            usage_runner.check(dict(SEED_367, compile=False), "cpu")

    @unittest.skipUnless(torch.cuda.is_available(), "CUDA only (torch.compile's CUDA graphs)")
    def test_seed_367_on_cuda(self):
        status, detail = usage_runner.check(SEED_367, "cuda")
        self.assertEqual(status, "pass", detail)


if __name__ == "__main__":
    unittest.main()
