"""Side-by-side decode benchmark: transformers as shipped vs this package, flag off and on, vs upstream's
DeferredStopCheck, vs the GPU floor.

    python -m transformers_async_stop.bench                       # every case that fits the device
    python -m transformers_async_stop.bench --quick               # tiny cases only (CPU CI)
    python -m transformers_async_stop.bench --cases llama-1b --modes static --json out.json --markdown out.md

Every case builds one model (random weights from a config, no hub download) and runs every variant on it, in one
process:

- stock:    transformers as shipped: the package unpatched (re-applied afterwards), no flag keyword;
- imported: the package applied, async_stopping_criteria=False;
- async:    the package applied, async_stopping_criteria=True;
- upstream: the package unpatched, transformers' own DeferredStopCheck (5.17+) forced on for CUDA;
- floor:    GPU kernel time per decode step of the async run (torch.profiler), CUDA only.

ms/token: per rep, (t_N - t_1) / (N - 1) from an N-token and a 1-token call made back to back; the median over reps,
with the interquartile range as the spread. The variants run interleaved rep by rep, the order rotated each rep.
Every call generates exactly its budget (min_new_tokens == max_new_tokens), so the variants do the same work.
Speedups are against stock; async is also compared with upstream, and imported with stock (must stay within 2%).
On CPU no ratio is printed: nothing about GPU idle time is measured there. Every timed call's path is read: the
path shown is the timed calls' own; timed calls that took different paths, or made or dropped a recording of the
graphed forward, are listed, and --back-to-back adds a per-step figure free of what the rotation puts between calls.

Workload cases (opt-in: varied-lengths-llama-1b, padded-batches-llama-1b, conversation-llama-1b) are sequences of
calls as users run them (prompt lengths that change call to call, left-padded batches of 4-16, a conversation that
continues its cache), timed as whole passes: per variant, in a thread started for it (cuDNN keeps its per-length
SDPA plans per thread, so every KV length is met anew there), a cold pass and then a warm pass over the same calls;
the cold share is (cold - warm) / cold. Every call's output is checked against stock's.

Modules: cases (what runs), assisted (assisted decoding's cases and figures), workloads (the workload cases, their
passes and table), catalog (the built-in cases), variants (how transformers is set up for each), measure (timing,
exactness, ratios), gpu (syncs, floor, traces), report (table, Markdown, JSON, PNG), summary (one row per run: the
docs' table), tables (their cells), cli (options and main).
"""

# The command line: options, the loop over cases and runs, the host-speed reference, and the outputs. This
# docstring is the --help text and the package's docstring (`bench/__init__.py` takes it from here).

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import traceback

import torch

from .. import apply
from ..config import FORCE_ENV
from . import assisted, gpu, report, workloads
from .cases import DTYPES, MODES, REFERENCE_CASE, Case, Run, plan_runs, run_of
from .catalog import builtin_cases
from .measure import error_record, measure_run
from .variants import VARIANTS, Selection, select

QUICK_REPS = 3
REPS = 7


def parse_args(argv, cases: dict[str, Case] | None = None):
    cases = builtin_cases() if cases is None else cases
    p = argparse.ArgumentParser(prog="python -m transformers_async_stop.bench", description=__doc__,
                                epilog=cases_help(cases), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help="comma list of the cases below (default: every case not marked opt-in that fits "
                                   "the device; the tiny ones only on CPU and with --quick)")
    p.add_argument("--modes", help="comma list of: eager, static (default: both)")
    p.add_argument("--variants", help=f"comma list of: {', '.join(VARIANTS)} (default: all; upstream needs "
                                      "transformers 5.17+, floor needs CUDA)")
    p.add_argument("--batch", type=_int_list, help="comma list of batch sizes, replacing each case's own")
    p.add_argument("--new-tokens", type=int, help="tokens per generate() call, >= 2 (default: per case)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default: bf16 for llama-1b on CUDA, "
                                                          "else fp32)")
    p.add_argument("--reps", type=int, help=f"timed repetitions, variants interleaved; medians and IQR taken "
                                            f"(default: {REPS}, quick: {QUICK_REPS})")
    p.add_argument("--back-to-back", type=int, default=0, metavar="K",
                   help="after the rotated reps, K more N-token calls per variant, each right after the same "
                        "variant's N-token call: a second per-step figure, free of what the rotation puts between "
                        "calls (default: 0, none)")
    p.add_argument("--workload-reps", type=int, default=1, metavar="R",
                   help="cold and warm pass pairs per variant of the workload cases, each in a fresh thread "
                        "(default: 1)")
    p.add_argument("--model", metavar="PATH", help="a local checkpoint directory, benchmarked as an extra case")
    p.add_argument("--quick", action="store_true", help=f"tiny cases, few tokens, {QUICK_REPS} reps (CPU CI)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the results as Markdown tables")
    p.add_argument("--png", metavar="PATH", help="bar chart of each variant's time per token relative to stock "
                                                 "(needs matplotlib: pip install 'transformers_async_stop[bench]')")
    p.add_argument("--trace", metavar="DIR", help="write Chrome traces of ~8 decode steps, stock and async")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = QUICK_REPS if args.quick else REPS
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.back_to_back < 0 or args.workload_reps < 1:
        p.error("--back-to-back must be >= 0 and --workload-reps >= 1")
    if args.new_tokens is not None and args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode time is differenced against a 1-token call)")
    if args.modes and not {m.strip() for m in args.modes.split(",") if m.strip()} <= set(MODES):
        p.error("--modes takes eager and/or static")
    if args.png and not report.can_chart():
        p.error(f"--png needs matplotlib, which is not installed: {report.CHART_INSTALL}")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    if args.variant_list and not set(args.variant_list) <= set(VARIANTS):
        p.error(f"--variants takes {', '.join(VARIANTS)}")
    return args


