"""`synced_gpus=True` across two processes (gloo on CPU, the deferred path forced).

On 5.17+ the peers' "all finished?" all-reduce is deferred one call (`_PeerVerdict`): every rank must return exactly
what stock returns, all ranks stop at the same step, and the one extra step (a forward on every rank) is undone.
On 5.0-5.16 the loop itself reads its verdict tensor for `continue`, so the flag runs the stock loop with one warning;
so does a returned cache (an early peer's padding positions would hold a different token than stock's).
"""

from __future__ import annotations

import datetime
import os
import socket
import unittest
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parameterized import parameterized

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, scenario: str, results, backend: str = "gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_ASYNC_STOP_FORCE="1",
                      NCCL_NVLS_ENABLE="0")
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    # a rank that stopped at another step would leave its peer waiting in a collective: fail, don't hang
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        from models import PAD, CountForwards, build, eos_ids_finishing_at, prompt, stock
        from transformers_async_stop import StockPathWarning

        model = build("llama", device=device)
        ids, mask = prompt(batch=2, seed=10 + rank, device=device)  # each rank its own prompts
        if scenario == "syncs":  # blocking syncs per decode step; both ranks make the same calls, in step
            from test_cuda import syncs_per_step

            with stock():
                stock_syncs = syncs_per_step(model, ids, mask, synced_gpus=True)
            flag_syncs = syncs_per_step(model, ids, mask, synced_gpus=True, async_stopping_criteria=True)
            results.put((rank, stock_syncs, flag_syncs))
            return
        kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=PAD, synced_gpus=True)
        if scenario == "ranks_finish_apart":  # rank 0 early, rank 1 late: rank 0 keeps stepping, appending nothing
            kw["eos_token_id"] = eos_ids_finishing_at(model, ids, mask, [1 + 5 * rank, 2 + 5 * rank])
        elif scenario == "max_length":
            kw["eos_token_id"] = None
        elif scenario == "sampling":
            kw.update(eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, 3 + rank]), do_sample=True, top_k=5)
        elif scenario == "returned_cache":  # stock path: an early peer's padding positions would differ
            kw.update(eos_token_id=eos_ids_finishing_at(model, ids, mask, [1 + 5 * rank, 2 + 5 * rank]),
                      return_dict_in_generate=True, output_scores=True)

        def run(flag):
            counter = CountForwards(model)
            torch.manual_seed(100 + rank)
            if device != "cpu":
                torch.cuda.manual_seed(100 + rank)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                extra = {} if flag is None else {"async_stopping_criteria": flag}
                out = model.generate(ids, **kw, **extra)
            counter.close()
            warned = sum(issubclass(w.category, StockPathWarning) for w in caught)
            return out, counter.count, warned, torch.rand(2, device=device).tolist()

        with stock():
            ref, ref_forwards, _, ref_after = run(None)
        out, forwards, warned, after = run(True)
        if scenario == "returned_cache":
            same_scores = len(ref.scores) == len(out.scores) and all(
                torch.equal(a, b) for a, b in zip(ref.scores, out.scores))
            ref, out = ref.sequences, out.sequences
        else:
            same_scores = True
        results.put((rank, ref.tolist(), out.tolist(), same_scores, ref_after == after, forwards - ref_forwards,
                     warned))
    finally:
        # both ranks reach teardown before either closes its connections (gloo aborts a peer that closes early)
        dist.barrier()
        dist.destroy_process_group()


def _spawn(scenario, backend="gloo"):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_rank_main, args=(_free_port(), scenario, results, backend), nprocs=WORLD,
                               join=False, start_method="spawn")
    got = []
    try:
        for _ in range(WORLD):
            got.append(results.get(timeout=240))  # a rank that died before reporting fails here
    finally:
        try:
            while not procs.join():
                pass
        except mp.ProcessExitedException as exc:
            if len(got) < WORLD:
                raise
            # Both ranks reported; gloo occasionally aborts a process while it tears down its connections
            # ("terminate called without an active exception"). The results above are what the test checks.
            warnings.warn(f"a rank crashed after reporting its results, during teardown: {exc}")
    return sorted(got)


class SyncedGpus(unittest.TestCase):
    backend = "gloo"

    @parameterized.expand([("ranks_finish_apart",), ("max_length",), ("sampling",), ("returned_cache",)])
    def test_every_rank_returns_stock_output(self, scenario):
        import transformers.generation.utils as gen_utils

        deferred = hasattr(gen_utils, "DeferredStopCheck") and scenario != "returned_cache"
        got = _spawn(scenario, self.backend)
        self.assertEqual([r[0] for r in got], list(range(WORLD)))
        extra_steps = set()
        for rank, ref, out, same_scores, same_rng, extra_forwards, warned in got:
            self.assertEqual(ref, out, f"rank {rank}: sequences")
            self.assertTrue(same_scores, f"rank {rank}: scores")
            self.assertTrue(same_rng, f"rank {rank}: RNG state after generate()")
            self.assertEqual(warned, 0 if deferred else 1, f"rank {rank}: StockPathWarning count")
            extra_steps.add(extra_forwards)
        # all ranks took the same number of steps: deferred, exactly one more forward than stock (the peers' sum is
        # read one call late, also after a max_length stop: that forward appends nothing, and no cache is returned)
        self.assertEqual(extra_steps, {1 if deferred else 0})
        if scenario == "ranks_finish_apart":  # the ranks really stopped at different lengths
            self.assertNotEqual(len(got[0][1][0]), len(got[1][1][0]))


@unittest.skipUnless(torch.cuda.is_available() and torch.cuda.device_count() >= WORLD, "needs two CUDA devices")
class SyncedGpusNccl(SyncedGpus):
    """The same, one process per GPU over NCCL (NVLink multicast off)."""

    backend = "nccl"

    def test_no_blocking_sync_per_step(self):
        import transformers.generation.utils as gen_utils

        from models import TRANSFORMERS_VERSION

        got = _spawn("syncs", self.backend)
        for rank, stock_syncs, flag_syncs in got:
            print(f"\nSYNCS transformers={'.'.join(map(str, TRANSFORMERS_VERSION))} case=synced_gpus rank={rank} "
                  f"stock={stock_syncs:.2f} flag_on={flag_syncs:.2f}")
            self.assertGreaterEqual(stock_syncs, 2.0)
            if hasattr(gen_utils, "DeferredStopCheck"):  # 5.17+: deferred; older releases run stock, warned
                self.assertEqual(flag_syncs, 0.0)


if __name__ == "__main__":
    unittest.main()
