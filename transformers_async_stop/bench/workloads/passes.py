"""How a workload run is measured: a warm-up pass, then per variant a cold and a warm pass in a fresh thread, checked
against stock's, and the floor.

**Cold lengths.** On CUDA the decode step's attention (cuDNN's SDPA on current torch builds) makes an execution plan
per exact shape, KV length included, and PyTorch keeps those plans per thread (`thread_local` in
`aten/src/ATen/native/cudnn/MHA.cpp`). So within one process the first variant to meet a length would warm it for
every later variant; separate processes would add what a process pays once (its CUDA context, the model's build,
the flag's recordings) to what a length costs; two variants given disjoint lengths would do different work. A fresh
thread meets every length anew, with the same model, lengths and work: each variant's passes run in a thread of
their own, started for them. There, one call below the workload's lengths takes the thread's cuBLAS and cuDNN
handles (`cases.HANDLE_PROMPT`), then the **cold pass** plays the workload once (every length met for the first time
in that thread) and the **warm pass** plays it again (every length met). Cold share = (cold - warm) / cold: the part
of the cold pass spent on first meetings. The variants take turns rep by rep, the order rotated, as in the per-step
runs. Before them, one pass in the main thread (the flag's) meets what is met once per process (the allocator's
growth, the flag's recordings of each batch size).

**Exactness.** Every timed pass's calls (their sequences, and the conversation's last returned cache) must equal
stock's cold pass's, bit for bit; where one does not, stock plays the workload again, to tell a difference of the
variant from one of stock with itself (bf16 ties).

ms/token: a pass's wall time (each call synchronised, prefill included) over its generated positions (one step of a
whole batch counts once). The floor (CUDA): the GPU's kernel time of one flag pass over the same positions.
"""

from __future__ import annotations

import statistics
import threading
import time
import types

import torch

from .. import gpu
from ..measure import METRICS, path_taken, ratios, run_fields, spread
from ..variants import rep_orders, variant
from .cases import CPU_SHAPES, CUDA_SHAPES, Workload, same_outputs


def workload_of(run, model, device) -> Workload:
    case = run.case
    shape = (CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES)[case.workload]
    return Workload(case.workload, shape, run.new_tokens, case.pad_token_id or 0,
                    model.config.get_text_config().vocab_size, device)


def clock(device: torch.device):
    """Times one call: synchronised before and after (nothing queued before it counts, nothing of it is left out),
    seeded as every bench call is."""
    def timed(thunk):
        gpu.sync(device)
        torch.manual_seed(gpu.SAMPLE_SEED)
        start = time.perf_counter()
        out = thunk()
        gpu.sync(device)
        return (time.perf_counter() - start) * 1e3, out

    return timed


