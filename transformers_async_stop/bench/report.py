"""The outputs: the run header, the text table, the ratio summary, Markdown, JSON and a PNG bar chart."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys

import torch
import transformers

from .. import __version__
from ..config import force_deferred
from .tables import _aligned, _fmt, _md_table

NO_CUDA_MESSAGE = (
    "CUDA not available: blocking syncs per step, GPU-busy, the floor and memory are counted on CUDA only"
)
NO_RATIO_MESSAGE = "speed needs a GPU: on CPU there is no GPU idle time to win back, so these times make no speed claim"
FORCED_MESSAGE = ("CPU: the async rows run the deferred loop, forced (TRANSFORMERS_ASYNC_STOP_FORCE=1), so that its "
                  "output can be checked against stock; unforced, the flag runs the stock loop on CPU")
CPU_CHART_NOTE = "CPU: no speed claim"
METHOD = ("ms/tok: per rep, (t_N - t_1) / (N - 1) from an N-token and a 1-token call made back to back; the median "
          "over reps. IQR: the interquartile range of those per-rep values, as a % of the median. Variants run "
          "interleaved, rep by rep, in an order rotated each rep.")
LEGEND = (
    "vs stock: stock ms / variant ms (> 1: faster than transformers as shipped), vs upstream: upstream ms / async "
    "ms; each ratio is taken within a rep and the median over reps given (so it can differ a little from the ratio "
    "of the medians). "
    "-floor: variant ms - floor ms. floor: GPU time per decode step of the async run (torch.profiler, all CUDA-side "
    "events). syncs/step: blocking syncs per decode step (torch.cuda.set_sync_debug_mode). GPU-busy: floor / "
    "variant ms. peak MiB: torch.cuda.max_memory_allocated over an N-token call. exact: the variant's output "
    "sequences equal stock's (NO*: stock itself did not repeat bit for bit in this run, so the comparison is not "
    "conclusive). Ratios are comparable only within one run: host speed differs between machines (see the host "
    "reference)."
)
RATIO_TITLES = (("async_vs_stock", "async/stock"), ("async_vs_upstream", "async/upstream"),
                ("imported_vs_stock", "imported/stock (±2%)"))


# --- header -------------------------------------------------------------------------------------------------------
def header(device: torch.device, command: str, args, timed: list[str], floor: bool, notes: list[str],
           reference: dict) -> dict:
    cuda = device.type == "cuda"
    return {
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
        "variants": timed + (["floor"] if floor else []),
        "reps": args.reps,
        "quick": args.quick,
        "method": METHOD,
        "host_reference": reference,
        "notes": notes + ([] if cuda else [NO_CUDA_MESSAGE] + ([FORCED_MESSAGE] if force_deferred() else [])),
    }


def reference_line(ref: dict) -> str:
    if ref.get("ms_per_token") is None:
        return f"host reference (stock tiny-llama eager b1 ms/token): not measured ({ref.get('source')})"
    return (f"host reference: stock tiny-llama eager b1 fp32, {ref['new_tokens']} tokens: "
            f"{ref['ms_per_token']:.3f} ms/token, IQR {_fmt(ref.get('iqr_pct'), '.1f', '%')} ({ref['source']}); "
            "ratios are compared only within a run")


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


# --- table --------------------------------------------------------------------------------------------------------
def _exact(m: dict, run: dict) -> str:
    if m.get("exact") is None:
        return ""
    return "yes" if m["exact"] else ("NO" if run.get("stock_repeatable", True) else "NO*")


# (title, cell of a variant row, CUDA only); the floor row fills ms/tok alone
COLUMNS = (
    ("ms/tok", lambda m, r: _fmt(m["ms_per_token"], ".3f"), False),
    ("IQR", lambda m, r: _fmt(m["iqr_pct"], ".1f", "%"), False),
    ("vs stock", lambda m, r: _fmt(m.get("speedup"), ".2f", "x"), True),
    ("vs upstream", lambda m, r: _fmt(m.get("vs_upstream"), ".2f", "x") if "vs_upstream" in m else "", True),
    ("-floor ms", lambda m, r: _fmt(m["minus_floor_ms"], "+.3f"), True),
    ("syncs/step", lambda m, r: _fmt(m["syncs_per_step"], ".2f"), True),
    ("GPU-busy", lambda m, r: _fmt(m["gpu_busy"] * 100 if m["gpu_busy"] is not None else None, ".0f", "%"), True),
    ("peak MiB", lambda m, r: _fmt(m["peak_mem_mib"], ".0f"), True),
    ("exact", _exact, False),
    ("path", lambda m, r: m.get("path") or "", False),
)
KEY = ("case", "mode", "batch", "decode", "variant")


def columns(cuda: bool) -> list[tuple]:
    return [c for c in COLUMNS if cuda or not c[2]]


def table_rows(runs: list[dict], cuda: bool) -> list[tuple[str, ...]]:
    """One row per run and variant, plus the floor row."""
    cols = columns(cuda)
    rows = []
    for r in runs:
        key = (r["case"], r["mode"], str(r["batch"]), r["decode"])
        if r.get("error"):
            rows.append(key + ("ERROR", r["error"].splitlines()[0][:60]) + ("",) * (len(cols) - 1))
            continue
        for v, m in r["variants"].items():
            rows.append(key + (v,) + tuple(cell(m, r) for _, cell, _ in cols))
        if r["floor_ms_per_token"] is not None:
            rows.append(key + ("floor", _fmt(r["floor_ms_per_token"], ".3f")) + ("",) * (len(cols) - 1))
    return rows


def ratio_rows(runs: list[dict]) -> list[tuple[str, ...]]:
    """One row per run with ratios (CUDA): value [quartiles of the per-rep paired ratios]."""
    rows = []
    for r in runs:
        if not r.get("ratios"):
            continue
        cells = []
        for name, _ in RATIO_TITLES:
            entry = r["ratios"].get(name)
            if entry is None or entry["value"] is None:
                cells.append("-")
                continue
            text = f"{entry['value']:.2f}x"
            if entry["paired"]:
                text += f" [{entry['paired']['q1']:.2f}-{entry['paired']['q3']:.2f}]"
            if "within_tolerance" in entry:
                text += " ok" if entry["within_tolerance"] else " OUTSIDE"
            cells.append(text)
        rows.append((r["label"],) + tuple(cells))
    return rows


GAP_TITLES = ("run", "async ms/tok", "kernels (floor)", "launch gaps", "starved")


def gap_rows(runs: list[dict]) -> list[tuple[str, ...]]:
    """Where the async run's time per step goes on the device (CUDA): kernels, the short idle gaps between
    back-to-back kernels, and the long ones where the device had nothing queued (it waited for the host)."""
    rows = []
    for r in runs:
        gaps, async_ = r.get("async_gaps_ms"), r.get("variants", {}).get("async")
        if not gaps or not async_:
            continue
        rows.append((r["label"], _fmt(async_["ms_per_token"], ".3f"), _fmt(r["floor_ms_per_token"], ".3f"),
                     _fmt(gaps["launch_gaps"], ".3f"), _fmt(gaps["starved"], ".3f")))
    return rows


GAP_LEGEND = ("device time per step of the async run (ms, from a CUDA-only profile): kernels = the floor; launch "
              "gaps = idle gaps under 10 us between device operations (kernel launch latency, also inside CUDA "
              "graphs); starved = longer idle gaps, when nothing was queued (the device waited for the host)")


def text_report(result: dict) -> str:
    h, runs = result["header"], result["runs"]
    cuda = h["gpu_figures"]
    lines = [f"{h['device_name']} ({h['device']}), torch {h['torch']}, transformers {h['transformers']}, "
             f"transformers_async_stop {h['transformers_async_stop']}, {h['reps']} reps",
             reference_line(h["host_reference"])]
    lines += [f"note: {n}" for n in h["notes"]]
    lines += ["", _aligned([KEY + tuple(t for t, _, _ in columns(cuda))] + table_rows(runs, cuda))]
    rows = ratio_rows(runs)
    if rows:
        lines += ["", "ratios: baseline ms / variant ms within each rep, median over reps (> 1: the variant is "
                      "faster); in brackets the quartiles over reps",
                  _aligned([("run",) + tuple(t for _, t in RATIO_TITLES)] + rows)]
    rows = gap_rows(runs)
    if rows:
        lines += ["", GAP_LEGEND, _aligned([GAP_TITLES] + rows)]
    from . import assisted, summary  # their rows format with this module's helpers
    from .workloads import report as workloads_report

    closing = "" if cuda else "\n\n" + NO_RATIO_MESSAGE
    return ("\n".join(lines) + assisted.text_report(result) + workloads_report.text_report(result)
            + summary.text_report(result) + closing)


# --- files --------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    h, runs = result["header"], result["runs"]
    cuda = h["gpu_figures"]
    lines = ["# transformers_async_stop decode benchmark", ""]
    for key in ("device_name", "device", "driver", "cuda_runtime", "torch", "transformers", "transformers_async_stop",
                "python", "date", "async_path_active", "variants", "reps"):
        lines.append(f"- {key}: {h[key]}")
    lines.append(f"- {reference_line(h['host_reference'])}")
    lines.append(f"- command: `{h['command']}`")
    lines += [f"- note: {note}" for note in h["notes"]]
    lines += ["", _md_table(KEY + tuple(t for t, _, _ in columns(cuda)), table_rows(runs, cuda))]
    rows = ratio_rows(runs)
    if rows:
        lines += ["", "Ratios (baseline ms / variant ms within each rep, median over reps; in brackets the "
                  "quartiles over reps):", "",
                  _md_table(("run",) + tuple(t for _, t in RATIO_TITLES), rows)]
    rows = gap_rows(runs)
    if rows:
        lines += ["", GAP_LEGEND + ".", "", _md_table(GAP_TITLES, rows)]
    lines += ["", METHOD + " " + (LEGEND if cuda else "exact: the variant's output sequences equal stock's."),
              "path: the path the variant's generate() took (`transformers_async_stop.last_path()`).", ""]
    if not cuda:
        lines += [f"**{NO_RATIO_MESSAGE}.**", ""]
    from . import assisted, summary
    from .workloads import report as workloads_report

    return "\n".join(lines) + assisted.markdown(result) + workloads_report.markdown(result) + summary.markdown(result)


def write_outputs(result: dict, args) -> None:
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(result))
    if args.png:
        write_png(result, args.png)


CHART_INSTALL = "pip install 'transformers_async_stop[bench]'"


def can_chart() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def chart_series(result: dict) -> tuple[list[dict], dict[str, list]]:
    """The runs with a stock row, and per variant (floor included) each run's (ratio, low, high) to stock's median:
    variant ms / stock ms (< 1: faster than stock), the bounds from the variant's interquartile range."""
    runs = [r for r in result["runs"] if not r.get("error") and r["variants"].get("stock")]
    names = [v for v in result["header"]["variants"] if v not in ("stock", "floor")] + ["floor"]
    series = {}
    for name in names:
        values = []
        for r in runs:
            base = r["variants"]["stock"]["ms_per_token"]
            m = r["variants"].get(name) if name != "floor" else (
                {"ms_per_token": r["floor_ms_per_token"]} if r["floor_ms_per_token"] is not None else None)
            if m is None or not base:
                values.append(None)
                continue
            ratio = m["ms_per_token"] / base
            values.append((ratio, m.get("q1", m["ms_per_token"]) / base, m.get("q3", m["ms_per_token"]) / base))
        if any(v is not None for v in values):
            series[name] = values
    return runs, series


