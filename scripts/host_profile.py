"""Where the host time of one decode step goes: stock transformers vs upstream's DeferredStopCheck vs the flag.

    python3 scripts/host_profile.py [--cases tiny-static,tiny-eager,llama1b-static,llama1b-sample,llama1b-padded]
                                    [--tokens 64] [--top 25] [--out DIR] [--gaps]

For each case and variant: ms/token without a profiler (median of 5, N-token minus 1-token call), then one N-token call
under cProfile. Printed per decode step: the wall time, the time blocked waiting for the GPU (the builtins that wait:
event synchronize, `.item()`/`bool()` of a CUDA tensor), the host's own time (the difference), the cumulative time
of the generate() building blocks (input preparation, mask creation, the compiled forward, processors, criteria,
the stop check, this package's wrappers), and the functions with the most own time. cProfile inflates Python-heavy
code; read the figures as shares, and the unprofiled ms/token as the truth.

With --outside-forward, each variant also reports `generate()`'s own host time per decode step outside the model's
forward (unprofiled; the lowest of 7 N-token minus 1-token differences; on CPU the thread's CPU time with one torch
thread, so a loaded machine's other processes do not count; on CUDA wall time, the forward synchronized at both
ends, so the figure is host work only). Variant `async-deferred` is the flag with the dynamic-cache loop switched off
(`TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP=0`): the deferred path through stock `_sample`. Cases ending in `-padded` run a
left-padded batch of 8; a case without `static` in its name runs the default DynamicCache; a case with `43089` in its
name runs transformers #43089's processor and criterion as written there (e.g. `tiny-eager-43089`), other tiny cases
the declared `ExtraSoftmax` of the docs' tables.

With --gaps (CUDA), each variant's decode steps are also split on the device side (`device_gaps`): busy time, the
idle gaps between two kernels of one CUDA-graph launch (the forward's graph), and the idle gaps elsewhere (between
the graph and the loop's own kernels, and between those). The in-graph gap per kernel boundary bounds what any
host-side change can reach: a whole step captured in one graph would still pay it at every boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time

import torch
from transformers import LlamaForCausalLM
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from transformers_async_stop.bench.cases import (  # the #43089 workload's criterion/processor, the two models
    ExtraSoftmax, NeverStop, issue_43089_as_written, llama_1b_config, tiny_llama_config)
from transformers_async_stop.bench.variants import upstream_available, variant

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()

# the blocks of a decode step, matched against "file:function" of cProfile entries (cumulative time per step)
BLOCKS = {
    "prepare_inputs_for_generation": "generation/utils.py:prepare_inputs_for_generation",
    "create_masks_for_generate": "masking_utils.py:create_masks_for_generate",
    "compiled forward (dynamo)": "eval_frame.py:_fn",
    "logits processors": "logits_process.py:__call__",
    "stopping criteria": "stopping_criteria.py:__call__",
    "_update_model_kwargs": "generation/utils.py:_update_model_kwargs_for_generation",
    "StopCheck/Deferred __call__": "generation/utils.py:__call__",
    "package: processors/criteria wrappers": "transformers_async_stop/control/step_lists.py:__call__",
    "package: AsyncStop.record": "transformers_async_stop/control/controller.py:record",
    "package: AsyncStop.join": "transformers_async_stop/control/controller.py:join",
}
WAITS = ("method 'synchronize'", "method 'item'", "method 'is_nonzero'", "_local_scalar_dense", "built-in method bool")


def build(name):
    torch.manual_seed(0)
    if name == "tiny":
        config, dtype = tiny_llama_config(), torch.float32
    else:
        config, dtype = llama_1b_config(), torch.bfloat16
    with torch.device(DEV):
        return LlamaForCausalLM(config).to(dtype).eval()


def case_kwargs(case, model, n):
    batch = 8 if case.endswith("padded") else 1
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab - 1, (batch, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if case.endswith("padded"):
        for row in range(batch):
            mask[row, : (row % 4) * 4] = 0
    kw = dict(input_ids=ids.to(DEV), attention_mask=mask.to(DEV), max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
              do_sample=case.endswith("sample"))
    if "static" in case or case.startswith("llama1b"):
        kw["cache_implementation"] = "static"
    if "43089" in case:  # transformers #43089's script as written (nothing declared graph_safe)
        kw.update(issue_43089_as_written(None, model))
    elif case.startswith("tiny"):
        kw["stopping_criteria"] = StoppingCriteriaList([NeverStop()])
        kw["logits_processor"] = LogitsProcessorList([ExtraSoftmax()])
    return kw


def timed(model, kw, flag):
    torch.manual_seed(0)
    sync()
    start = time.perf_counter()
    model.generate(**kw, **flag)
    sync()
    return time.perf_counter() - start


def key_name(key):
    filename, _, func = key
    return f"{filename.replace(os.sep, '/')}:{func}"


def report(case, name, kw, kw1, model, flag, n, top, out):
    for _ in range(2):
        timed(model, kw, flag), timed(model, kw1, flag)
    t_n = [timed(model, kw, flag) for _ in range(5)]
    t_1 = [timed(model, kw1, flag) for _ in range(5)]
    ms = (statistics.median(t_n) - statistics.median(t_1)) / (n - 1) * 1e3
    prof = cProfile.Profile()
    sync()
    prof.enable()
    model.generate(**kw, **flag)
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    total = max(v[3] for v in stats.stats.values())
    waits = sum(v[2] for k, v in stats.stats.items() if any(w in key_name(k) for w in WAITS))
    per = 1e6 / n
    print(f"\n=== {case} / {name}: {ms:.3f} ms/token unprofiled; profiled per step: wall {total * per:.0f} us, "
          f"waiting {waits * per:.0f} us, host {(total - waits) * per:.0f} us")
    for label, pattern in BLOCKS.items():
        cum = sum(v[3] for k, v in stats.stats.items() if key_name(k).endswith(pattern.split(":")[1])
                  and pattern.split(":")[0] in key_name(k))
        if cum:
            print(f"  {label:32s} {cum * per:8.1f} us/step (cumulative)")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for k, v in rows:
        print(f"  {v[2] * per:8.1f} us own  {v[1] / n:5.1f} calls/step  {key_name(k)[-90:]}")
    if out:
        stats.dump_stats(os.path.join(out, f"{case}-{name}.prof"))
    return ms


def outside_forward(model, kw, kw1, flag, n, reps=7):
    """generate()'s own host time per decode step outside the model's forward, in microseconds (unprofiled): the
    lowest of `reps` (N-token minus 1-token) differences. On CPU the clock is the thread's CPU time with one torch
    thread, so other processes on a loaded machine do not count; on CUDA it is wall time, the forward synchronized at
    both ends."""
    clock = time.thread_time if DEV == "cpu" else time.perf_counter
    inside = [0.0]
    real = model.forward

    @functools.wraps(real)
    def forward(*args, **kwargs):
        sync()
        start = clock()
        try:
            return real(*args, **kwargs)
        finally:
            sync()
            inside[0] += clock() - start

    def outside(kwargs):
        inside[0] = 0.0
        torch.manual_seed(0)
        sync()
        start = clock()
        model.generate(**kwargs, **flag)
        sync()
        return clock() - start - inside[0]

    threads = torch.get_num_threads()
    model.forward = forward  # an instance attribute: `nn.Module.__call__` looks it up per call
    try:
        if DEV == "cpu":
            torch.set_num_threads(1)
        for _ in range(2):
            outside(kw), outside(kw1)
        per_step = [(outside(kw) - outside(kw1)) / (n - 1) * 1e6 for _ in range(reps)]
    finally:
        del model.forward
        torch.set_num_threads(threads)
    return min(per_step)


@contextlib.contextmanager
def variant_of(name):
    """`bench.variants.variant`, plus `async-deferred`: the flag with the dynamic-cache loop off."""
    if name != "async-deferred":
        with variant(name) as flag:
            yield flag
        return
    from transformers_async_stop.loops.dynamic_loop import DYNAMIC_LOOP_ENV

    before = os.environ.get(DYNAMIC_LOOP_ENV)
    os.environ[DYNAMIC_LOOP_ENV] = "0"
    try:
        with variant("async") as flag:
            yield flag
    finally:
        if before is None:
            os.environ.pop(DYNAMIC_LOOP_ENV, None)
        else:
            os.environ[DYNAMIC_LOOP_ENV] = before


GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_gaps(model, kw, flag, n, path):
    """Per decode step, from a CUDA-activity trace of one N-token call: (busy, gaps inside one graph launch, gaps
    elsewhere) in us, and the kernel counts inside and outside graphs. The decode steps are the span from the first
    graph-launched kernel (the prefill runs eagerly) to the last device event."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.manual_seed(0)
        model.generate(**kw, **flag)
        sync()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    launches = {e["args"].get("correlation") for e in events
                if e.get("name") in GRAPH_LAUNCHES and "args" in e}
    device = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("args", {}).get("correlation"),
         bool(e.get("args", {}).get("graph node id")))
        for e in events if e.get("cat") in DEVICE_CATS)
    in_graph = [c in launches or node for _, _, c, node in device]
    device = [d[:3] for d in device]
    first = next((i for i, g in enumerate(in_graph) if g), None)
    if first is None:
        return None
    device, in_graph = device[first:], in_graph[first:]
    busy = inside = outside = 0.0
    boundaries_inside = 0
    reach, last_corr, last_graph = None, None, False
    for (start, end, corr), graph in zip(device, in_graph):
        if reach is None:
            busy += end - start
        else:
            busy += max(0.0, end - max(start, reach))
            if start > reach:
                if graph and last_graph and corr == last_corr:
                    inside += start - reach
                else:
                    outside += start - reach
        if graph and last_graph and corr == last_corr:
            boundaries_inside += 1
        reach = end if reach is None else max(reach, end)
        last_corr, last_graph = corr, graph
    steps = n - 1
    return dict(busy=busy / steps, inside=inside / steps, outside=outside / steps,
                kernels_graph=sum(in_graph) / steps, kernels_other=(len(in_graph) - sum(in_graph)) / steps,
                gap_per_boundary=inside / boundaries_inside if boundaries_inside else 0.0)


