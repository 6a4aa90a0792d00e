"""scripts/multi_gpu_bench.py works end to end in its CPU mode (`--device cpu --tiny`): the device_map split and
tensor parallelism (2 gloo ranks) with both caches, stock and flag alternated, token ids compared; its figures come
from a run on two GPUs. No assertion here is about time.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import tempfile
import types
import unittest

import pytest

import torch

from transformers_async_stop import is_patched

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")
sys.path.insert(0, SCRIPTS)

import multi_gpu_bench  # noqa: E402
import multi_gpu_measure as mm  # noqa: E402

# heavy: the whole of it runs on 5.17.0 and 5.24.0 in CI (noxfile `SLOW_ON`), the rest of the releases skip it
pytestmark = pytest.mark.slow


class TinyCpuRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        json_path, md_path = (os.path.join(cls.tmp.name, name) for name in ("run.json", "run.md"))
        # in this process (an interpreter fewer to start); one rep of 4 tokens: the two ranks' start-up (two more
        # interpreters importing transformers) is most of the time
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = multi_gpu_bench.main(["--device", "cpu", "--tiny", "--reps", "1", "--new-tokens", "4",
                                         "--json", json_path, "--markdown", md_path])
        cls.proc = types.SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())
        cls.patched_after = is_patched()
        cls.result = cls.markdown = None
        if os.path.exists(json_path):
            with open(json_path) as fh:
                cls.result = json.load(fh)
            with open(md_path) as fh:
                cls.markdown = fh.read()
        cls.records = {r["config"]: r for r in (cls.result or {}).get("records", [])}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_default_configuration_ran_with_equal_token_ids(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        self.assertEqual(sorted(self.records), sorted(mm.DEFAULT_CONFIGS))
        for name, record in self.records.items():
            self.assertIsNone(record["error"], name)
            self.assertTrue(record["stock_repeatable"], name)
            self.assertTrue(record["equal"], name)
            self.assertEqual(record["new_tokens"], 4)

    def test_stock_and_flag_alternate_and_report_their_paths(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        self.assertTrue(self.patched_after, "the run left transformers unpatched")
        for name, record in self.records.items():
            self.assertEqual(sorted(record["variants"]), ["flag", "stock"])
            self.assertEqual(record["order"], [["stock", "flag"]], "one rep: stock, then the flag")
            self.assertEqual(record["variants"]["stock"]["path"], "transformers as shipped")
            # on CPU the flag's deferred path is forced, as in the bench
            self.assertTrue(record["variants"]["flag"]["path"].startswith("deferred"), name)
            for entry in record["variants"].values():
                # (t_N - t_1) / (N - 1): a difference of two timings, which CPU noise can make negative; no timing
                # is asserted, only that one was measured
                self.assertIsInstance(entry["ms_per_token"], float)
                self.assertTrue(math.isfinite(entry["ms_per_token"]))
                self.assertIsNone(entry["syncs_per_step"], "syncs are counted on CUDA only")
                self.assertIsNone(entry["busy"], "GPU busy is measured on CUDA only")

    def test_tensor_parallel_ranks_are_merged(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        for name in (n for n in mm.DEFAULT_CONFIGS if n.startswith("tp")):
            record = self.records[name]
            self.assertTrue(record["ranks_agree"], name)
            self.assertEqual([r["rank"] for r in record["rank_records"]], [0, 1])
            for entry in record["variants"].values():
                self.assertEqual(len(entry["ms_per_token_ranks"]), 2)
                self.assertEqual(entry["paths_ranks"][0], entry["paths_ranks"][1])

    def test_markdown_table_has_a_row_per_configuration(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        self.assertIn(self.markdown.strip(), self.proc.stdout)
        rows = [line for line in self.markdown.splitlines() if line.startswith("| device_map")
                or line.startswith("| tensor parallel")]
        self.assertEqual(len(rows), len(mm.DEFAULT_CONFIGS))


class Pieces(unittest.TestCase):
    def test_busy_time_counts_overlapping_intervals_once(self):
        self.assertEqual(mm.union_length([(5, 7), (0, 2), (1, 3), (6, 6.5), (10, 11)]), 3 + 2 + 1)

    def test_balanced_map_puts_half_the_layers_on_each_device(self):
        model = multi_gpu_bench.build(mm.llama_config(tiny=True, layers=4), torch.device("cpu"), torch.float32)
        device_map = multi_gpu_bench.balanced_map(model, [torch.device("cuda", 0), torch.device("cuda", 1)])
        self.assertEqual([device_map[f"model.layers.{i}"] for i in range(4)], [0, 0, 1, 1])
        self.assertEqual((device_map["model.embed_tokens"], device_map["model.norm"], device_map["lm_head"]),
                         (0, 1, 1))
        # every parameter is placed
        covered = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
        self.assertTrue(all(any(c == k or c.startswith(k + ".") for k in device_map) for c in covered))

    def test_the_8b_shape(self):
        config = mm.llama_config(tiny=False)
        self.assertEqual((config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                          config.num_key_value_heads, config.intermediate_size, config.vocab_size),
                         (4096, 32, 32, 8, 14336, 128256))


if __name__ == "__main__":
    unittest.main()