def in_fresh_thread(function, *args):
    """`function(*args)` in a thread started for it (its own cuDNN plans: see the module docstring); its exception
    is raised here."""
    box = {}

    def target():
        try:
            box["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001 (handed to the caller)
            box["error"] = error

    thread = threading.Thread(target=target, name="tas-bench-pass", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _cold_and_warm(workload: Workload, model, flag: dict, device: torch.device, path):
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # a new thread starts on device 0
    timed = clock(device)
    model.generate(**workload.handle_call(), **flag)
    gpu.sync(device)
    return workload.play(model, flag, timed, path), workload.play(model, flag, timed, path)


def measure_workload(model, run, sel, reps: int, device: torch.device, progress) -> dict:
    """Every selected variant of one workload run (see the module docstring). Returns the run's JSON record."""
    workload = workload_of(run, model, device)
    ctx = types.SimpleNamespace(cuda=device.type == "cuda", run=run)
    timed = clock(device)

    def path_of(v):
        return lambda: path_taken(v, ctx)

    # one pass in the main thread first, of the flag where it runs (else of the first variant): what is
    # process-wide and met once (the allocator's growth, the flag's recordings of each batch size, lazy module state)
    # is met here, so that the threads' cold passes differ from their warm ones by what each thread meets anew
    first = "async" if "async" in sel.timed else sel.timed[0]
    progress(f"{run.label} {first} (warm-up pass, main thread)", count=False)
    with variant(first) as flag:
        workload.play(model, flag, timed, path_of(first))

    orders = rep_orders(sel.timed, reps)
    progress(f"{run.label} cold and warm passes, {reps} rep(s) x {len(sel.timed)} variants, each in a fresh thread",
             count=False)
    passes = {v: [] for v in sel.timed}
    reference = None
    if "stock" not in sel.timed:
        with variant("stock") as flag:
            reference = workload.play(model, flag, timed, path_of("stock"))
    for order in orders:
        for v in order:
            progress(f"{run.label} {v}", count=order is orders[0])
            with variant(v) as flag:
                cold, warm = in_fresh_thread(_cold_and_warm, workload, model, flag, device, path_of(v))
            passes[v].append((cold, warm))
            if v == "stock" and reference is None:  # stock is first in the first rep: its cold pass is the reference
                reference = cold
    # every timed pass's calls against stock's, bit for bit
    exact = {v: all(same_outputs(p, reference) for pair in passes[v] for p in pair) for v in sel.timed}
    stock_repeatable = True
    if not all(exact.values()):
        # a mismatch says something only if stock repeats itself bit for bit (bf16 ties, nondeterministic kernels)
        with variant("stock") as flag:
            stock_repeatable = same_outputs(workload.play(model, flag, timed, path_of("stock")), reference)

    floor = None
    if sel.floor:
        progress(f"{run.label} floor (profiler)", count=False)
        with variant("async") as flag:
            line = gpu.timeline_of(lambda: workload.play(model, flag, lambda thunk: (0.0, thunk()), lambda: None),
                                   device)
        floor = line["busy"] / _tokens(reference)

    record = {v: _variant_record(passes[v], exact[v], v, floor) for v in sel.timed}
    cold_reps = {v: record[v]["ms_per_token_reps"] for v in sel.timed}
    warm_reps = {v: record[v]["warm_ms_per_token_reps"] for v in sel.timed}
    found, found_warm = ratios(cold_reps), ratios(warm_reps)
    for v in sel.timed:
        record[v]["speedup"] = found.get(f"{v}_vs_stock", {}).get("value") if ctx.cuda and v != "stock" else None
        record[v]["warm_speedup"] = (found_warm.get(f"{v}_vs_stock", {}).get("value")
                                     if ctx.cuda and v != "stock" else None)
    if "async" in record:
        record["async"]["vs_upstream"] = found.get("async_vs_upstream", {}).get("value") if ctx.cuda else None
    checked = [record[v]["exact"] for v in sel.timed if v != "stock"]
    batches = sorted(set(workload.shape.batches))
    return dict(run_fields(run), prompt_len=list(workload.shape.lengths),
                batch=batches[0] if len(batches) == 1 else f"{batches[0]}-{batches[-1]}", order=orders, variants=record,
                floor_ms_per_token=floor, async_gaps_ms=None, ratios=found if ctx.cuda else None,
                exact=all(checked) if checked else None, stock_repeatable=stock_repeatable, error=None,
                workload={"kind": workload.kind, "about": workload.describe(), "calls": workload.shape.calls,
                          "tokens": _tokens(reference), "kv_lengths": list(workload.kv_lengths()), "reps": reps,
                          "warm_ratios": found_warm if ctx.cuda else None})


def _tokens(results) -> int:
    return sum(r.tokens for r in results)


def _variant_record(passes: list, exact: bool, v: str, floor) -> dict:
    tokens = _tokens(passes[0][0])
    cold = [sum(r.ms for r in c) for c, _ in passes]
    warm = [sum(r.ms for r in w) for _, w in passes]
    per_cold = [ms / tokens for ms in cold]
    s = spread(per_cold)
    ms = s["median"]
    last_cold, last_warm = passes[-1]
    paths = [r.path for c, w in passes for r in (*c, *w) if r.path]
    entry = {
        "ms_per_token": ms, "ms_per_token_reps": per_cold, "iqr_pct": s["iqr_pct"], "q1": s["q1"], "q3": s["q3"],
        "min": s["min"], "max": s["max"],
        "warm_ms_per_token": statistics.median(warm) / tokens, "warm_ms_per_token_reps": [w / tokens for w in warm],
        # the part of the cold pass spent on first meetings, and its time: cold minus warm, median over reps
        "cold_share": statistics.median((c - w) / c for c, w in zip(cold, warm) if c > 0) if any(cold) else None,
        "first_meeting_ms": statistics.median(c - w for c, w in zip(cold, warm)),
        "calls_cold_ms": [r.ms for r in last_cold], "calls_warm_ms": [r.ms for r in last_warm],
        "gpu_busy": floor / ms if floor is not None and ms > 0 else None,
        "minus_floor_ms": ms - floor if floor is not None else None,
        "warm_per_floor": statistics.median(warm) / tokens / floor if floor else None,
        "exact": None if v == "stock" else exact,
        "path": max(reversed(paths), key=paths.count) if paths else None, "paths": sorted(set(paths)),
    }
    for metric in METRICS:
        entry.update(dict.fromkeys(metric.fields))
    return entry