def write_png(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = result["header"]
    runs, series = chart_series(result)
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(runs) + 2), 5.2))
    ax.axhline(1.0, color="0.3", linewidth=1, linestyle="--", label="stock = 1")
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(runs))]
        heights = [v[0] if v else 0.0 for v in values]
        low = [max(0.0, v[0] - v[1]) if v else 0.0 for v in values]
        high = [max(0.0, v[2] - v[0]) if v else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, yerr=[low, high], capsize=2, label=name)
        for bar, v in zip(bars, values):
            if v:
                ax.annotate(f"{v[0]:.2f}", (bar.get_x() + bar.get_width() / 2, v[2]), ha="center", va="bottom",
                            fontsize=6, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([f"{r['label']}\nstock {r['variants']['stock']['ms_per_token']:.3f} ms/tok" for r in runs],
                       rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("decode time per token / stock's (lower is faster)\nmedian over reps, bars: IQR")
    ax.set_ylim(0, max([1.2] + [v[2] * 1.12 for values in series.values() for v in values if v]))
    cpu = not h["gpu_figures"]
    title = (f"{h['device_name']} ({h['device']}), torch {h['torch']}, transformers {h['transformers']}, "
             f"transformers_async_stop {h['transformers_async_stop']}")
    if cpu:
        title += f"\n{CPU_CHART_NOTE}: the flag wins back GPU idle time, and a CPU has none"
        ax.text(0.5, 0.5, CPU_CHART_NOTE, transform=ax.transAxes, ha="center", va="center", fontsize=28,
                color="tab:red", alpha=0.25, rotation=15)
    ax.set_title(title, fontsize=9, pad=30)
    # legend in one row above the plot, clear of the bars
    ax.legend(ncol=len(series) + 1, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
