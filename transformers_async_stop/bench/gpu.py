"""CUDA-side figures and housekeeping: blocking syncs and peak memory of one call, GPU kernel time (the floor),
Chrome traces, compile limits, and freeing a case's model. Everything here but `write_trace`, `free` and
`raise_compile_limits` runs on CUDA only; the callers check the device.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import warnings

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

SAMPLE_SEED = 1234


def call(model, kwargs: dict, flag: dict):
    # seeded before every call so that sampling draws the same numbers in every variant
    torch.manual_seed(SAMPLE_SEED)
    return model.generate(**kwargs, **flag)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# An idle gap shorter than this between two device operations is the launch latency of back-to-back kernels
# (inside a CUDA graph, or queued well ahead); a longer one means the device had nothing queued: it waited for the
# host. The split is a reading aid, not a hard boundary.
LAUNCH_GAP_US = 10.0


def gpu_timeline(model, kwargs: dict, flag: dict, device: torch.device) -> dict:
    """Device time of one call, in ms: `busy` sums every CUDA-side event (kernels, copies, memsets) the profiler
    recorded (the floor); over the union of those events' intervals, `launch_gaps` sums the idle gaps shorter than
    LAUNCH_GAP_US and `starved` the longer ones."""
    return timeline_of(lambda: call(model, kwargs, flag), device)


def timeline_of(thunk, device: torch.device) -> dict:
    """`gpu_timeline` of whatever `thunk` runs (a workload's whole pass: `workloads/passes.py`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    # CUDA activity only: host-side events would add ~100k events per long call to parse, and are not summed
    with _quiet_profiler(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        thunk()
        torch.cuda.synchronize(device)
    spans = sorted((evt.time_range.start, evt.time_range.end) for evt in prof.events()
                   if evt.device_type == DeviceType.CUDA)
    busy = sum(end - start for start, end in spans)
    launch_gaps = starved = 0.0
    reach = None  # the end of the union of the intervals seen so far
    for start, end in spans:
        if reach is not None and start > reach:
            gap = start - reach
            if gap < LAUNCH_GAP_US:
                launch_gaps += gap
            else:
                starved += gap
        reach = end if reach is None else max(reach, end)
    return {"busy": busy / 1e3, "launch_gaps": launch_gaps / 1e3, "starved": starved / 1e3}


@contextlib.contextmanager
def _quiet_profiler():
    # each profile records one cycle; newer torch warns that events of earlier cycles would be dropped
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        yield


class ProfilerStepper(LogitsProcessor):
    """Advances a torch.profiler schedule once per decode step; no device work, so the traced run stays the same."""

    def __init__(self, prof):
        self.prof = prof

    def __call__(self, input_ids, scores):
        self.prof.step()
        return scores


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
            sync(device)


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
