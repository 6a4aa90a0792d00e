"""One rank of the tensor-parallel check, run by `tests/test_tensor_parallel.py` under
`python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py CHECKPOINT RESULTS_DIR`.

Loads the checkpoint with `tp_plan="auto"` (gloo on CPU with the deferred path forced, NCCL on GPUs), runs each
scenario with stock transformers (patches removed) and with the flag, and writes what it saw to
RESULTS_DIR/rank{N}.json. All ranks feed the same inputs: a rank that stopped at another step than its peers would
leave them waiting in the next forward's collective (the caller's timeout turns that into a failure).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def tp_kwargs() -> dict:
    """`distributed_config=DistributedConfig(tp_plan=...)` where it exists (5.17+), else the older keyword."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    if "tp_plan" in inspect.signature(DistributedConfig).parameters:
        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    return {"tp_plan": "auto"}


HIDDEN = 32


def _local_rows(weight) -> int:
    """Output rows this rank holds (a DTensor in newer releases, a plain shard in 5.0)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return int(local.shape[0])


def build_checkpoint(path: str) -> None:
    """A tiny Llama whose head counts split over 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    LlamaForCausalLM(config).save_pretrained(path)


def main(checkpoint: str, results_dir: str) -> None:
    from transformers import LlamaForCausalLM

    from models import PAD, CountForwards, eos_ids_finishing_at, prompt, stock

    rank = int(os.environ["RANK"])
    model = LlamaForCausalLM.from_pretrained(checkpoint, **tp_kwargs()).eval()
    device = model.device
    ids, mask = prompt(batch=3, left_pad=True, device=device)
    eos = eos_ids_finishing_at(model, ids, mask, [2, 6, 4], max_new_tokens=12)
    scenarios = {
        "eos_rows_apart": dict(eos_token_id=eos, return_dict_in_generate=True, output_scores=True),
        "sampling": dict(eos_token_id=eos, do_sample=True, top_k=8),
        "max_length": dict(eos_token_id=None),
    }
    report = {"rank": rank, "device": str(device), "q_rows": _local_rows(model.model.layers[0].self_attn.q_proj.weight),
              "transformers": __import__("transformers").__version__, "scenarios": {}}
    for name, kw in scenarios.items():
        got = {}
        for label, flag in (("stock", None), ("flag", True)):
            counter = CountForwards(model)
            torch.manual_seed(7)
            extra = {} if flag is None else {"async_stopping_criteria": True}
            with stock() if flag is None else contextlib.nullcontext():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, **kw, **extra)
            counter.close()
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            scores = [s.float().sum().item() for s in getattr(out, "scores", None) or ()]
            got[label] = {"sequences": sequences.tolist(), "scores": scores, "forwards": counter.count,
                          "rng_after": torch.rand(2).tolist()}
        report["scenarios"][name] = got
    if device.type == "cuda":
        from test_cuda import syncs_per_step

        with stock():
            report["syncs_stock"] = syncs_per_step(model, ids, mask)
        report["syncs_flag"] = syncs_per_step(model, ids, mask, async_stopping_criteria=True)
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    # transformers opened the process group (tp_plan="auto"); left open, gloo's threads can outlive the interpreter
    # and abort the rank at exit ("terminate called without an active exception"), seen once on a loaded 2-core CI
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # the report is written and the process group destroyed: leave without the interpreter's teardown. A thread of
    # torch's (gloo's or the store's) still being joined there aborts the rank now and then on a 2-core machine,
    # even after destroy_process_group ("terminate called without an active exception", SIGABRT; CI-like runs on
    # 4.57.6, 2026-11-25), which fails the run after every rank has reported
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
