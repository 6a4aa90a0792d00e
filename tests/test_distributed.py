"""`synced_gpus=True` across two processes (gloo on CPU): with the flag, the stock loop runs, with one warning and
identical output on every rank. This is where the deferred all-reduce of issue 5 will be tested next."""

from __future__ import annotations

import os
import socket
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results):
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_ASYNC_STOP_FORCE="1")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from models import PAD, build, eos_ids_finishing_at, prompt, stock
        from transformers_async_stop import StockPathWarning

        model = build("llama")
        ids, mask = prompt(batch=2, seed=10 + rank)  # each rank its own prompts: they finish at different steps
        eos = eos_ids_finishing_at(model, ids, mask, [2 + 3 * rank, 4])
        kw = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD, synced_gpus=True)
        with stock():
            ref = model.generate(ids, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, async_stopping_criteria=True, **kw)
        stock_path = sum(issubclass(w.category, StockPathWarning) for w in caught)
        results.put((rank, ref.tolist(), out.tolist(), stock_path))
    finally:
        dist.destroy_process_group()


class SyncedGpus(unittest.TestCase):
    def test_two_ranks_run_stock_with_one_warning_and_identical_output(self):
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        mp.start_processes(_rank_main, args=(_free_port(), results), nprocs=WORLD, join=True,
                           start_method="spawn")
        got = sorted(results.get() for _ in range(WORLD))
        self.assertEqual([rank for rank, *_ in got], list(range(WORLD)))
        for rank, ref, out, warned in got:
            self.assertEqual(ref, out, f"rank {rank}")
            self.assertEqual(warned, 1, f"rank {rank}")
        self.assertNotEqual(got[0][1], got[1][1], "the ranks should generate different sequences")


if __name__ == "__main__":
    unittest.main()
