"""Side-by-side decode benchmark: stock stop flag vs async stop flag vs upstream's DeferredStopCheck vs the GPU floor.

    python -m transformers_async_stop.bench                       # every case that fits the device
    python -m transformers_async_stop.bench --quick               # tiny cases only (CPU CI)
    python -m transformers_async_stop.bench --cases llama-1b --modes static --json out.json --markdown out.md

Every case builds one model (random weights from a config, no hub downloads) and runs every variant on it:

- stock:    our package applied, `async_stopping_criteria=False`: the stop flag is read on the host every step;
- async:    our package applied, `async_stopping_criteria=True`: the flag is read one step late from pinned memory;
- upstream: our package unpatched, transformers' own `DeferredStopCheck` (5.17+) forced on for CUDA;
- floor:    GPU time per decode step of the async run, from torch.profiler: what a host that never stalls could reach.

Decode cost is isolated from prefill by timing an N-token and a 1-token `generate()` (both warmed up, medians over
`--reps`): ms/token = (t_N - t_1) / (N - 1). Syncs and GPU time are differenced the same way. Every call generates
exactly its token budget (`min_new_tokens == max_new_tokens`), so the variants do the same work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from . import __version__, apply, unpatch
from .config import FIELD, force_deferred

NO_CUDA_MESSAGE = (
    "CUDA not available: GPU figures (syncs, GPU-busy, floor, memory) are not available on this machine"
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = ("stock", "async", "upstream")
SAMPLE_SEED = 1234
QUICK_NEW_TOKENS = 16
QUICK_REPS = 2


# --- the tiny-llama workload of transformers issue #43089 -------------------------------------------------------
class NeverStop(StoppingCriteria):
    """A user criterion that never fires: the stop flag still has to be read every step."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ExtraSoftmax(LogitsProcessor):
    """A user logits processor that applies a second softmax: one more small kernel per step."""

    def __call__(self, input_ids, scores):
        return scores.softmax(-1)


class ProfilerStepper(LogitsProcessor):
    """Advances a torch.profiler schedule once per decode step; no device work, so the traced run stays the same."""

    def __init__(self, prof):
        self.prof = prof

    def __call__(self, input_ids, scores):
        self.prof.step()
        return scores


# --- cases and runs -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[torch.device, torch.dtype], torch.nn.Module]
    batches: tuple[int, ...]
    new_tokens: int
    prompt_len: int
    dtype: str  # default on CUDA; CPU runs in fp32 unless --dtype says otherwise
    pad_token_id: int | None = None  # None: taken from the model's generation config
    tiny: bool = False  # cheap enough for CPU and --quick
    custom: bool = False  # the user criteria/processor of issue #43089