def cases_help(cases: dict[str, Case]) -> str:
    """`--help`'s list of the cases, one line each: the docs are not where a user running the command looks."""
    width = max(map(len, cases), default=0)
    lines = [f"  {name:<{width}}  {'(opt-in) ' if case.opt_in else ''}{case.about}".rstrip()
             for name, case in cases.items()]
    return ("cases (--cases): each on a DynamicCache and a static cache, assisted decoding, prompt lookup and the\n"
            "workloads on a DynamicCache only; the sample, left-padded and beam runs go to llama-1b (else to\n"
            "the tiny Llama case)\n"
            + "\n".join(lines))


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(",") if x.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected a comma list of positive integers")
    return values


def _command(argv) -> str:
    if argv is None:
        return shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    return shlex.join([sys.executable, "-m", "transformers_async_stop.bench", *argv])


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def __call__(self, text: str, count: bool = True) -> None:
        if count:
            self.done += 1
            prefix = f"[{self.done}/{self.total}]"
        else:
            prefix = " " * len(f"[{self.total}/{self.total}]")
        print(f"{prefix} {text} ... ({self.elapsed():.0f}s)", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def main(argv=None, cases: dict[str, Case] | None = None) -> int:
    """Run the benchmark; `cases` replaces the built-in cases (tests pass their own). Returns the exit code."""
    args = parse_args(argv, cases)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with _forced_on_cpu(device):
        return _main(args, argv, cases, device)


@contextlib.contextmanager
def _forced_on_cpu(device: torch.device):
    """On CPU the async rows run the deferred loop (unless the caller set the switch), so that the run checks its
    output against stock and shows its path; unforced, the flag would run the stock loop there."""
    if device.type == "cuda" or FORCE_ENV in os.environ:
        yield
        return
    os.environ[FORCE_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(FORCE_ENV, None)


def _main(args, argv, cases, device: torch.device) -> int:
    apply()  # whatever the caller did before: the variants start from the package applied
    cases = builtin_cases() if cases is None else cases
    sel = select(args.variant_list, device)
    notes = list(sel.notes)
    if device.type == "cuda":
        gpu.raise_compile_limits(notes)
    else:
        print(report.NO_CUDA_MESSAGE, file=sys.stderr)

    plan = plan_runs(args, device, cases)
    assisted.install_metric()  # acceptance figures of the assisted-decoding cases (bench/assisted.py)
    if "upstream" in sel.timed and any(run.decode == "beam" for _, runs in plan for run in runs):
        notes.append("upstream's DeferredStopCheck covers greedy and sampling (_sample) only: in the beam rows, "
                     "upstream is stock transformers")
    progress = Progress(sum(len(runs) for _, runs in plan) * len(sel.timed))
    records = []
    for case, runs in plan:
        records += measure_case(case, runs, sel, args, device, progress)
    reference = host_reference(records, args, device, progress)
    print(f"done in {progress.elapsed():.0f}s", file=sys.stderr)

    result = {"header": report.header(device, _command(argv), args, sel.timed, sel.floor, notes, reference),
              "runs": records}
    print(report.text_report(result))
    report.write_outputs(result, args)
    return 1 if any(r.get("error") for r in records) else 0


def measure_case(case: Case, runs, sel: Selection, args, device: torch.device, progress: Progress) -> list[dict]:
    """Build the case's model once and measure each of its runs; a failure is recorded, never raised."""
    try:
        model = case.build(device, DTYPES[runs[0].dtype])
    except Exception as exc:  # a case that cannot be built (e.g. out of memory) must not stop the others
        traceback.print_exc()
        progress.done += len(runs) * len(sel.timed)
        return [error_record(run, exc) for run in runs]
    records = []
    for run in runs:
        done_before = progress.done
        try:
            if case.workload:
                records.append(workloads.measure_workload(model, run, sel, args.workload_reps, device, progress))
                continue
            records.append(measure_run(model, run, sel, args.reps, device, progress, args.trace,
                                       back_to_back=args.back_to_back))
        except Exception as exc:  # one failing run (out of memory, a model without static cache) is reported
            traceback.print_exc()
            records.append(error_record(run, exc))
            progress.done = done_before + len(sel.timed)
    del model  # the last reference: free() can only release what nothing holds
    gpu.free(device)
    return records


def host_reference(records: list[dict], args, device: torch.device, progress: Progress) -> dict:
    """Stock tiny-llama eager b1 ms/token: this run's own row if it has one, else a quick measurement of it."""
    for r in records:
        stock = r["variants"].get("stock")
        if r["case"] == REFERENCE_CASE and (r["mode"], r["batch"], r["decode"], r["dtype"]) == (
                "eager", 1, "greedy", "fp32") and stock:
            return _reference(r, stock, "this run's tiny-llama eager b1 row")
    case = builtin_cases()[REFERENCE_CASE]
    run = Run(case, "eager", 1, "greedy", run_of(case, args, device, "eager", 1).new_tokens, "fp32")
    sel = Selection(["stock"], floor=False, notes=[])
    progress.total += 1
    try:
        model = case.build(device, DTYPES["fp32"])
        r = measure_run(model, run, sel, args.reps, device, progress)
    except Exception as exc:
        traceback.print_exc()
        return {"ms_per_token": None, "source": f"not measured: {type(exc).__name__}: {exc}"}
    del model
    gpu.free(device)
    return _reference(r, r["variants"]["stock"], "measured separately, stock only")


def _reference(r: dict, stock: dict, source: str) -> dict:
    return {"case": f"{r['case']} eager b1 greedy fp32", "new_tokens": r["new_tokens"],
            "ms_per_token": stock["ms_per_token"], "iqr_pct": stock["iqr_pct"], "source": source}
