"""Where a Llama-1B decode token's GPU time goes, `DynamicCache` against a static cache, both with the flag, and
stock's `DynamicCache` run beside them (issue 38's "`DynamicCache` / static <= 1.25x" target).

    python3 scripts/kernel_split.py [--new-tokens 128] [--reps 5]

Llama-1B-shaped bf16 (16 layers, hidden 2048, vocab 128256; built from its config, random weights), batch 1,
greedy, a 32-token prompt, `--new-tokens` new tokens (min = max). For each run: the wall ms/token (median over
`--reps` calls after a warm-up call), then one call under `torch.profiler` (CUDA activity): the summed kernel time
per token, grouped by what the kernel does (attention, GEMM, `cat` copies, norms and elementwise, sampling), and the
kernel count per token. The wall over the kernel sum says how far the run is from its own kernel floor; the kernel
sum of the DynamicCache run over the static one is the bound any host-side cut meets: a DynamicCache run cannot be
faster than its own kernels, which are stock's (the replay repeats stock's kernels: cuDNN's SDPA on an exact-length
cache, the cache's `torch.cat` per layer). Outputs are checked equal between stock and the flag (dynamic).
Not a test: a measurement, printed as a table and one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_async_stop as tas

GROUPS = (  # (group, substrings of a kernel's name, lower case), the first that matches
    ("attention (SDPA)", ("cudnn", "fmha", "flash", "attention", "sdpa", "efficient")),
    ("GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "splitk")),
    ("cache cat / copies", ("cat", "copy", "memcpy", "memset")),
    ("sampling / argmax / processors", ("argmax", "max", "reduce", "sort", "topk", "softmax", "multinomial")),
    ("norms, rope, elementwise", ("elementwise", "vectorized", "norm", "pow", "mean", "rsqrt", "mul", "add")),
)


def _group(name: str) -> str:
    lower = name.lower()
    for group, keys in GROUPS:
        if any(key in lower for key in keys):
            return group
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    base = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0)
    runs = {
        "stock, DynamicCache": (False, {}),
        "flag, DynamicCache": (True, {"async_stopping_criteria": True}),
        "flag, static cache": (True, {"async_stopping_criteria": True, "cache_implementation": "static"}),
    }
    results, outputs = {}, {}
    for label, (patched, extra) in runs.items():
        (tas.apply if patched else tas.unpatch)()

        def call():
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, **base, **extra)
            torch.cuda.synchronize()
            return out, (time.perf_counter() - start) * 1000 / args.new_tokens

        out, _ = call()
        outputs[label] = out
        wall = statistics.median(call()[1] for _ in range(args.reps))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
        kernels = collections.defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                group = kernels[_group(event.name)]
                group[0] += event.device_time_total / 1000  # us -> ms
                group[1] += 1
        per = {group: (ms / args.new_tokens, count / args.new_tokens) for group, (ms, count) in kernels.items()}
        results[label] = {"wall_ms_per_token": wall, "kernel_ms_per_token": sum(ms for ms, _ in per.values()),
                          "kernels_per_token": sum(count for _, count in per.values()), "groups": per,
                          "path": tas.last_path().describe() if patched else "stock",
                          "forward": getattr(tas.last_path(), "forward", None) if patched else None}
    tas.apply()
    same = torch.equal(outputs["stock, DynamicCache"], outputs["flag, DynamicCache"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{__import__('transformers').__version__}; Llama-1B-shaped bf16 b1, {args.new_tokens} new tokens, "
          f"median of {args.reps}; flag DynamicCache output == stock: {same}")
    groups = sorted({group for result in results.values() for group in result["groups"]})
    print("| ms per token | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for key in ("wall_ms_per_token", "kernel_ms_per_token", "kernels_per_token"):
        print(f"| {key} | " + " | ".join(f"{r[key]:.3f}" for r in results.values()) + " |")
    for group in groups:
        print(f"| kernels: {group} | " + " | ".join(
            "{:.3f} ({:.1f})".format(*r["groups"].get(group, (0.0, 0.0))) for r in results.values()) + " |")
    dyn, static = results["flag, DynamicCache"], results["flag, static cache"]
    print(f"flag DynamicCache / static: wall {dyn['wall_ms_per_token'] / static['wall_ms_per_token']:.2f}x, "
          f"kernels {dyn['kernel_ms_per_token'] / static['kernel_ms_per_token']:.2f}x; DynamicCache wall over its "
          f"own kernels {dyn['wall_ms_per_token'] / dyn['kernel_ms_per_token']:.2f}x")
    for label, result in results.items():
        print(f"  {label}: {result['path']}; forward: {result['forward']}")
    print(json.dumps({"same": same, "results": results}, default=str))


if __name__ == "__main__":
    main()