BEAMS = 4


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured configuration of a case: all variants run on it."""

    case: Case
    mode: str  # "eager" (DynamicCache) or "static" (StaticCache, auto-compiled into CUDA graphs on CUDA)
    batch: int
    decode: str  # "greedy", "sample", "padded" (greedy, left-padded batch) or "beam" (BEAMS beams, greedy)
    new_tokens: int
    dtype: str

    @property
    def label(self) -> str:
        extra = "" if self.decode == "greedy" else f" {self.decode}"
        return f"{self.case.name} {self.mode} b{self.batch}{extra}"


def _from_config(config) -> Callable[[torch.device, torch.dtype], torch.nn.Module]:
    def build(device, dtype):
        torch.manual_seed(0)
        # built directly on the device: initialising 1B parameters on the CPU first takes longer than the benchmark
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()

    return build


def _from_checkpoint(path: str) -> Callable[[torch.device, torch.dtype], torch.nn.Module]:
    def build(device, dtype):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        return model.to(device).eval()

    return build


def builtin_cases() -> dict[str, Case]:
    tiny = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1)
    llama_1b = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256)
    return {
        "tiny-llama": Case("tiny-llama", _from_config(tiny), (1,), 64, 8, "fp32", pad_token_id=0, tiny=True,
                           custom=True),
        "gpt2": Case("gpt2", _from_config(GPT2Config()), (1, 32), 100, 32, "fp32", pad_token_id=50256),
        "llama-1b": Case("llama-1b", _from_config(llama_1b), (1, 32), 128, 32, "bf16", pad_token_id=0),
    }


def model_case(path: str) -> Case:
    name = "model:" + os.path.basename(os.path.normpath(path))
    return Case(name, _from_checkpoint(path), (1,), 128, 32, "bf16")


def plan_runs(args, device: torch.device) -> list[tuple[Case, list[Run]]]:
    """The cases to run, each with its runs; a case's runs share one model."""
    cases = builtin_cases()
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in cases]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
    elif args.quick or device.type != "cuda":
        names = [n for n, c in cases.items() if c.tiny]
    else:
        names = [n for n in cases if n != "llama-1b" or _gpu_gib(device) >= 8]
    selected = [cases[n] for n in names]
    if args.model:
        selected.append(model_case(args.model))

    # the sampling, left-padded and beam-search runs go to the largest built-in case selected (tiny on CPU)
    extras_to = "llama-1b" if "llama-1b" in names else ("tiny-llama" if "tiny-llama" in names else None)
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else ["eager", "static"]
    plan = []
    for case in selected:
        n = args.new_tokens or (QUICK_NEW_TOKENS if args.quick else case.new_tokens)
        batches = args.batch or case.batches
        dtype = args.dtype or (case.dtype if device.type == "cuda" else "fp32")
        runs = [Run(case, mode, b, "greedy", n, dtype) for mode in modes for b in batches]
        if case.name == extras_to and "static" in modes:
            runs.append(Run(case, "static", args.batch[0] if args.batch else 1, "sample", n, dtype))
            runs.append(Run(case, "static", args.batch[0] if args.batch else 8, "padded", n, dtype))
            runs.append(Run(case, "static", args.batch[0] if args.batch else 1, "beam", n, dtype))
        plan.append((case, runs))
    return plan


