"""One tensor-parallel rank of scripts/multi_gpu_bench.py, launched by it as
`python -m torch.distributed.run --nproc-per-node 2 scripts/multi_gpu_tp_worker.py CHECKPOINT RESULTS_DIR ...`.

Loads CHECKPOINT with `tp_plan="auto"` (NCCL on GPUs, gloo on CPU), measures each configuration named with
--configs (scripts/multi_gpu_measure.py: stock and flag alternated in this process) and rewrites
RESULTS_DIR/rank{N}.json after each one, so that a run cut off by its time limit keeps what it finished. Every rank
makes the same generate() calls in the same order: a rank that skipped one would leave its peer waiting in the next
forward's collective, so the ranks decide together whether time is left for the next configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import multi_gpu_measure as mm  # noqa: E402
from tp_worker import tp_kwargs  # noqa: E402  (distributed_config=DistributedConfig(...) on 5.17+, else tp_plan)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("results_dir")
    p.add_argument("--configs", required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--deadline", type=float, required=True, help="time.time() past which no configuration starts")
    args = p.parse_args(argv)

    from transformers import LlamaForCausalLM

    from transformers_async_stop.bench.cases import DTYPES

    rank = int(os.environ["RANK"])
    started = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=DTYPES[args.dtype], **tp_kwargs()).eval()
    device = model.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist = torch.distributed
    report = {"rank": rank, "device": str(device), "load_s": time.perf_counter() - started, "records": [],
              "transformers": __import__("transformers").__version__}
    out = os.path.join(args.results_dir, f"rank{rank}.json")

    def write():
        with open(out + ".tmp", "w") as fh:
            json.dump(report, fh)
        os.replace(out + ".tmp", out)

    write()
    for name in args.configs.split(","):
        # the ranks agree: the next configuration runs on all of them or on none
        late = torch.tensor([float(time.time() > args.deadline)], device=device)
        dist.all_reduce(late, op=dist.ReduceOp.MAX)
        if late.item():
            report["records"].append(mm.error_record(name, "skipped: past the time budget"))
            write()
            continue
        print(f"[rank {rank}] {name} ...", file=sys.stderr, flush=True)
        try:
            record = mm.measure(model, name, args.new_tokens, args.dtype, device, [device], args.reps,
                                align=dist.barrier)
        except Exception as exc:  # noqa: BLE001  (a rank that raised cannot go on in step with its peer)
            traceback.print_exc()
            report["records"].append(mm.error_record(name, f"{type(exc).__name__}: {exc}"))
            write()
            raise
        record["rank"] = rank
        report["records"].append(record)
        write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # as tests/tp_worker.py: leave without the interpreter's teardown, where a torch thread still being joined
    # aborts a rank now and then on a loaded machine after everything was written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
