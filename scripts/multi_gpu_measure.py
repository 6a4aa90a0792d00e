"""What scripts/multi_gpu_bench.py and its tensor-parallel ranks (scripts/multi_gpu_tp_worker.py) share: the model's
config, the configurations, and the measurement of one configuration, stock and flag alternated in one process.

One configuration's measurement (`measure`), the same in the device_map process and in each tensor-parallel rank:
- a warm-up call of each variant (N tokens, then 1 token), whose N-token token ids are compared: flag vs stock, and
  stock against a second stock call (if stock does not repeat itself bit for bit, a mismatch says nothing);
- `reps` timed reps, the variants' order rotated per rep (bench.variants.rep_orders); a rep's ms/token is
  (t_N - t_1) / (N - 1), and the figure is the median over reps (as `python -m transformers_async_stop.bench`);
- on CUDA, per variant: blocking syncs per decode step (torch's sync debug mode, bench.gpu.count_syncs) and the
  busy time of each device per decode step (a torch.profiler trace of one N-token and one 1-token call; per device
  the union of its kernels', copies' and memsets' intervals, so overlapping streams count once), divided by the
  variant's ms/token: the fraction of wall time that device was busy.
"stock" is transformers as shipped (this package unpatched, no flag keyword); "flag" is the package applied with
`async_stopping_criteria=True` (bench.variants' "async").
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings
from typing import Callable

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from transformers import LlamaConfig  # noqa: E402

from transformers_async_stop import last_path  # noqa: E402
from transformers_async_stop.bench import gpu  # noqa: E402
from transformers_async_stop.bench.cases import Case, Run, generate_kwargs, make_inputs  # noqa: E402
from transformers_async_stop.bench.measure import per_step, ratios, spread  # noqa: E402
from transformers_async_stop.bench.variants import rep_orders, variant  # noqa: E402

# bench's variant names; the report calls "async" "flag"
VARIANTS = ("stock", "async")
LABELS = {"stock": "stock", "async": "flag"}
PAD = 0
PROMPT_LEN = 32

# Llama-3-8B's shape (random weights, bf16); `--tiny`: a Llama whose head counts still split over 2 ranks
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)

KINDS = ("dm", "tp")  # device_map split in one process; tensor parallelism, one process per device
MODES = {"dynamic": "eager", "static": "static"}  # the report's cache name -> bench's mode name
BATCHES = (1, 8)  # batch 8 is left-padded
CONFIGS = tuple(f"{k}-{c}-b{b}" for k in KINDS for c in MODES for b in BATCHES)
# tensor parallelism with a static cache (compiled across ranks) is opt-in: `--configs all` or by name
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if not c.startswith("tp-static"))


def llama_config(tiny: bool, layers: int | None = None) -> LlamaConfig:
    shape = dict(TINY if tiny else LLAMA_8B)
    if layers:
        shape["num_hidden_layers"] = layers
    return LlamaConfig(pad_token_id=PAD, bos_token_id=1, eos_token_id=2, **shape)


def parse_config(name: str) -> tuple[str, str, int]:
    """'dm-static-b8' -> ('dm', 'static', 8)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    kind, cache, batch = name.split("-")
    return kind, cache, int(batch[1:])


def run_of(name: str, new_tokens: int, dtype: str) -> Run:
    """The bench Run of a configuration: its generate() kwargs and inputs come from bench.cases (min_new_tokens =
    max_new_tokens, so every variant does the same work; batch 8 left-padded by 1-3 eighths of the prompt)."""
    _, cache, batch = parse_config(name)
    case = Case(name, None, (batch,), new_tokens, PROMPT_LEN, dtype, pad_token_id=PAD)
    return Run(case, MODES[cache], batch, "padded" if batch > 1 else "greedy", new_tokens, dtype)


def sync_all(devices: list[torch.device]) -> None:
    for device in devices:
        gpu.sync(device)


def timed_ms(model, kwargs: dict, flag: dict, devices: list[torch.device], align: Callable[[], None]) -> float:
    sync_all(devices)  # nothing queued from before may count, on any device
    align()  # tensor parallelism: every rank starts its clock together (a barrier)
    torch.manual_seed(gpu.SAMPLE_SEED)
    start = time.perf_counter()
    model.generate(**kwargs, **flag)
    sync_all(devices)  # generate() may return while the last step still runs on the last device
    return (time.perf_counter() - start) * 1e3