def _gpu_gib(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / 2**30


# --- inputs and generate() calls ----------------------------------------------------------------------------------
def make_inputs(run: Run, model, device: torch.device) -> dict:
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    # ids 3..vocab-2: clear of the usual special tokens (bos/eos/pad at the ends of the vocabulary)
    ids = torch.randint(3, vocab - 1, (run.batch, run.case.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    if run.decode == "padded":
        step = max(1, run.case.prompt_len // 8)
        for row in range(run.batch):
            pad = ((row + 1) % 4) * step  # rows 3, 7, ... unpadded; the others 1-3 eighths of the prompt
            mask[row, :pad] = 0
            ids[row, :pad] = pad_token_id(run.case, model)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def pad_token_id(case: Case, model) -> int:
    if case.pad_token_id is not None:
        return case.pad_token_id
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def generate_kwargs(run: Run, model, inputs: dict, new_tokens: int) -> dict:
    kwargs = dict(
        inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # eos is masked until the budget is spent: every variant does the same work
        do_sample=run.decode == "sample",
        num_beams=BEAMS if run.decode == "beam" else 1,
        pad_token_id=pad_token_id(run.case, model),
    )
    if run.mode == "static":
        kwargs["cache_implementation"] = "static"
    if run.case.custom:
        kwargs["stopping_criteria"] = StoppingCriteriaList([NeverStop()])
        kwargs["logits_processor"] = LogitsProcessorList([ExtraSoftmax()])
    return kwargs


def upstream_available() -> bool:
    gen_utils = importlib.import_module("transformers.generation.utils")
    return hasattr(gen_utils, "DeferredStopCheck")


@contextlib.contextmanager
def variant(name: str):
    """Set transformers up for one variant; yields the extra generate() kwargs. Always leaves our package applied."""
    if name != "upstream":
        yield {FIELD: name == "async"}
        return
    unpatch()
    try:
        with _upstream_deferred_on_cuda():
            yield {}  # stock transformers knows no `async_stopping_criteria` keyword
    finally:
        apply()


@contextlib.contextmanager
def _upstream_deferred_on_cuda():
    """Upstream gates its DeferredStopCheck to MPS; open the gate for CUDA (the anchor we compare against)."""
    cls = importlib.import_module("transformers.generation.utils").DeferredStopCheck
    stored = vars(cls)["is_supported"]  # the staticmethod object itself, to put back exactly
    original = cls.is_supported

    def is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs):
        if torch.device(device).type == "cuda":
            return not is_assistant
        return original(device, cache, cache_is_returned, is_assistant, *args, **kwargs)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        cls.is_supported = stored


def call(model, kwargs: dict, flag: dict, seed: int = SAMPLE_SEED):
    # seeded before every call so that sampling draws the same numbers in every variant
    torch.manual_seed(seed)
    return model.generate(**kwargs, **flag)


def sequences(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(model, kwargs: dict, flag: dict, device: torch.device) -> float:
    torch.manual_seed(SAMPLE_SEED)
    _sync(device)  # nothing queued from before may count
    start = time.perf_counter()
    model.generate(**kwargs, **flag)
    _sync(device)  # generate() may return while the last step still runs
    return (time.perf_counter() - start) * 1e3


# --- measurements -------------------------------------------------------------------------------------------------
def per_step(value_n, value_1, new_tokens: int):
    if value_n is None or value_1 is None:
        return None
    return (value_n - value_1) / (new_tokens - 1)


def count_syncs(model, kwargs: dict, flag: dict, device: torch.device) -> tuple[int, float]:
    """Blocking syncs of one call (torch's sync debug mode), and its peak allocated GPU memory in MiB."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the default filter would report each call site once
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(model, kwargs, flag)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    return sum("synchroniz" in str(w.message) for w in caught), peak


def gpu_time_ms(model, kwargs: dict, flag: dict, device: torch.device) -> float:
    """Device time of one call: every CUDA-side event (kernels, copies, memsets) the profiler recorded."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    # CUDA activity only: host-side events would add ~100k events per long call to parse, and are not summed
    with _quiet_profiler(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(model, kwargs, flag)
        torch.cuda.synchronize(device)
    total_us = sum(evt.time_range.elapsed_us() for evt in prof.events() if evt.device_type == DeviceType.CUDA)
    return total_us / 1e3


@contextlib.contextmanager
def _quiet_profiler():
    # each profile records one cycle; newer torch warns that events of earlier cycles would be dropped
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        yield


def write_trace(model, kwargs: dict, flag: dict, device: torch.device, path: str, new_tokens: int) -> None:
    """A Chrome trace of ~8 decode steps from the middle of a full N-token call (same cache size as the timed one)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    active = max(1, min(8, new_tokens - 2))
    wait = max(0, (new_tokens - active) // 2 - 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_profiler():
        with profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
                     on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            traced = dict(kwargs)
            traced["logits_processor"] = LogitsProcessorList(
                list(kwargs.get("logits_processor") or []) + [ProfilerStepper(prof)])
            call(model, traced, flag)
            _sync(device)


def measure(model, run: Run, variants: list[str], args, device: torch.device, progress) -> dict:
    """All variants of one run, on one model. Returns the run's JSON record."""
    cuda = device.type == "cuda"
    n = run.new_tokens
    inputs = make_inputs(run, model, device)
    kw_n = generate_kwargs(run, model, inputs, n)
    kw_1 = generate_kwargs(run, model, inputs, 1)
    record = {v: {} for v in variants}

    # warm-up (and compilation, in static mode) of each variant; its N-token output is the exactness reference
    outputs = {}
    for v in variants:
        progress(f"{run.label} {v}")
        with variant(v) as flag:
            outputs[v] = sequences(call(model, kw_n, flag)).cpu()
            call(model, kw_1, flag)

    # control: stock again, after every variant ran once; if stock does not repeat itself bit for bit (bf16 ties,
    # nondeterministic kernels), a mismatch of another variant says nothing about that variant
    with variant("stock") as flag:
        stock_repeatable = bool(torch.equal(sequences(call(model, kw_n, flag)).cpu(), outputs["stock"]))

    # timing, variants interleaved rep by rep so that clock or thermal drift hits them alike
    progress(f"{run.label} timing {args.reps} reps x {len(variants)} variants", count=False)
    times = {v: ([], []) for v in variants}
    for _ in range(args.reps):
        for v in variants:
            with variant(v) as flag:
                times[v][0].append(timed(model, kw_n, flag, device))
                times[v][1].append(timed(model, kw_1, flag, device))

    floor = None
    if cuda:
        progress(f"{run.label} syncs, memory, floor (profiler)", count=False)
        with variant("async") as flag:
            floor = per_step(gpu_time_ms(model, kw_n, flag, device), gpu_time_ms(model, kw_1, flag, device), n)

    for v in variants:
        t_n, t_1 = times[v]
        ms = per_step(statistics.median(t_n), statistics.median(t_1), n)
        syncs = syncs_n = syncs_1 = peak = None
        if cuda:
            with variant(v) as flag:
                syncs_n, peak = count_syncs(model, kw_n, flag, device)
                syncs_1, _ = count_syncs(model, kw_1, flag, device)
            syncs = per_step(syncs_n, syncs_1, n)
        record[v] = {
            "ms_per_token": ms,
            "t_n_ms": t_n,
            "t_1_ms": t_1,
            "syncs_per_step": syncs,
            "syncs_n": syncs_n,
            "syncs_1": syncs_1,
            "gpu_busy": (floor / ms) if floor is not None and ms and ms > 0 else None,
            "peak_mem_mib": peak,
            "exact": None if v == "stock" else bool(torch.equal(outputs[v], outputs["stock"])),
        }

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for v in ("stock", "async"):
            path = os.path.join(args.trace, f"{_slug(run.label)}-{v}.json")
            with variant(v) as flag:
                write_trace(model, kw_n, flag, device, path, n)

    stock_ms, async_ms = record["stock"]["ms_per_token"], record["async"]["ms_per_token"]
    for v in variants:
        ms = record[v]["ms_per_token"]
        record[v]["speedup"] = (stock_ms / ms) if v != "stock" and ms and ms > 0 else None
        record[v]["minus_floor_ms"] = (ms - floor) if floor is not None else None
    return {
        "case": run.case.name,
        "mode": run.mode,
        "batch": run.batch,
        "decode": run.decode,
        "new_tokens": n,
        "prompt_len": run.case.prompt_len,
        "dtype": run.dtype,
        "label": run.label,
        "variants": record,
        "floor_ms_per_token": floor,
        "speedup": record["async"]["speedup"],
        "async_minus_floor_ms": (async_ms - floor) if floor is not None else None,
        "exact": record["async"]["exact"],
        "stock_repeatable": stock_repeatable,
        "error": None,
    }


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text.replace(" ", "-"))


def free(device: torch.device) -> None:
    """Release a case's model before the next is built; compiled graphs (static mode) hold its weights and
    CUDA-graph memory pools until dynamo is reset."""
    gc.collect()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def raise_compile_limits(notes: list[str]) -> None:
    """One process compiles each case's forward for several batch sizes and for patched and unpatched
    transformers (the masking helpers inlined into the graph differ). Past the default limits dynamo falls back
    to eager and cudagraph trees stop re-recording, which would skew whichever variant ran last."""
    dynamo_config = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, attr) and getattr(dynamo_config, attr) < 64:
            setattr(dynamo_config, attr, 64)
            notes.append(f"torch._dynamo.config.{attr} raised to 64")
            break
    try:
        triton_config = importlib.import_module("torch._inductor.config").triton
    except ImportError:
        return
    if getattr(triton_config, "cudagraph_unexpected_rerecord_limit", 1024) < 1024:
        triton_config.cudagraph_unexpected_rerecord_limit = 1024
        notes.append("torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit raised to 1024")


# --- header, table, outputs ---------------------------------------------------------------------------------------
def header(device: torch.device, command: str, args, variants: list[str], notes: list[str]) -> dict:
    cuda = device.type == "cuda"
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine()),
        "driver": _nvidia_driver() if cuda else None,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_async_stop": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cuda_available": torch.cuda.is_available(),
        "gpu_figures": cuda,
        # on CPU the flag is accepted but the stock loop runs unless the force switch is set
        "async_path_active": cuda or force_deferred(),
        "variants": variants,
        "reps": args.reps,
        "quick": args.quick,
        "notes": notes,
    }
    if not cuda:
        info["notes"] = notes + [NO_CUDA_MESSAGE]
    return info


def _nvidia_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


COLUMNS = ("case", "mode", "batch", "decode", "variant", "ms/tok", "speedup", "-floor ms", "syncs/step",
           "GPU-busy", "peak MiB", "exact")


def table_rows(runs: list[dict]) -> list[tuple[str, ...]]:
    """One row per run and variant, plus the floor row."""
    rows = []
    for r in runs:
        key = (r["case"], r["mode"], str(r["batch"]), r["decode"])
        if r.get("error"):
            rows.append(key + ("ERROR", r["error"].splitlines()[0][:60]) + ("",) * (len(COLUMNS) - 6))
            continue
        for v, m in r["variants"].items():
            rows.append(key + (
                v,
                _fmt(m["ms_per_token"], ".3f"),
                _fmt(m["speedup"], ".2f", "x"),
                _fmt(m["minus_floor_ms"], "+.3f"),
                _fmt(m["syncs_per_step"], ".2f"),
                _fmt(m["gpu_busy"] * 100 if m["gpu_busy"] is not None else None, ".0f", "%"),
                _fmt(m["peak_mem_mib"], ".0f"),
                "" if m["exact"] is None else ("yes" if m["exact"] else
                                               ("NO" if r.get("stock_repeatable", True) else "NO*")),
            ))
        if r["floor_ms_per_token"] is not None:
            rows.append(key + ("floor", _fmt(r["floor_ms_per_token"], ".3f")) + ("",) * (len(COLUMNS) - 6))
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) + suffix


