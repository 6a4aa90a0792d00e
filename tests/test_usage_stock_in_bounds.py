"""The usage fuzzer never makes stock itself index out of bounds in a scenario drawn for CUDA.

On CUDA an out-of-bounds index in stock is a device-side assert: the process's CUDA context is gone, so the fuzzer
cannot compare anything after it (GPU run, seeds 1166, 1579, 1710, 524, 558, 598, 820 on 5.17/5.23/5.24). Two
harness causes, both stock's own overflow, reproduced here on CPU, where they are an IndexError:
- a user StaticCache sized from the positions left written after each turn: a cache reset mid-call (a mutator)
  zeroes what was written before it, the size under-counts and stock's own update overflows. The sizing run now
  records each layer's high-water mark;
- the `mutate_ids` processor after a widening `Width` wrote token ids modulo the widened score width, past the
  model's vocabulary: stock's next forward (or a nested judge's) indexed the embedding past its end.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized

from models import TRANSFORMERS_VERSION, VOCAB, stock

import usage_callbacks
import usage_runner
from usage_scenarios import draw

# drawn for CUDA (the scenarios the GPU run drew), run here on CPU
CUDA_ASSERT_SEEDS = (1166, 1579, 524, 558, 598, 820)


class StockStaysInBoundsInCudaScenarios(unittest.TestCase):
    @parameterized.expand([(s,) for s in CUDA_ASSERT_SEEDS])
    def test_stock_run_raises_no_index_error(self, seed):
        sc = draw(seed, "cuda")
        rooms = usage_runner._rooms(sc, "cpu")
        with stock():
            ref = usage_runner.run_scenario(sc, False, "cpu", rooms)
        if TRANSFORMERS_VERSION < (5, 17) and ref.stock_err is not None:
            # before 5.17 the input preparation cannot take a turn that feeds only the new tokens to a user cache: its
            # cache_position comes out empty and stock raises a host-side IndexError of its own (no overflow,
            # no device assert). Only that one is allowed there.
            where = ref.where[ref.stock_err[0]]
            self.assertIn("_cache_dependant_input_preparation", where, ref.stock_err)
            return
        self.assertFalse(ref.stock_err is not None and ref.stock_err[1] == "IndexError", ref.stock_err)


class MutateIdsAfterWidenStaysInVocab(unittest.TestCase):
    def test_ids_written_are_token_ids_of_the_model(self):
        proc = usage_callbacks.Proc({"kind": "mutate_ids"}, usage_callbacks.Context(None, None))
        widened = torch.zeros(VOCAB, VOCAB + 5)
        written = []
        for _ in range(3):  # (it edits every third call)
            ids = torch.arange(VOCAB).unsqueeze(1)  # every token id as a row's last one
            proc(ids, widened)
            written.append(ids[:, -1])
        self.assertTrue(all(int(w.max()) < VOCAB for w in written), written)

if __name__ == "__main__":
    unittest.main()
