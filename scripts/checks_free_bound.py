"""How near issue 38's targets the flag could come if the checks before each replay cost nothing (issue 38).

    python3 scripts/checks_free_bound.py [--reps 5] [--new-tokens 128] [--cases dynamic,draft,sample,lookup]
        [--layers 16] [--narrow]

The per-step staleness checks (`WatchSet.why_eager`, `ModelGraphs.changed`: a few hundred
microseconds per forward on an H200 host) are the part of the package's host work that no cut has brought to
microseconds. This script measures what the targets would read with those two checks free: a "checks off" variant
replaces them with stubs (nothing is ever found changed). That is wrong as soon as user code changes the model
mid-call, so it exists here only, as a measurement; in these runs nothing changes the model, and every variant's
output is checked equal to stock's. The gap between "flag" and "checks off" bounds what any cheaper check can win;
what "checks off" still misses a target by is host time that is not the checks.

Cases (Llama-1B-shaped bf16 built from its config, batch 1, greedy unless said; the benchmark's cases):
- `dynamic`: `DynamicCache`, 32-token prompt; also the flag with `cache_implementation="static"` (the target's
  denominator). Target: flag `DynamicCache` / flag static <= 1.25x.
- `draft`, `sample`: a 2-layer draft sharing the target's first layers (`bench.assisted.make_draft`), 5 tokens,
  greedy / speculative sampling (seed 0 before every call). Targets: greedy wall / floor <= 2.0x, sampling flag /
  stock <= 0.4x.
- `lookup`: prompt lookup (10 tokens) on the echo target. Target: wall / floor <= 2.0x.
The variants run rotated rep by rep in one process (the host drifts between processes); "floor" is the summed
device time per token of one profiled flag call, as the benchmark takes it (`bench.gpu.gpu_timeline`; CUDA only).
`--narrow` (and no CUDA): a hidden size of 64 on the CPU with the CUDA graphs emulated, to check the script itself;
its times are no GPU's.
Not a test: a measurement, printed as a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import round_host_cost as cases  # noqa: E402  (the cases of the per-stage table: the same models and kwargs)

import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop.graphs.piecewise import forward, proof, staleness  # noqa: E402

TARGETS = {"dynamic": 1.25, "draft": 2.0, "sample": 0.4, "lookup": 2.0}


@contextlib.contextmanager
def checks_off():
    """The two per-step checks as stubs that find nothing (measurement only: see the module docstring)."""
    saved = (proof.WatchSet.why_eager, staleness.ModelGraphs.changed)
    proof.WatchSet.why_eager = lambda self: None
    staleness.ModelGraphs.changed = lambda self: False
    try:
        yield
    finally:
        proof.WatchSet.why_eager, staleness.ModelGraphs.changed = saved


def _dynamic_case(layers, device, narrow):
    torch.manual_seed(0)
    if narrow:
        target = cases.LlamaForCausalLM(cases._config(layers)).to(device).eval()
    else:
        from transformers_async_stop.bench.cases import _from_config, llama_1b_config

        config = llama_1b_config()
        config.num_hidden_layers = layers
        target = _from_config(config)(torch.device(device), torch.bfloat16).eval()
    vocab = target.config.vocab_size
    ids = torch.randint(3, min(vocab - 1, 32000), (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    return target, dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)


def variants_of(name, args, device):
    """(target, {variant: (patched, extra kwargs, context)}, kwargs) of a case."""
    flag = {"async_stopping_criteria": True}
    if name == "dynamic":
        target, kwargs = _dynamic_case(args.layers, device, args.narrow)
        kwargs.update(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        static = dict(flag, cache_implementation="static")
        return target, kwargs, {"stock": (False, {}, None), "flag": (True, flag, None),
                                "checks off": (True, flag, checks_off), "flag, static": (True, static, None)}
    target, kwargs, _ = cases._case("draft" if name == "sample" else name, args.layers, args.new_tokens,
                                    device=device, full=not args.narrow)
    if name == "sample":
        kwargs["do_sample"] = True
    return target, kwargs, {"stock": (False, {}, None), "flag": (True, flag, None),
                            "checks off": (True, flag, checks_off)}


def call(target, kwargs, patched, extra, context, device):
    if not patched:
        tas.unpatch()
    try:
        with (context() if context is not None else contextlib.nullcontext()):
            torch.manual_seed(0)  # speculative sampling: every variant draws the same numbers
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                out = target.generate(**kwargs, **extra)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        path = tas.last_path().describe() if patched else "stock"
    finally:
        if not patched:
            tas.apply()
    return out, wall, path


def floor_ms(target, kwargs, extra, new_tokens) -> float | None:
    """Device time per token of one call, as the benchmark takes its floor (`bench.gpu.gpu_timeline`; None off
    CUDA)."""
    if not torch.cuda.is_available():
        return None
    from transformers_async_stop.bench.gpu import gpu_timeline

    return gpu_timeline(target, kwargs, extra, torch.device("cuda"))["busy"] / new_tokens


def run_case(name, args, device):
    target, kwargs, variants = variants_of(name, args, device)
    outputs, paths, times = {}, {}, {label: [] for label in variants}
    for label, (patched, extra, context) in variants.items():  # the warm-up calls (recordings, compiles)
        call(target, kwargs, patched, extra, context, device)
        out, _, paths[label] = call(target, kwargs, patched, extra, context, device)
        outputs[label] = out.sequences if hasattr(out, "sequences") else out
    labels = list(variants)
    for rep in range(args.reps):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            patched, extra, context = variants[label]
            _, wall, _ = call(target, kwargs, patched, extra, context, device)
            times[label].append(wall * 1000 / args.new_tokens)
    stock = outputs["stock"]
    same = {label: bool(torch.equal(out, stock)) for label, out in outputs.items() if label != "flag, static"}
    ms = {label: statistics.median(values) for label, values in times.items()}
    floor = floor_ms(target, kwargs, variants["flag"][1], args.new_tokens)
    result = {"case": name, "ms_per_token": ms, "reps": times, "floor_ms_per_token": floor, "same_as_stock": same,
              "paths": paths}
    # the target's ratio within each rep (the host drifts from rep to rep), then its median and its best rep
    if name == "dynamic":
        per_rep = {label: [v / s for v, s in zip(times[label], times["flag, static"])]
                   for label in ("flag", "checks off")}
        result["target_name"] = "flag DynamicCache / flag static"
    elif name == "sample":
        per_rep = {label: [v / s for v, s in zip(times[label], times["stock"])] for label in ("flag", "checks off")}
        result["target_name"] = "flag / stock"
    else:
        per_rep = {label: [v / floor for v in times[label]] for label in ("flag", "checks off")} if floor else None
        result["target_name"] = "wall / floor"
    result["target"] = per_rep and {label: {"median": statistics.median(values), "best": min(values)}
                                    for label, values in per_rep.items()}
    result["goal"] = TARGETS[name]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dynamic,draft,sample,lookup")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--narrow", action="store_true", help="hidden 64 (the CPU check of this script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    emulation = contextlib.nullcontext()
    if device == "cpu":
        if not args.narrow:
            raise SystemExit("no CUDA device: run with --narrow (the CPU check of this script, graphs emulated)")
        os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
        from transformers_async_stop.testing.emulation import emulated

        emulation = emulated()
    import transformers

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, CUDA graphs emulated"
    print(f"{where}; torch {torch.__version__}, transformers {transformers.__version__}; {args.layers} layers"
          f"{', hidden 64' if args.narrow else ', Llama-1B widths, bf16'}; {args.new_tokens} new tokens; "
          f"{args.reps} reps rotated; ms per token (median)", flush=True)
    results = []
    with emulation:
        for name in args.cases.split(","):
            result = run_case(name, args, device)
            results.append(result)
            ms = result["ms_per_token"]
            floor = result["floor_ms_per_token"]
            print(f"\n== {name}: " + ", ".join(f"{label} {value:.3f} (min {min(result['reps'][label]):.3f})"
                                            for label, value in ms.items())
                  + (f", floor {floor:.3f}" if floor else "") + f"; same as stock: {result['same_as_stock']}")
            for label, path in result["paths"].items():
                print(f"   path[{label}]: {path}")
            if result["target"] is not None:
                print(f"   target ({result['target_name']}, goal <= {result['goal']}; median of the per-rep ratios, "
                      "best rep): " + ", ".join(f"{label} {value['median']:.2f}x (best {value['best']:.2f}x)"
                                               for label, value in result["target"].items()), flush=True)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