def busy_ms(model, kwargs: dict, flag: dict, devices: list[torch.device]) -> dict[str, float]:
    """Per device (its name), the length in ms of the union of the intervals of its CUDA-side events in one call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync_all(devices)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gpu.call(model, kwargs, flag)
            sync_all(devices)
    spans: dict[str, list] = {str(d): [] for d in devices}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            spans.setdefault(f"cuda:{evt.device_index}", []).append((evt.time_range.start, evt.time_range.end))
    return {name: union_length(found) / 1e3 for name, found in spans.items()}


def union_length(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(ids.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:12]


def _sequences(out) -> torch.Tensor:
    return (out if isinstance(out, torch.Tensor) else out.sequences).cpu()


def _path(v: str) -> str:
    if v == "stock":
        return "transformers as shipped"
    path = last_path()
    return path.describe() if path is not None else "-"


def measure(model, name: str, new_tokens: int, dtype: str, input_device: torch.device,
            devices: list[torch.device], reps: int, align: Callable[[], None] = lambda: None) -> dict:
    """One configuration, both variants, on a built model. Returns its JSON record (variants keyed stock/flag)."""
    run = run_of(name, new_tokens, dtype)
    inputs = make_inputs(run, model, input_device)
    kw_n = generate_kwargs(run, model, inputs, new_tokens)
    kw_1 = generate_kwargs(run, model, inputs, 1)
    cuda = input_device.type == "cuda"

    outputs, paths = {}, {}
    for v in VARIANTS:  # warm-up (and, for a static cache on CUDA, compilation)
        with variant(v) as flag:
            outputs[v] = _sequences(gpu.call(model, kw_n, flag))
            paths[v] = _path(v)
            gpu.call(model, kw_1, flag)
    with variant("stock") as flag:
        stock_repeatable = bool(torch.equal(_sequences(gpu.call(model, kw_n, flag)), outputs["stock"]))

    t_n = {v: [] for v in VARIANTS}
    t_1 = {v: [] for v in VARIANTS}
    for order in rep_orders(list(VARIANTS), reps):
        for v in order:
            with variant(v) as flag:
                t_n[v].append(timed_ms(model, kw_n, flag, devices, align))
                t_1[v].append(timed_ms(model, kw_1, flag, devices, align))
    per_rep = {v: [per_step(a, b, new_tokens) for a, b in zip(t_n[v], t_1[v])] for v in VARIANTS}

    record = {}
    for v in VARIANTS:
        s = spread(per_rep[v])
        entry = {"ms_per_token": s["median"], "iqr_pct": s["iqr_pct"], "ms_per_token_reps": per_rep[v],
                 "t_n_ms": t_n[v], "t_1_ms": t_1[v], "path": paths[v], "ids_sha1": ids_digest(outputs[v]),
                 "syncs_per_step": None, "busy_ms_per_token": None, "busy": None}
        if cuda:
            with variant(v) as flag:
                syncs_n, _ = gpu.count_syncs(model, kw_n, flag, input_device)
                syncs_1, _ = gpu.count_syncs(model, kw_1, flag, input_device)
                busy_n = busy_ms(model, kw_n, flag, devices)
                busy_1 = busy_ms(model, kw_1, flag, devices)
            per_token = {d: per_step(busy_n[d], busy_1.get(d, 0.0), new_tokens) for d in busy_n}
            entry.update(syncs_per_step=per_step(syncs_n, syncs_1, new_tokens), syncs_n=syncs_n, syncs_1=syncs_1,
                         busy_ms_per_token=per_token,
                         busy={d: ms / s["median"] if s["median"] > 0 else None for d, ms in per_token.items()})
        record[LABELS[v]] = entry
    # stock ms / flag ms paired by rep (> 1: the flag is faster); on CPU it says nothing, as in the bench
    speedup = ratios(per_rep).get("async_vs_stock", {}).get("value") if cuda else None
    kind, cache, batch = parse_config(name)
    return {"config": name, "kind": kind, "cache": cache, "batch": batch, "padded": batch > 1,
            "new_tokens": new_tokens, "prompt_len": PROMPT_LEN, "dtype": dtype, "reps": reps,
            "order": rep_orders([LABELS[v] for v in VARIANTS], reps), "variants": record, "speedup": speedup,
            "equal": bool(torch.equal(outputs["async"], outputs["stock"])), "stock_repeatable": stock_repeatable,
            "error": None}


def error_record(name: str, error: str) -> dict:
    kind, cache, batch = parse_config(name)
    return {"config": name, "kind": kind, "cache": cache, "batch": batch, "variants": {}, "equal": None,
            "error": error}
