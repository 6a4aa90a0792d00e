"""What proving a family costs (issue 36's design note, docs/design/family-proof.md), on the CPU under the CUDA-graph
emulation:

    python3 scripts/family_proof_cost.py [--layers 16] [--steps 64] [--runs 3]

For a Llama shaped like Llama-3.2-1B by module count (16 layers, narrow: the proof's cost depends on the code that
runs and the modules, not the widths), three ways of taking the graphed decode forward:
- `hand-read`: Llama as today, proven by its digested sources (`targets/piecewise_rows.py`);
- `found`: the same model with Llama left out of the hand-read families, so it is found by `proof/discover.py` and
  proven per recording (`proof/verdict.py`: its sources are the read ones, so one recording suffices);
- `found+checked`: Olmo of the same shape (its attention and layer norm differ from the read code: proven by the
  rules, and confirmed by a second recording at the next position).
For each: the first call's recording time (every `graphs.record` call, the watch and the verdict included), the
verdict's own time, and the per-step host time of the checks before each replay (`WatchSet.why_eager`, `_step`,
`ModelGraphs.changed`), median over the runs. Not a test: no assertion.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from unittest import mock

os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop.graphs.piecewise import forward, graphs, proof  # noqa: E402
from transformers_async_stop.testing.emulation import emulated  # noqa: E402

TIMES: dict = {}


def _timed(label, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            TIMES.setdefault(label, []).append(time.perf_counter_ns() - start)
    return wrapper


def _model(model_type: str, layers: int):
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def measure(label, model, steps, runs, families=None):
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                  pad_token_id=0, async_stopping_criteria=True)
    patches = [mock.patch.object(graphs, "record", _timed("record", graphs.record)),
               mock.patch.object(forward, "record", _timed("record", forward.record)),
               mock.patch.object(proof, "judge_recording", _timed("verdict", proof.judge_recording))]
    checks = [(proof.WatchSet, "why_eager"), (forward.PiecewiseForward, "_step"),
              (forward.ModelGraphs, "changed")]
    patches += [mock.patch.object(owner, name, _timed("checks", getattr(owner, name))) for owner, name in checks]
    if families is not None:
        patches.append(mock.patch.dict(proof.FAMILIES, families, clear=True))
    for patch in patches:
        patch.start()
    try:
        TIMES.clear()
        with emulated(), torch.no_grad():
            model.generate(ids, **kwargs)  # the recordings
            record_ms = sum(TIMES.get("record", [])) / 1e6
            records = len(TIMES.get("record", []))
            verdict_ms = sum(TIMES.get("verdict", [])) / 1e6
            path = tas.last_path().forward
            per_step = []
            for _ in range(runs):
                TIMES.clear()
                gc.collect()
                gc.disable()
                try:
                    model.generate(ids, **kwargs)
                finally:
                    gc.enable()
                per_step.append(sum(TIMES.get("checks", [])) / 1e3 / (steps - 1))
    finally:
        for patch in reversed(patches):
            patch.stop()
    print(f"{label:16s} {records:>8d} {record_ms:>12.1f} {verdict_ms:>11.1f} {statistics.median(per_step):>14.1f}"
          f"   {path[:60]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.layers} layers, {args.steps - 1} decode steps, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, CPU (emulated graphs)")
    print(f"{'proof':16s} {'records':>8s} {'record ms':>12s} {'verdict ms':>11s} {'checks us/step':>14s}   path")
    hand_read = dict(proof.FAMILIES)
    found = {name: family for name, family in hand_read.items() if name != "LlamaModel"}
    measure("hand-read", _model("llama", args.layers), args.steps, args.runs)
    measure("found", _model("llama", args.layers), args.steps, args.runs, families=found)
    measure("found+checked", _model("olmo", args.layers), args.steps, args.runs)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