def print_gaps(case, name, g):
    total = g["busy"] + g["inside"] + g["outside"]
    whole = g["busy"] / (g["busy"] + g["gap_per_boundary"] * (g["kernels_graph"] + g["kernels_other"]))
    print(f"  device per step: busy {g['busy']:.1f} us ({100 * g['busy'] / total:.1f}% of the step), idle inside "
          f"the forward's graph {g['inside']:.1f} us ({g['kernels_graph']:.0f} kernels, "
          f"{g['gap_per_boundary']:.2f} us per boundary), idle elsewhere {g['outside']:.1f} us "
          f"({g['kernels_other']:.0f} kernels outside graphs); a whole step in one graph: ~{100 * whole:.1f}% busy")
    return 100 * g["busy"] / total, 100 * whole


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="tiny-static,tiny-eager,llama1b-static,llama1b-sample,llama1b-padded")
    p.add_argument("--variants", default="stock,upstream,imported,async")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", help="a folder for the cProfile files (pstats), one per case and variant")
    p.add_argument("--gaps", action="store_true", help="CUDA: split each variant's device time (device_gaps)")
    p.add_argument("--outside-forward", action="store_true",
                   help="also generate()'s own host time per step outside the model's forward (outside_forward)")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    import torch._dynamo.config as dc
    dc.recompile_limit = 64
    summary = []
    models = {}
    for case in args.cases.split(","):
        base = case.split("-")[0]
        if base not in models:
            models.clear()
            torch._dynamo.reset()
            models[base] = build(base)
        model = models[base]
        kw, kw1 = case_kwargs(case, model, args.tokens), case_kwargs(case, model, 1)
        for name in args.variants.split(","):
            if name == "upstream" and not upstream_available():
                continue
            try:
                with variant_of(name) as flag:
                    ms = report(case, name, kw, kw1, model, flag, args.tokens, args.top, args.out)
                    own = outside_forward(model, kw, kw1, flag, args.tokens) if args.outside_forward else None
                    busy = None
                    if args.gaps and DEV == "cuda":
                        trace = os.path.join(args.out or "/tmp", f"{case}-{name}.trace.json")
                        g = device_gaps(model, kw, flag, args.tokens, trace)
                        if g is not None:
                            busy = print_gaps(case, name, g)
                        else:
                            print("  device per step: no graph-launched kernel in the trace")
                    summary.append((case, name, ms, busy, own))
            except Exception as exc:  # one failing case must not hide the others
                print(f"{case}/{name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    print("\ncase              variant         ms/token  outside-forward us/step  busy%  busy% if one graph")
    for case, name, ms, busy, own in summary:
        shares = f"{busy[0]:6.1f} {busy[1]:6.1f}" if busy else ""
        own = f"{own:8.1f}" if own is not None else " " * 8
        print(f"{case:17s} {name:15s} {ms:8.3f} {own:>24s} {shares}")


if __name__ == "__main__":
    main()
