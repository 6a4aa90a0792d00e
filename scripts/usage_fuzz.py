"""Run N usage scenarios (tests/usage_scenarios.py) stock vs `async_stopping_criteria=True`, print the counts and the
shrunk failing scenarios.

    python scripts/usage_fuzz.py --draws 1000 --seed 0 [--device cuda] [--only 3,17] [--shrink 120] [--json out.json]
    python scripts/usage_fuzz.py --only 51,177 --drawn-for cuda --graphed emulated   # CUDA seeds, emulated on the CPU

Counts: drawn, passed, failed, skipped (stock raised, and the flag raised the same: nothing else to compare), and
crashed outside generate() (the harness or a poisoned process). Each failure is shrunk (`--shrink` tries, 0: off) to
a minimal scenario, printed as JSON that `--scenario '<json>'` replays. On CPU the deferred path is forced
(TRANSFORMERS_ASYNC_STOP_FORCE=1, as the CPU test suite does). `--graphed` sets issue 27's dimension on every
scenario (threads included) instead of the drawn value: `emulated` runs the flag run under the CPU emulation of CUDA
graphs; `--drawn-for cuda` draws the seeds as a CUDA run does (to replay a CUDA run's seeds on the CPU). The counts
end with how many flag runs took the graphed forward in at least one call (`graphed`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="")
    ap.add_argument("--scenario", default="", help="one scenario as JSON (a shrunk one) instead of seeds")
    ap.add_argument("--device", default=os.environ.get("TAS_USAGE_DEVICE", "cpu"))
    ap.add_argument("--shrink", type=int, default=120, help="shrinking tries per failure (0: no shrinking)")
    ap.add_argument("--max-failures", type=int, default=20, help="stop after this many failures")
    ap.add_argument("--json", default="", help="write the counts and failures here")
    ap.add_argument("--workers", type=int, default=1, help="split the seeds over this many processes (one GPU "
                                                            "is mostly idle between a tiny model's steps)")
    ap.add_argument("--graphed", default="", choices=("", "emulated", "off", "natural"),
                    help="issue 27's dimension for every scenario (default: as drawn)")
    ap.add_argument("--drawn-for", default="", help="draw the seeds for this device (default: --device)")
    args = ap.parse_args()
    if args.workers > 1 and not args.scenario:
        return _fan_out(args)
    if args.device == "cpu":
        os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    import usage_dimensions
    import usage_runner
    from usage_runner import check
    from usage_scenarios import draw, dumps, shrink

    if args.scenario:
        scenarios = [(None, json.loads(args.scenario))]
    else:
        seeds = [int(s) for s in args.only.split(",") if s.strip()] or range(args.seed, args.seed + args.draws)
        scenarios = [(s, draw(s, args.drawn_for or args.device)) for s in seeds]
    if args.graphed:
        for _, sc in scenarios:
            for s in (sc, sc.get("threads", {}).get("other")):
                if s is not None:
                    s["graphed"] = args.graphed

    def outcome(sc):
        try:
            return check(sc, args.device)
        except Exception as exc:  # noqa: BLE001
            return "crashed", f"{type(exc).__name__} outside generate(): {exc}"

    counts, failures, start, cpu0 = collections.Counter(), [], time.time(), time.process_time()
    skips = collections.Counter()
    print(f"transformers {transformers.__version__}, device {args.device}", flush=True)
    for seed, sc in scenarios:
        status, detail = outcome(sc)
        counts["drawn"] += 1
        counts["graphed"] += any((path or "").startswith("graphed") for path in usage_runner.LAST_FORWARD)
        if counts["drawn"] % 25 == 0:
            print(f"  {counts['drawn']} drawn, {time.time() - start:.0f}s: {dict(counts)}", flush=True)
        counts[{"pass": "passed", "fail": "failed", "stock_err": "skipped_stock_errs"}.get(status, status)] += 1
        if status == "stock_err":  # what stock raised (a high count of one reason: a dimension drawn in vain)
            parts = detail.split(": ", 2)  # "turn T: Type: message"
            skips[": ".join(parts[1:])[:70] if len(parts) == 3 else detail[:70]] += 1
        if status in ("fail", "crashed") and ("device-side assert" in detail or "CUDA error" in detail):
            # the process's CUDA context is gone: every later scenario would fail the same way
            print(f"FAIL seed {seed} (CUDA unusable after it, stopping): {detail[:400]}", flush=True)
            failures.append({"seed": seed, "detail": detail, "scenario": sc})
            counts["crashed"] += 1
            break
        if status in ("fail", "crashed"):
            print(f"FAIL seed {seed}: {detail[:2000]}", flush=True)
            small, again = sc, None
            if args.shrink:
                small = shrink(sc, lambda c: outcome(c)[0] == status, budget=args.shrink)
                again = outcome(small)
            # the first detail is kept: a failure that does not happen again (a race) has none on the re-run
            failures.append({"seed": seed, "detail": detail, "scenario": sc, "shrunk": small,
                             "shrunk_outcome": again})
            print(f"  shrunk: {dumps(small)}\n  re-run: {again[0] if again else '-'}: "
                  f"{(again[1] if again else '')[:600]}", flush=True)
            if len(failures) >= args.max_failures:
                print("stopping: --max-failures reached")
                break
    elapsed = time.time() - start
    print(f"transformers {transformers.__version__} device {args.device}: " +
          " ".join(f"{k}={counts[k]}" for k in ("drawn", "passed", "failed", "skipped_stock_errs", "crashed", "graphed")) +
          f" in {elapsed:.0f}s ({time.process_time() - cpu0:.0f}s of CPU)")
    for reason, n in skips.most_common(8):
        print(f"  skipped {n}: stock raised {reason}")
    by_value = collections.Counter(v for f in failures for v in usage_dimensions.reached(f["scenario"]))
    if by_value:  # issue 25's dimension values among the failing scenarios (not proof of cause: shrink for that)
        print("  failing scenarios per dimension value: " +
              ", ".join(f"{v} {n}" for v, n in sorted(by_value.items(), key=lambda kv: -kv[1])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "device": args.device, "counts": counts,
                       "seconds": elapsed, "failures": failures, "skips": skips}, f, indent=1, default=str)
    return 1 if failures else 0


def _fan_out(args) -> int:
    """Run the seeds in `args.workers` processes of this script (contiguous slices), then add up their counts."""
    import subprocess
    import tempfile

    seeds = [int(x) for x in args.only.split(",") if x.strip()] or list(range(args.seed, args.seed + args.draws))
    tmp = tempfile.mkdtemp(prefix="usage_fuzz_")
    procs = []
    for w in range(args.workers):
        part = seeds[w::args.workers]
        if not part:
            continue
        out = os.path.join(tmp, f"w{w}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(map(str, part)), "--device",
               args.device, "--shrink", str(args.shrink), "--max-failures", str(args.max_failures), "--json", out]
        cmd += ["--graphed", args.graphed] if args.graphed else []
        cmd += ["--drawn-for", args.drawn_for] if args.drawn_for else []
        procs.append((subprocess.Popen(cmd), out))
    counts, failures, version, seconds = collections.Counter(), [], "?", 0.0
    for proc, out in procs:
        proc.wait()
        if not os.path.exists(out):
            counts["crashed"] += 1  # the worker itself died (a device-side assert ends a CUDA process)
            continue
        with open(out) as f:
            data = json.load(f)
        counts.update(data["counts"])
        failures.extend(data["failures"])
        version, seconds = data["transformers"], max(seconds, data["seconds"])
    print(f"TOTAL transformers {version} device {args.device} workers {args.workers}: " +
          " ".join(f"{k}={counts[k]}" for k in ("drawn", "passed", "failed", "skipped_stock_errs", "crashed", "graphed")) +
          f" (slowest worker {seconds:.0f}s)")
    for f in failures:
        scenario = json.dumps(f.get("shrunk") or f["scenario"], sort_keys=True)
        print(f"FAILED seed {f['seed']}: {f['detail'][:1500]}\n  {scenario}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"transformers": version, "device": args.device, "counts": counts, "failures": failures}, fh,
                      indent=1, default=str)
    return 1 if failures or counts["crashed"] else 0


if __name__ == "__main__":
    sys.exit(main())