def text_table(runs: list[dict]) -> str:
    rows = [COLUMNS] + table_rows(runs)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(result: dict) -> str:
    h = result["header"]
    lines = ["# transformers_async_stop decode benchmark", ""]
    for key in ("device_name", "device", "driver", "cuda_runtime", "torch", "transformers", "transformers_async_stop",
                "python", "date", "async_path_active", "reps"):
        lines.append(f"- {key}: {h[key]}")
    lines.append(f"- command: `{h['command']}`")
    for note in h["notes"]:
        lines.append(f"- note: {note}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in table_rows(result["runs"])]
    lines += [
        "",
        "ms/tok: decode wall time per generated token, (median t_N - median t_1) / (N - 1). "
        "speedup: stock ms / variant ms. -floor: variant ms - floor ms. "
        "floor: GPU time per decode step of the async run (torch.profiler, all CUDA-side events). "
        "syncs/step: blocking syncs per decode step (torch.cuda.set_sync_debug_mode). "
        "GPU-busy: floor / variant ms. peak MiB: torch.cuda.max_memory_allocated over an N-token call. "
        "exact: the variant's output sequences equal stock's (NO*: stock itself did not repeat bit for bit "
        "in this case, so the comparison is not conclusive).",
        "",
    ]
    return "\n".join(lines)


def write_png(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping --png {path}", file=sys.stderr)
        return
    runs = [r for r in result["runs"] if not r.get("error")]
    series = {v: [r["variants"].get(v, {}).get("ms_per_token") for r in runs] for v in result["header"]["variants"]}
    series["floor"] = [r["floor_ms_per_token"] for r in runs]
    series = {k: vals for k, vals in series.items() if any(x is not None for x in vals)}
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs) + 2), 4.5))
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=name)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r["label"] for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per generated token (decode)")
    ax.set_title(f"{result['header']['device_name']}: stock vs async vs floor", pad=28)
    # legend in one row above the plot, clear of the bars
    ax.legend(ncol=len(series), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m transformers_async_stop.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help="comma list of: tiny-llama, gpt2, llama-1b (default: all that fit the device; "
                                   "tiny only on CPU and with --quick)")
    p.add_argument("--modes", help="comma list of: eager, static (default: both)")
    p.add_argument("--batch", type=_int_list, help="comma list of batch sizes, replacing each case's own")
    p.add_argument("--new-tokens", type=int, help="tokens per generate() call, >= 2 (default: per case)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default: bf16 for llama-1b on CUDA, "
                                                          "else fp32)")
    p.add_argument("--reps", type=int, help="timed repetitions per variant, medians taken (default: 5, quick: 2)")
    p.add_argument("--model", metavar="PATH", help="a local checkpoint directory, benchmarked as an extra case")
    p.add_argument("--quick", action="store_true", help="tiny cases, few tokens, 2 reps (CPU CI)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the results as a Markdown table")
    p.add_argument("--png", metavar="PATH", help="bar chart of ms/token per run (needs matplotlib)")
    p.add_argument("--trace", metavar="DIR", help="write Chrome traces of ~8 decode steps, stock and async")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else 5
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.new_tokens is not None and args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode time is differenced against a 1-token call)")
    if args.modes and not set(m.strip() for m in args.modes.split(",")) <= {"eager", "static"}:
        p.error("--modes takes eager and/or static")
    return args


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(",") if x.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected a comma list of positive integers")
    return values


