"""transformers #43089's script, measured side by side in one process: the ratios issue 17's targets are stated in.

    python3 scripts/static_dynamic_ratios.py [--reps 15] [--tokens 64]

One tiny Llama (the issue's), batch 1, greedy. Configurations, each a `generate()` call:
- static cache: stock; the flag with the issue's processor and criterion as written (nothing declared); the flag
  with the same processor declared `graph_safe()` (what the README asked users to do);
- DynamicCache (the issue's default): stock; the flag;
- DynamicCache, a left-padded batch of 8 (the model builds a 4D mask every step; the flag grows it instead,
  `dynamic_loop/wide_mask.py`): stock; the flag.
Each rep runs every configuration once, in a rotated order, so that drift of the machine hits all of them alike. Per
configuration: whole-call ms/token (an N-token call over N) and ms per decode step ((t_N - t_1) / (N - 1): prefill
and per-call set-up removed); per rep the ratios are taken within that rep (paired), and their medians reported
with quartiles. Printed with the path each flag call took. A timing, never a test.
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
from transformers_async_stop.bench.cases import (  # noqa: E402
    AlwaysPassStoppingCriteria, ExtraSoftmaxLogitsProcessor, issue_43089_as_written, tiny_llama_config)
from transformers_async_stop.bench.variants import variant  # noqa: E402
from transformers.generation.logits_process import LogitsProcessorList  # noqa: E402
from transformers.generation.stopping_criteria import StoppingCriteriaList  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def declared(run, model):
    processor = ExtraSoftmaxLogitsProcessor()
    tas.graph_safe(processor)
    return {"stopping_criteria": StoppingCriteriaList([AlwaysPassStoppingCriteria()]),
            "logits_processor": LogitsProcessorList([processor])}


CONFIGS = {  # name: (variant, static cache, extras, padded batch of 8)
    "static stock": ("stock", True, issue_43089_as_written, False),
    "static flag, as written": ("async", True, issue_43089_as_written, False),
    "static flag, declared": ("async", True, declared, False),
    "dynamic stock": ("stock", False, issue_43089_as_written, False),
    "dynamic flag": ("async", False, issue_43089_as_written, False),
    "dynamic padded b8 stock": ("stock", False, issue_43089_as_written, True),
    "dynamic padded b8 flag": ("async", False, issue_43089_as_written, True),
}
RATIOS = (  # (label, numerator, denominator)
    ("static: as written / declared (target <= 1.2)", "static flag, as written", "static flag, declared"),
    ("static: as written / stock", "static flag, as written", "static stock"),
    ("dynamic: flag / stock (target <= 0.6)", "dynamic flag", "dynamic stock"),
    ("dynamic, padded batch of 8: flag / stock", "dynamic padded b8 flag", "dynamic padded b8 stock"),
)


def call(model, prompts, name, n):
    which, static, extras, padded = CONFIGS[name]
    ids, mask = prompts[padded]
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
              do_sample=False, pad_token_id=0, **extras(None, model))
    if static:
        kw["cache_implementation"] = "static"
    with variant(which) as flag:
        sync()
        start = time.perf_counter()
        model.generate(**kw, **flag)
        sync()
        seconds = time.perf_counter() - start
        path = tas.last_path().describe() if flag and tas.last_path() else "transformers as shipped"
    return seconds, path


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{statistics.median(xs):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(1)).to(DEV)
    batch = torch.randint(3, 200, (8, 8), generator=torch.Generator().manual_seed(1)).to(DEV)
    left_padded = torch.ones_like(batch)
    for row in range(0, 8, 2):  # every other row left-padded by 1-4 positions
        left_padded[row, : 1 + row // 2] = 0
    prompts = {False: (ids, torch.ones_like(ids)), True: (batch, left_padded)}
    names, n = list(CONFIGS), args.tokens
    paths = {}
    for name in names:  # warm-up: compile, captures, allocator pools
        for _ in range(3):
            call(model, prompts, name, n)
            call(model, prompts, name, 1)
    whole = {k: [] for k in names}
    step = {k: [] for k in names}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            t_n, paths[name] = call(model, prompts, name, n)
            t_1, _ = call(model, prompts, name, 1)
            whole[name].append(t_n / n * 1e3)
            step[name].append((t_n - t_1) / (n - 1) * 1e3)
    print(f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, {args.reps} reps, {n} tokens, batch 1 (padded: 8), greedy")
    print(f"{'configuration':26s} {'whole call ms/token':>24s} {'per decode step ms':>24s}  path")
    for name in names:
        print(f"{name:26s} {quartiles(whole[name]):>24s} {quartiles(step[name]):>24s}  {paths[name]}")
    print("paired ratios, median [quartiles] of the per-rep ratios:")
    for label, a, b in RATIOS:
        w = [x / y for x, y in zip(whole[a], whole[b])]
        s = [x / y for x, y in zip(step[a], step[b])]
        print(f"  {label}: whole call {quartiles(w)}, per step {quartiles(s)}")


if __name__ == "__main__":
    main()
