"""The benchmark command works end to end in its quick CPU mode (the GPU figures need a GPU run)."""

from __future__ import annotations

import json
import os
import tempfile
import unittest

from transformers_async_stop import bench


class QuickBenchmark(unittest.TestCase):
    def test_quick_mode_writes_json_and_markdown_with_exact_outputs(self):
        with tempfile.TemporaryDirectory() as tmp:
            json_path, md_path = os.path.join(tmp, "b.json"), os.path.join(tmp, "b.md")
            code = bench.main(["--quick", "--device", "cpu", "--modes", "eager", "--json", json_path,
                               "--markdown", md_path])
            self.assertEqual(code, 0)
            with open(json_path) as f:
                result = json.load(f)
            with open(md_path) as f:
                markdown = f.read()
        self.assertIn("transformers", json.dumps(result["header"]))
        self.assertTrue(result["runs"])
        for run in result["runs"]:
            self.assertIsNone(run["error"])
            self.assertIs(run["exact"], True, run["label"])  # flag on (forced on CPU) equals stock
            self.assertIsNone(run["variants"]["async"]["syncs_per_step"])  # no CUDA, no sync figures
        self.assertIn("| case |", markdown)


if __name__ == "__main__":
    unittest.main()
