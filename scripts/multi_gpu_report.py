"""scripts/multi_gpu_bench.py's output: the run's header, the tensor-parallel ranks' records merged into one per
configuration, and the Markdown table."""

from __future__ import annotations

import copy
import shlex
import subprocess
import sys

import torch

import multi_gpu_measure as mm


def merge_ranks(names: list[str], reports: list[dict], error: str | None) -> list[dict]:
    """One record per tensor-parallel configuration: rank 0's timing (the ranks run in lockstep), every rank's
    syncs, each rank's own device's busy fraction, and equality on every rank and across ranks."""
    merged = []
    for name in names:
        found = [r for report in reports for r in report.get("records", []) if r["config"] == name]
        failed = [r for r in found if r.get("error")]
        if failed:
            merged.append(mm.error_record(name, failed[0]["error"]))
            continue
        if len(found) < 2:
            merged.append(mm.error_record(name, error or f"{len(found)} of 2 ranks reported"))
            continue
        found.sort(key=lambda r: r["rank"])
        record = copy.deepcopy(found[0])
        record.pop("rank", None)
        for label, entry in record["variants"].items():
            per_rank = [r["variants"][label] for r in found]
            entry["ms_per_token_ranks"] = [e["ms_per_token"] for e in per_rank]
            entry["syncs_per_step_ranks"] = [e["syncs_per_step"] for e in per_rank]
            entry["paths_ranks"] = [e["path"] for e in per_rank]
            if all(e["busy"] is not None for e in per_rank):
                entry["busy"] = {d: f for e in per_rank for d, f in e["busy"].items()}
                entry["busy_ms_per_token"] = {d: f for e in per_rank for d, f in e["busy_ms_per_token"].items()}
        record["ranks_agree"] = all(r["variants"][label]["ids_sha1"] == found[0]["variants"][label]["ids_sha1"]
                                    for r in found for label in ("stock", "flag"))
        record["equal"] = all(r["equal"] for r in found) and record["ranks_agree"]
        record["stock_repeatable"] = all(r["stock_repeatable"] for r in found)
        record["rank_records"] = found
        record["load_s_ranks"] = [report.get("load_s") for report in reports]
        merged.append(record)
    return merged


def summary(record: dict) -> str:
    """One line per finished configuration, for the progress log."""
    if record.get("error"):
        return record["error"][:200]
    stock, flag = record["variants"]["stock"], record["variants"]["flag"]
    return (f"stock {_num(stock['ms_per_token'])} ms/token, flag {_num(flag['ms_per_token'])}, syncs/step "
            f"{_syncs(stock, record['kind'] == 'tp')} -> {_syncs(flag, record['kind'] == 'tp')}, token ids "
            f"{'equal' if record['equal'] else 'DIFFER'}; flag path: {flag['path']}")


def header(args, config, devices: list[torch.device], notes: list[str], elapsed_s: float) -> dict:
    import transformers

    cuda = devices[0].type == "cuda"
    return {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
        "devices": [torch.cuda.get_device_name(d) if cuda else "cpu" for d in devices],
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "commit": _commit(),
        "model": {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "heads":
                  config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                  "intermediate": config.intermediate_size, "vocab": config.vocab_size},
        "dtype": "fp32" if not cuda else "bf16", "new_tokens": args.new_tokens, "reps": args.reps,
        "prompt_len": mm.PROMPT_LEN, "budget_s": args.budget_s, "elapsed_s": elapsed_s, "notes": notes,
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", mm.ROOT, "log", "-1", "--format=%h"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _syncs(entry: dict, tp: bool) -> str:
    if tp and entry.get("syncs_per_step_ranks"):
        return "/".join(_num(s) for s in entry["syncs_per_step_ranks"])
    return _num(entry.get("syncs_per_step"))


def _busy(entry: dict) -> str:
    busy = entry.get("busy")
    if not busy:
        return "-"
    return " / ".join(_num(busy[d], "{:.0%}") if busy[d] is not None else "-" for d in sorted(busy))


def _label(record: dict) -> str:
    kind = "device_map split" if record["kind"] == "dm" else "tensor parallel (2 ranks)"
    padded = ", left-padded" if record["batch"] > 1 else ""
    return f"{kind}, {record['cache']} cache, b{record['batch']}{padded}"


def markdown(head: dict, records: list[dict]) -> str:
    m = head["model"]
    lines = [
        f"Devices: {', '.join(head['devices'])}; torch {head['torch']} (CUDA {head['cuda']}), transformers "
        f"{head['transformers']}, commit {head['commit']}.",
        f"Model: Llama, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads ({m['kv_heads']} KV), "
        f"intermediate {m['intermediate']}, vocab {m['vocab']}, {head['dtype']}, random weights. Greedy, prompt "
        f"{head['prompt_len']} tokens, {head['new_tokens']} new tokens per call, {head['reps']} reps per variant "
        f"(median; stock and flag alternated). Took {head['elapsed_s']:.0f} s.",
        "",
        "| configuration | stock ms/token | flag ms/token | stock/flag | syncs/step stock → flag | "
        "GPU busy stock (cuda:0 / cuda:1) | GPU busy flag (cuda:0 / cuda:1) | token ids equal | flag path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        if record.get("error"):
            error = " ".join(record["error"].split()).replace("|", "/")[:200]
            lines.append(f"| {_label(record)} | {error} |  |  |  |  |  |  |  |")
            continue
        stock, flag = record["variants"]["stock"], record["variants"]["flag"]
        tp = record["kind"] == "tp"
        equal = "yes" if record["equal"] else "**no**" + ("" if record["stock_repeatable"] else
                                                          " (stock does not repeat itself)")
        lines.append(
            f"| {_label(record)} | {_num(stock['ms_per_token'])} | {_num(flag['ms_per_token'])} | "
            f"{_num(record['speedup'], '{:.3f}')} | {_syncs(stock, tp)} → {_syncs(flag, tp)} | {_busy(stock)} | "
            f"{_busy(flag)} | {equal} | {flag['path']} |")
    lines.append("")
    lines.append("ms/token: (t_N - t_1) / (N - 1) per rep, median over reps; tensor parallel: rank 0's clock, syncs "
                 "per rank (rank 0/rank 1), each rank's busy fraction of its own GPU. GPU busy: the union of a "
                 "device's kernel, copy and memset intervals per decode step over ms/token (an NCCL kernel waiting "
                 "for its peer counts as busy).")
    lines += [f"Note: {n}" for n in head["notes"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit("run scripts/multi_gpu_bench.py")
