"""The blog experiment this project started from: a static-cache `generate()` inside `@torch.inference_mode()`.

    python3 scripts/inference_mode_blog.py [--reps 7] [--tokens 128] [--models llama-1b,tiny]

For each model (a Llama-1B-shaped bf16 model and #43089's tiny Llama in fp32, both built from configs with random
weights), batch 1, greedy, `cache_implementation="static"`, every call inside a function decorated with
`@torch.inference_mode()` (the prompt made there too), variants side by side in one process, rotated per rep:
- `stock`: transformers as shipped, the package unpatched;
- `upstream`: transformers' own `DeferredStopCheck` forced on (where the release has it);
- `async`: the flag (`last_path()` printed);
and one more flag call with `min_new_tokens` (the minimum-length processor: its EOS mask used to read a version
counter, which inference tensors do not have). The sequences of every variant must equal stock's: the script exits
non-zero where they do not. Prints ms/token (whole call over N tokens), median [quartiles], and the paired per-rep
ratio to stock. A timing, never a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop.bench.cases import llama_1b_config, tiny_llama_config  # noqa: E402
from transformers_async_stop.bench.variants import upstream_available, variant  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = {"llama-1b": (llama_1b_config, torch.bfloat16), "tiny": (tiny_llama_config, torch.float32)}


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def blog_generate(model, n, which, **extra):
    """The experiment as the blog wrote it: prompt and generate() inside inference mode."""
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(1)).to(DEV)
    with variant(which) as flag:
        sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, cache_implementation="static", **flag, **extra)
        sync()
        seconds = time.perf_counter() - start
        path = tas.last_path().describe() if flag and tas.last_path() else "as shipped"
    return out, seconds, path


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="llama-1b,tiny")
    args = ap.parse_args()
    variants = ["stock", "async"] + (["upstream"] if upstream_available() else [])
    print(f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, {args.reps} reps, {args.tokens} tokens, batch 1, "
          f"greedy, static cache, inside @torch.inference_mode(); variants {variants}")
    bad = 0
    for name in args.models.split(","):
        make_config, dtype = MODELS[name]
        torch.manual_seed(0)
        with torch.device(DEV):
            model = AutoModelForCausalLM.from_config(make_config(), dtype=dtype).eval()
        reference = None
        for _ in range(2):  # warm-up: captures, allocator pools
            for which in variants:
                blog_generate(model, args.tokens, which)
        times = {v: [] for v in variants}
        paths = {}
        for rep in range(args.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for which in order:
                out, seconds, paths[which] = blog_generate(model, args.tokens, which)
                times[which].append(seconds / args.tokens * 1e3)
                if which == "stock":
                    reference = out if reference is None else reference
        for which in variants:  # every variant's sequences against stock's
            out, _, _ = blog_generate(model, args.tokens, which)
            if not torch.equal(out, reference):
                bad += 1
                print(f"  {name}: {which} DIFFERS from stock")
        with_min = {}
        for which in ("stock", "async"):
            with_min[which], _, min_path = blog_generate(model, args.tokens, which, min_new_tokens=args.tokens // 2)
        same_min = torch.equal(with_min["stock"], with_min["async"])
        bad += not same_min
        print(f"--- {name} ({dtype}): ms/token, median [quartiles]")
        for which in variants:
            ratio = [x / y for x, y in zip(times[which], times["stock"])]
            print(f"  {which:9s} {quartiles(times[which]):>24s}  / stock {quartiles(ratio)}  path: {paths[which]}")
        print(f"  identical to stock: {bad == 0}; with min_new_tokens={args.tokens // 2}: identical {same_min}, "
              f"path {min_path}")
        del model
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
