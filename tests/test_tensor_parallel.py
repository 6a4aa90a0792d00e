"""Tensor parallelism (`tp_plan="auto"` under torchrun, 2 ranks): every rank stops at the same step and returns
what stock returns.

On CPU (CI) the ranks talk over gloo with the deferred path forced; with two GPUs, over NCCL, where each rank also
counts its blocking syncs per decode step. The ranks run `tests/tp_worker.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

import torch

from tp_worker import HIDDEN, build_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel(unittest.TestCase):
    cuda = False

    @classmethod
    def setUpClass(cls):

        cls.tmp = tempfile.TemporaryDirectory()
        checkpoint = os.path.join(cls.tmp.name, "ckpt")
        build_checkpoint(checkpoint)
        env = dict(os.environ, TRANSFORMERS_ASYNC_STOP_FORCE="1", NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
        if not cls.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU even on a GPU machine
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port", str(_free_port()),
               os.path.join(HERE, "tp_worker.py"), checkpoint, cls.tmp.name]
        # a rank stopping at another step than its peer would hang in the next collective: fail instead
        cls.proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        cls.reports = []
        for rank in range(WORLD):
            path = os.path.join(cls.tmp.name, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    cls.reports.append(json.load(fh))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_rank_reported(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stderr[-4000:])
        self.assertEqual([r["rank"] for r in self.reports], list(range(WORLD)))
        for report in self.reports:
            self.assertEqual(report["q_rows"], HIDDEN // WORLD, "q_proj was not split over the ranks")
            self.assertEqual(report["device"].split(":")[0], "cuda" if self.cuda else "cpu")

    def test_flag_matches_stock_on_every_rank(self):
        self.assertEqual(len(self.reports), WORLD, self.proc.stderr[-4000:])
        for report in self.reports:
            for name, got in report["scenarios"].items():
                where = f"rank {report['rank']}, {name}"
                self.assertEqual(got["stock"]["sequences"], got["flag"]["sequences"], where)
                self.assertEqual(got["stock"]["scores"], got["flag"]["scores"], where)
                self.assertEqual(got["stock"]["rng_after"], got["flag"]["rng_after"], where)
                # the verdict is read one step late: one extra forward (undone) unless max_length ended the call
                extra = 0 if name == "max_length" else 1
                self.assertEqual(got["flag"]["forwards"], got["stock"]["forwards"] + extra, where)

    def test_ranks_agree(self):
        self.assertEqual(len(self.reports), WORLD, self.proc.stderr[-4000:])
        first = self.reports[0]["scenarios"]
        for report in self.reports[1:]:
            for name, got in report["scenarios"].items():
                self.assertEqual(got["flag"]["sequences"], first[name]["flag"]["sequences"], name)
                self.assertEqual(got["flag"]["forwards"], first[name]["flag"]["forwards"], name)


@unittest.skipUnless(torch.cuda.is_available() and torch.cuda.device_count() >= WORLD, "needs two CUDA devices")
class TensorParallelNccl(TensorParallel):
    """The same on two GPUs over NCCL; each rank also counts its blocking syncs per decode step."""

    cuda = True

    def test_no_blocking_sync_per_step_with_the_flag(self):
        self.assertEqual(len(self.reports), WORLD, self.proc.stderr[-4000:])
        for report in self.reports:
            print(f"\nSYNCS tp rank={report['rank']} transformers={report['transformers']} "
                  f"stock={report['syncs_stock']:.2f} flag_on={report['syncs_flag']:.2f}")
            self.assertEqual(report["syncs_flag"], 0.0)
            self.assertGreaterEqual(report["syncs_stock"], 1.0)


if __name__ == "__main__":
    unittest.main()