def _command(argv) -> str:
    if argv is None:
        return shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    return shlex.join([sys.executable, "-m", "transformers_async_stop.bench", *argv])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    apply()  # the stock and async variants run with our patches in place, whatever the caller did before
    notes: list[str] = []
    variants = [v for v in VARIANTS if v != "upstream" or upstream_available()]
    if "upstream" not in variants:
        notes.append(f"upstream column skipped: transformers {transformers.__version__} has no DeferredStopCheck "
                     "(5.17+)")
    elif device.type != "cuda":
        notes.append("upstream on CPU: DeferredStopCheck is only forced on for CUDA, so this is stock transformers")
    if device.type == "cuda":
        raise_compile_limits(notes)
    else:
        print(NO_CUDA_MESSAGE, file=sys.stderr)

    plan = plan_runs(args, device)
    total = sum(len(runs) for _, runs in plan) * len(variants)
    done = 0
    started = time.perf_counter()

    def progress(text: str, count: bool = True) -> None:
        nonlocal done
        if count:
            done += 1
            prefix = f"[{done}/{total}]"
        else:
            prefix = " " * len(f"[{total}/{total}]")
        print(f"{prefix} {text} ... ({time.perf_counter() - started:.0f}s)", file=sys.stderr, flush=True)

    records = []
    for case, runs in plan:
        dtype = DTYPES[runs[0].dtype]
        try:
            model = case.build(device, dtype)
        except Exception as exc:  # a case that cannot be built (e.g. out of memory) must not stop the others
            traceback.print_exc()
            records += [_error_record(run, exc) for run in runs]
            done += len(runs) * len(variants)
            continue
        for run in runs:
            done_before = done
            try:
                records.append(measure(model, run, variants, args, device, progress))
            except Exception as exc:  # one failing run (out of memory, a model without static cache) is reported
                traceback.print_exc()
                records.append(_error_record(run, exc))
                done = done_before + len(variants)
        del model  # the last reference: free() can only release what nothing holds
        free(device)

    print(f"done in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    result = {"header": header(device, _command(argv), args, variants, notes), "runs": records}
    if device.type != "cuda":
        print(NO_CUDA_MESSAGE)
    print(text_table(records))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(result))
    if args.png:
        write_png(result, args.png)
    return 1 if any(r.get("error") for r in records) else 0


def _error_record(run: Run, exc: BaseException) -> dict:
    return {"case": run.case.name, "mode": run.mode, "batch": run.batch, "decode": run.decode,
            "new_tokens": run.new_tokens, "prompt_len": run.case.prompt_len, "dtype": run.dtype, "label": run.label,
            "variants": {}, "floor_ms_per_token": None, "speedup": None, "async_minus_floor_ms": None,
            "exact": None, "error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    raise SystemExit(main())
