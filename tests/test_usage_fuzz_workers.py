"""scripts/usage_fuzz.py --workers: a worker that dies (on CUDA, a device-side assert ends the process's context and
every later scenario in it) does not hide the seeds after it. The seed it died on is counted as crashed, with its
seed, the rest of its slice runs in a fresh worker, and the totals account for every seed. Shown on the CPU with the
script's test-only TAS_USAGE_FUZZ_FAKE knob (a seed that ends its process with os._exit, one that reports a
device-side assert, every other seed passing without being run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "usage_fuzz.py")


def _fuzz(fake: str, seeds: str, workers: int = 2):
    out = os.path.join(tempfile.mkdtemp(prefix="usage_workers_"), "out.json")
    env = {**os.environ, "TAS_USAGE_FUZZ_FAKE": fake}
    proc = subprocess.run([sys.executable, SCRIPT, "--only", seeds, "--workers", str(workers), "--shrink", "0",
                           "--json", out], env=env, capture_output=True, text=True, timeout=300)
    with open(out) as f:
        return proc, json.load(f)


class DeadWorkersHideNoSeeds(unittest.TestCase):
    def test_the_seeds_after_a_dead_worker_run_in_a_fresh_one(self):
        # worker slices [0, 2, 4, 6] and [1, 3, 5, 7]: seed 2 ends its process, seed 5 is a device-side assert (its
        # worker stops there), and seed 4, the first of the re-run slice, kills the fresh worker too
        proc, data = _fuzz("2:exit,4:exit,5:assert,*:pass", "0,1,2,3,4,5,6,7")
        self.assertEqual(data["seeds"], {"0": "pass", "1": "pass", "2": "crashed", "3": "pass", "4": "crashed",
                                         "5": "crashed", "6": "pass", "7": "pass"}, proc.stdout + proc.stderr)
        counts = data["counts"]
        self.assertEqual((counts["drawn"], counts["passed"], counts["crashed"], counts.get("not_run", 0)),
                         (8, 5, 3, 0))
        self.assertEqual(sorted(f["seed"] for f in data["failures"]), [2, 4, 5])
        self.assertIn("accounted=8/8", proc.stdout)
        self.assertNotEqual(proc.returncode, 0)

    def test_a_run_without_deaths_counts_every_seed_once(self):
        proc, data = _fuzz("*:pass", "10,11,12", workers=2)
        self.assertEqual(data["seeds"], {"10": "pass", "11": "pass", "12": "pass"}, proc.stdout + proc.stderr)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)


if __name__ == "__main__":
    unittest.main()
