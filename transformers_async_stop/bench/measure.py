"""How one run is measured: warm-up and exactness, interleaved timing, the floor, per-variant metrics, ratios.

ms/token is computed per rep and then summarised over reps: in rep r, variant v makes an N-token and a 1-token call
back to back, and (t_N - t_1) / (N - 1) is its decode cost per token in that rep (prefill and call overhead cancel).
The reported figure is the median over reps; the spread is the interquartile range (and min-max in the JSON).
Differencing within a rep pairs two calls made seconds apart, so slow drift of the host clock cancels.

The path of every timed N-token call is read too (`last_path()`), and whether the call made or dropped a recording
of the graphed forward (the model's recordings before and after it): the path reported beside the figure is the timed
calls' (the warm-up's is kept as `warmup_path`: a found family's warm-up call records twice and replays the rest),
and timed calls that took different paths are counted per path. With `back_to_back` > 0, each variant then makes
that many N-token calls more, each right after its own N-token call (no 1-token call and no other variant in
between), differenced against the same variant's median 1-token time: where this "back-to-back" figure differs from
the rotated one, what ran between the calls changed the timed call.

To add a per-variant figure, append a `Metric` to `METRICS`: it says which variants it applies to, and runs under
that variant's set-up after the timing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch

from .. import last_path
from . import gpu
from .cases import Run, generate_kwargs, make_inputs
from .variants import UNPATCHED, Selection, rep_orders, variant

# (name, variant, baseline): baseline ms / variant ms, > 1 when the variant is faster
RATIOS = (("async_vs_stock", "async", "stock"), ("async_vs_upstream", "async", "upstream"),
          ("imported_vs_stock", "imported", "stock"), ("upstream_vs_stock", "upstream", "stock"))
IMPORTED_TOLERANCE = 0.02  # imported (package applied, flag off) must stay within 2% of stock


@dataclasses.dataclass
class Ctx:
    """What the measurements of one run share."""

    model: torch.nn.Module
    run: Run
    device: torch.device
    kw_n: dict
    kw_1: dict

    @property
    def n(self) -> int:
        return self.run.new_tokens

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclasses.dataclass(frozen=True)
class Metric:
    fields: tuple[str, ...]  # the keys it adds to a variant's record (None where it does not apply)
    applies: Callable[[str, Ctx], bool]
    collect: Callable[[Ctx, dict], dict]  # (ctx, the variant's flag kwargs) -> {field: value}


def per_step(value_n, value_1, new_tokens: int):
    if value_n is None or value_1 is None:
        return None
    return (value_n - value_1) / (new_tokens - 1)


def _syncs_and_memory(ctx: Ctx, flag: dict) -> dict:
    syncs_n, peak = gpu.count_syncs(ctx.model, ctx.kw_n, flag, ctx.device)
    syncs_1, _ = gpu.count_syncs(ctx.model, ctx.kw_1, flag, ctx.device)
    return {"syncs_per_step": per_step(syncs_n, syncs_1, ctx.n), "syncs_n": syncs_n, "syncs_1": syncs_1,
            "peak_mem_mib": peak}


METRICS: list[Metric] = [
    Metric(("syncs_per_step", "syncs_n", "syncs_1", "peak_mem_mib"), lambda v, ctx: ctx.cuda, _syncs_and_memory),
]


def timed_ms(model, kwargs: dict, flag: dict, device: torch.device) -> float:
    gpu.sync(device)  # nothing queued from before may count
    torch.manual_seed(gpu.SAMPLE_SEED)
    start = time.perf_counter()
    model.generate(**kwargs, **flag)
    gpu.sync(device)  # generate() may return while the last step still runs
    return (time.perf_counter() - start) * 1e3


def spread(values: list[float]) -> dict:
    """Median, quartiles, min, max, and the interquartile range as a % of the median."""
    if len(values) > 1:
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = median = q3 = values[0]
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values),
            "iqr_pct": 100 * (q3 - q1) / median if median > 0 else None}


def ratios(per_rep: dict[str, list[float]]) -> dict:
    """Each ratio of RATIOS whose variants ran, paired by rep: baseline ms / variant ms of the same rep (made
    seconds apart, so drift cancels); the value is their median, with their quartiles and min-max as the spread."""
    out = {}
    for name, v, base in RATIOS:
        if v not in per_rep or base not in per_rep:
            continue
        paired = [b / x for b, x in zip(per_rep[base], per_rep[v]) if x > 0]
        entry = {"value": statistics.median(paired) if paired else None, "paired": spread(paired) if paired else None}
        if name == "imported_vs_stock" and entry["value"] is not None:
            entry["within_tolerance"] = abs(entry["value"] - 1) <= IMPORTED_TOLERANCE
        out[name] = entry
    return out


def recording_state(model):
    """The graphed forward's recordings of `model` (their identities) and its failed and to-be-confirmed keys: a timed
    call after which this differs made or dropped a recording. None where the package keeps no such store."""
    try:
        from ..graphs.piecewise.forward import graphs_of
    except ImportError:  # pragma: no cover (a tree without the graphed forward)
        return None
    graphs = graphs_of(model)
    return (tuple(map(id, getattr(graphs, "recordings", {}).values())), len(getattr(graphs, "failed", ())),
            len(getattr(graphs, "first_runs", ())))


def measure_run(model, run: Run, sel: Selection, reps: int, device: torch.device, progress,
                trace_dir: str | None = None, back_to_back: int = 0) -> dict:
    """Every selected variant of one run, on one model. Returns the run's JSON record."""
    inputs = make_inputs(run, model, device)
    ctx = Ctx(model, run, device, generate_kwargs(run, model, inputs, run.new_tokens),
              generate_kwargs(run, model, inputs, 1))
    orders = rep_orders(sel.timed, reps)

    # warm-up (and compilation, in static mode) of each variant; its N-token output is checked against stock's, and
    # the path its generate() took is noted
    outputs, paths = {}, {}
    for v in orders[0]:
        progress(f"{run.label} {v}")
        with variant(v) as flag:
            outputs[v] = _sequences(gpu.call(model, ctx.kw_n, flag)).cpu()
            paths[v] = path_taken(v, ctx)
            gpu.call(model, ctx.kw_1, flag)
    # the reference is stock's output; then stock again as a control: if stock does not repeat itself bit for bit
    # (bf16 ties, nondeterministic kernels), a mismatch of another variant says nothing about that variant
    with variant("stock") as flag:
        reference = outputs["stock"] if "stock" in outputs else _sequences(gpu.call(model, ctx.kw_n, flag)).cpu()
        stock_repeatable = bool(torch.equal(_sequences(gpu.call(model, ctx.kw_n, flag)).cpu(), reference))

    progress(f"{run.label} timing {reps} reps x {len(sel.timed)} variants, rotated", count=False)
    t_n = {v: [] for v in sel.timed}
    t_1 = {v: [] for v in sel.timed}
    timed_paths = {v: [] for v in sel.timed}  # the path of each timed N-token call
    recorded = dict.fromkeys(sel.timed, 0)  # timed N-token calls that made or dropped a recording
    for order in orders:
        for v in order:
            with variant(v) as flag:
                before = recording_state(model)
                t_n[v].append(timed_ms(model, ctx.kw_n, flag, device))
                recorded[v] += recording_state(model) != before
                timed_paths[v].append(path_taken(v, ctx))
                t_1[v].append(timed_ms(model, ctx.kw_1, flag, device))
    per_rep = {v: [per_step(a, b, ctx.n) for a, b in zip(t_n[v], t_1[v])] for v in sel.timed}
    b2b = {v: None for v in sel.timed}
    if back_to_back > 0:
        progress(f"{run.label} {back_to_back} back-to-back N-token call(s) per variant", count=False)
        for v in sel.timed:
            with variant(v) as flag:
                timed_ms(model, ctx.kw_n, flag, device)  # the call each timed one follows
                times = [timed_ms(model, ctx.kw_n, flag, device) for _ in range(back_to_back)]
            b2b[v] = per_step(statistics.median(times), statistics.median(t_1[v]), ctx.n)

    floor = gaps = None
    if sel.floor:
        progress(f"{run.label} floor (profiler)", count=False)
        with variant("async") as flag:
            line_n = gpu.gpu_timeline(model, ctx.kw_n, flag, device)
            line_1 = gpu.gpu_timeline(model, ctx.kw_1, flag, device)
        floor = per_step(line_n["busy"], line_1["busy"], ctx.n)
        # where the async run's device time per step goes besides the kernels themselves
        gaps = {key: per_step(line_n[key], line_1[key], ctx.n) for key in ("launch_gaps", "starved")}

    record = {}
    if any(m.applies(v, ctx) for m in METRICS for v in sel.timed):
        progress(f"{run.label} per-variant metrics ({', '.join(f for m in METRICS for f in m.fields)})", count=False)
    for v in sel.timed:
        s = spread(per_rep[v])
        ms = s["median"]
        record[v] = {
            "ms_per_token": ms, "ms_per_token_reps": per_rep[v], "iqr_pct": s["iqr_pct"], "q1": s["q1"],
            "q3": s["q3"], "min": s["min"], "max": s["max"], "t_n_ms": t_n[v], "t_1_ms": t_1[v],
            "gpu_busy": floor / ms if floor is not None and ms > 0 else None,
            "minus_floor_ms": ms - floor if floor is not None else None,
            "exact": None if v == "stock" else bool(torch.equal(outputs[v], reference)),
            # the path the timed calls took (the most frequent, where they differ: each with its count in
            # `timed_paths`), not the warm-up's: a found family's warm-up records twice, its timed calls replay
            "path": _most_common(timed_paths[v]), "warmup_path": paths[v],
            "timed_paths": dict(collections.Counter(timed_paths[v])) if len(set(timed_paths[v])) > 1 else {},
            "timed_recordings": recorded[v], "ms_per_token_b2b": b2b[v],
        }
        for metric in METRICS:
            record[v].update(dict.fromkeys(metric.fields))
            if metric.applies(v, ctx):
                with variant(v) as flag:
                    record[v].update(metric.collect(ctx, flag))

    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        for v in ("stock", "async"):
            if v in sel.timed:
                with variant(v) as flag:
                    path = os.path.join(trace_dir, f"{_slug(run.label)}-{v}.json")
                    gpu.write_trace(model, ctx.kw_n, flag, device, path, ctx.n)

    # ratios only where they mean something: on CUDA. On CPU the flag runs the stock or the forced loop and there
    # is no GPU idle time to win back (they are computed all the same, so that the CPU tests run this code)
    found = ratios(per_rep)
    for v in sel.timed:
        speedup = found.get(f"{v}_vs_stock", {}).get("value") if v != "stock" else None
        record[v]["speedup"] = speedup if ctx.cuda else None
    if "async" in record:
        record["async"]["vs_upstream"] = found.get("async_vs_upstream", {}).get("value") if ctx.cuda else None
    exact = [record[v]["exact"] for v in sel.timed if v != "stock"]
    return dict(run_fields(run), order=orders, variants=record, floor_ms_per_token=floor, async_gaps_ms=gaps,
                ratios=found if ctx.cuda else None, exact=all(exact) if exact else None,
                stock_repeatable=stock_repeatable, error=None)


def path_taken(v: str, ctx: Ctx) -> str:
    """The path of the variant's last generate(): `last_path()` where the package is applied."""
    if v in UNPATCHED:
        # upstream's DeferredStopCheck: CUDA with the gate opened, and `_sample` only
        own = v == "upstream" and ctx.cuda and ctx.run.decode != "beam"
        return "transformers' DeferredStopCheck" if own else "transformers as shipped"
    path = last_path()
    return path.describe() if path is not None else "-"


def _most_common(paths: list[str]) -> str:
    counts = collections.Counter(paths)
    return max(reversed(paths), key=counts.__getitem__)  # on a tie, the later call's


def run_fields(run: Run) -> dict:
    return {"case": run.case.name, "mode": run.mode, "batch": run.batch, "decode": run.decode,
            "new_tokens": run.new_tokens, "prompt_len": run.case.prompt_len, "dtype": run.dtype, "label": run.label}


def error_record(run: Run, exc: BaseException) -> dict:
    return dict(run_fields(run), order=[], variants={}, floor_ms_per_token=None, async_gaps_ms=None, ratios=None,
                exact=None,
                stock_repeatable=None, error=f"{type(exc).__name__}: {exc}")


def _sequences(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text.replace(" ", "-"))
