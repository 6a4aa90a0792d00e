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
end with how many flag runs took the graphed forward in at least one call (`graphed`), and for issue 32 how many
scenarios draw assisted decoding or prompt lookup (`assisted`) and in how many flag runs its verify forward replayed
from the graphs in some call (`graphed_verify`) and in the last call (`graphed_verify_last`), and for issue 38 in how
many a greedy round's acceptance replayed from its graph (`graphed_acceptance`), and how many scenarios run a found
family's model (`found_family`, 5.17+), a multi-head latent attention family's (`latent_family`, 5.17+) and an
encoder-decoder's (`encoder_decoder`, 5.17+: BART and its copies, T5, Whisper; tests/usage_encoder_decoder.py).
`--require assisted` runs only seeds drawing that key (--draws of them, from --seed on):

    python scripts/usage_fuzz.py --require assisted --draws 300 --workers 2
    python scripts/usage_fuzz.py --require found_family --draws 1000
    python scripts/usage_fuzz.py --require latent_family --draws 300
    python scripts/usage_fuzz.py --require encoder_decoder --draws 300 --workers 2

`--workers N` (and any run on CUDA) runs the seeds in worker processes that report each seed as it ends. A worker
that dies (a CUDA device-side assert ends the process's CUDA context, and every later scenario in it would fail) has
the seed it was running counted as crashed, with its seed, and the seeds after it re-run in a fresh worker: the
totals account for every seed (`accounted`). A test-only knob simulates such deaths on the CPU:
TAS_USAGE_FUZZ_FAKE="3:exit,5:assert,*:pass" (seed 3 ends its process with os._exit, seed 5 reports a device-side
assert, every other seed passes without running).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
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
    ap.add_argument("--require", default="", help="only seeds whose scenario draws this key (e.g. `assisted`): "
                                                  "--draws of them, from --seed on")
    ap.add_argument("--progress", default="", help=argparse.SUPPRESS)  # a worker's per-seed report (JSON lines)
    args = ap.parse_args()
    if not args.scenario and not args.progress and (args.workers > 1 or args.device != "cpu"):
        return _fan_out(args)
    if args.device == "cpu":
        os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
    warnings.filterwarnings("ignore")
    fake = _fake()
    if "*" in fake:  # (test-only: every seed is faked, nothing is run or imported)
        import types

        usage_runner = types.SimpleNamespace(LAST_FORWARD=[], LAST_VERIFY=[], LAST_ACCEPTANCE=[])
        usage_dimensions = types.SimpleNamespace(reached=lambda sc: set())
        check = dumps = shrink = None
        version = "fake"

        def draw(seed, device):
            return {"seed": seed}
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        version = transformers.__version__
        import usage_dimensions
        import usage_runner
        from usage_runner import check
        from usage_scenarios import draw, dumps, shrink

    if args.scenario:
        scenarios = [(None, json.loads(args.scenario))]
    else:
        scenarios = [(s, draw(s, args.drawn_for or args.device)) for s in _seeds(args)]
    if args.graphed:
        for _, sc in scenarios:
            for s in (sc, sc.get("threads", {}).get("other")):
                if s is not None:
                    s["graphed"] = args.graphed
            if "encoder_decoder" in sc:  # (its own sub-scenario's)
                sc["encoder_decoder"]["graphed"] = args.graphed

    def outcome(sc):
        try:
            return check(sc, args.device)
        except Exception as exc:  # noqa: BLE001
            return "crashed", f"{type(exc).__name__} outside generate(): {exc}"

    counts, failures, start, cpu0 = collections.Counter(), [], time.time(), time.process_time()
    skips = collections.Counter()
    progress = open(args.progress, "a", buffering=1) if args.progress else None

    def report(**record):  # one line per event, written at once: the parent reads it after this process died
        if progress is not None:
            progress.write(json.dumps(record, default=str) + "\n")
            progress.flush()

    report(transformers=version)
    print(f"transformers {version}, device {args.device}", flush=True)
    for seed, sc in scenarios:
        report(start=seed)
        mode = fake.get(seed, fake.get("*")) if seed is not None else None
        if mode == "exit":
            os._exit(3)  # (test-only: a worker dying inside a scenario)
        usage_runner.LAST_FORWARD.clear()
        usage_runner.LAST_VERIFY.clear()
        usage_runner.LAST_ACCEPTANCE.clear()
        status, detail = (("crashed", "RuntimeError outside generate(): CUDA error: device-side assert triggered "
                           "(simulated by TAS_USAGE_FUZZ_FAKE)") if mode == "assert"
                          else ("pass", "") if mode == "pass" else outcome(sc))
        counts["drawn"] += 1
        graphed = any((path or "").startswith("graphed") for path in usage_runner.LAST_FORWARD)
        counts["graphed"] += graphed
        # issue 32: assisted scenarios, and the flag runs whose verify forward replayed in some call / the last call
        verify = [(path or "").startswith("graphed") for path in usage_runner.LAST_VERIFY]
        graphed_verify = (any(verify), bool(verify) and verify[-1])
        counts["assisted"] += "assisted" in sc
        counts["found_family"] += "found_family" in sc  # (a found family's model: usage_dimensions._found_family)
        counts["latent_family"] += "latent_family" in sc  # (a latent-attention family's: _latent_family)
        counts["encoder_decoder"] += "encoder_decoder" in sc  # (an encoder-decoder's: _encoder_decoder)
        counts["graphed_verify"] += graphed_verify[0]
        counts["graphed_verify_last"] += graphed_verify[1]
        # issue 38: the flag runs where a greedy round's acceptance replayed from its graph in some call
        graphed_acceptance = any((path or "").startswith("graphed") for path in usage_runner.LAST_ACCEPTANCE)
        counts["graphed_acceptance"] += graphed_acceptance
        if counts["drawn"] % 25 == 0:
            print(f"  {counts['drawn']} drawn, {time.time() - start:.0f}s: {dict(counts)}", flush=True)
        counts[{"pass": "passed", "fail": "failed", "stock_err": "skipped_stock_errs"}.get(status, status)] += 1
        if status == "stock_err":  # what stock raised (a high count of one reason: a dimension drawn in vain)
            skips[_skip_reason(detail)] += 1
        if status in ("fail", "crashed") and ("device-side assert" in detail or "CUDA error" in detail):
            # the process's CUDA context is gone: every later scenario would fail the same way
            print(f"FAIL seed {seed} (CUDA unusable after it, stopping): {detail[:400]}", flush=True)
            failures.append({"seed": seed, "detail": detail, "scenario": sc})
            counts["crashed"] += 1
            report(seed=seed, status="crashed", graphed=graphed, graphed_verify=graphed_verify,
                   assisted="assisted" in sc, failure=failures[-1])
            break  # (no `done` line: the parent re-runs the seeds after this one in a fresh worker)
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
        report(seed=seed, status=status, graphed=graphed, graphed_verify=graphed_verify, assisted="assisted" in sc,
               graphed_acceptance=graphed_acceptance, found_family="found_family" in sc,
               latent_family="latent_family" in sc, encoder_decoder="encoder_decoder" in sc,
               failure=failures[-1] if status in ("fail", "crashed") else None,
               skip=detail if status == "stock_err" else None)
        if status in ("fail", "crashed") and len(failures) >= args.max_failures:
            print("stopping: --max-failures reached")
            report(done=True, stopped="max_failures")
            break
    else:
        report(done=True)
    elapsed = time.time() - start
    print(f"transformers {version} device {args.device}: " +
          " ".join(f"{k}={counts[k]}" for k in ("drawn", "passed", "failed", "skipped_stock_errs", "crashed", "graphed",
                                                "assisted", "graphed_verify", "graphed_verify_last",
                                                "graphed_acceptance", "found_family", "latent_family",
                                                "encoder_decoder")) +
          f" in {elapsed:.0f}s ({time.process_time() - cpu0:.0f}s of CPU)")
    for reason, n in skips.most_common(8):
        print(f"  skipped {n}: stock raised {reason}")
    by_value = collections.Counter(v for f in failures for v in usage_dimensions.reached(f["scenario"]))
    if by_value:  # issue 25's dimension values among the failing scenarios (not proof of cause: shrink for that)
        print("  failing scenarios per dimension value: " +
              ", ".join(f"{v} {n}" for v, n in sorted(by_value.items(), key=lambda kv: -kv[1])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": version, "device": args.device, "counts": counts,
                       "seconds": elapsed, "failures": failures, "skips": skips}, f, indent=1, default=str)
    return 1 if failures else 0


def _seeds(args):
    """The seeds to run: --only's, or --draws from --seed on (with --require, --draws of those drawing that key)."""
    only = [int(s) for s in args.only.split(",") if s.strip()]
    if only or not args.require:
        return only or range(args.seed, args.seed + args.draws)
    from usage_scenarios import draw

    out, seed = [], args.seed
    while len(out) < args.draws:
        if args.require in draw(seed, args.drawn_for or args.device):
            out.append(seed)
        seed += 1
    return out


def _skip_reason(detail: str) -> str:
    parts = detail.split(": ", 2)  # "turn T: Type: message"
    return ": ".join(parts[1:])[:70] if len(parts) == 3 else detail[:70]


def _fake() -> dict:
    """The test-only TAS_USAGE_FUZZ_FAKE knob: {seed or "*": "exit" | "assert" | "pass"}."""
    out = {}
    for item in os.environ.get("TAS_USAGE_FUZZ_FAKE", "").split(","):
        if ":" in item:
            seed, mode = item.split(":", 1)
            out[seed.strip() if seed.strip() == "*" else int(seed)] = mode.strip()
    return out


def _read_progress(path) -> tuple[dict, int | None, bool, str | None]:
    """A worker's report: ({seed: record} of the seeds it finished, the seed it started and never finished, whether
    it reached its end (`done`), the transformers version)."""
    finished, started, done, version = {}, None, False, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # (a line cut short by the process's death)
                    continue
                if "transformers" in rec:
                    version = rec["transformers"]
                elif "start" in rec:
                    started = rec["start"]
                elif "seed" in rec:
                    finished[rec["seed"]] = rec
                    started = None
                elif rec.get("done"):
                    done = rec.get("stopped") or True
    return finished, started, done, version


def _fan_out(args) -> int:
    """Run the seeds in `args.workers` processes of this script (interleaved slices), each reporting every seed as it
    ends; a worker that dies (or stops at a device-side assert) has the seed it was on counted as crashed and the rest
    of its slice re-run in a fresh worker. The totals account for every seed."""
    import subprocess
    import tempfile

    seeds = list(_seeds(args))
    tmp = tempfile.mkdtemp(prefix="usage_fuzz_")
    pending = [seeds[w::args.workers] for w in range(args.workers) if seeds[w::args.workers]]
    running, records, spawned, stopped, version, start = [], {}, 0, False, "?", time.time()

    def spawn(part):
        nonlocal spawned
        out = os.path.join(tmp, f"w{spawned}.jsonl")
        spawned += 1
        cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(map(str, part)), "--device",
               args.device, "--shrink", str(args.shrink), "--max-failures", str(args.max_failures), "--progress", out]
        cmd += ["--graphed", args.graphed] if args.graphed else []
        cmd += ["--drawn-for", args.drawn_for] if args.drawn_for else []
        running.append((subprocess.Popen(cmd), part, out))

    def interrupted(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupted)  # (`timeout` around this script: the totals so far still print)
    try:
        while pending or running:
            while pending and len(running) < args.workers and not stopped:
                spawn(pending.pop(0))
            if stopped:
                pending.clear()
            done_now = [r for r in running if r[0].poll() is not None]
            if not done_now:
                time.sleep(0.2)
                continue
            for item in done_now:
                running.remove(item)
                proc, part, out = item
                finished, killer, done, got = _read_progress(out)
                version = got or version
                records.update(finished)
                if killer is not None:
                    records[killer] = {"seed": killer, "status": "crashed", "graphed": False, "failure": {
                        "seed": killer, "scenario": None,
                        "detail": f"the worker died (exit code {proc.returncode}) running this seed"}}
                    print(f"FAIL seed {killer}: its worker died (exit code {proc.returncode}); the seeds after it "
                          f"run in a fresh worker", flush=True)
                rest = [s for s in part if s not in records]
                if done == "max_failures":
                    stopped = True
                elif rest and not done:
                    if not finished and killer is None:  # died before its first seed: the seeds cannot be run
                        for s in rest:
                            records[s] = {"seed": s, "status": "crashed", "graphed": False, "failure": {
                                "seed": s, "scenario": None, "detail": f"no worker could start (exit code "
                                                                      f"{proc.returncode})"}}
                    else:
                        pending.append(rest)
    except KeyboardInterrupt:
        for proc, _, _ in running:
            proc.kill()
        for proc, part, out in running:
            proc.wait()
            records.update(_read_progress(out)[0])
        print("interrupted: the totals below count the seeds that ended")
    finally:
        signal.signal(signal.SIGTERM, old)
    counts, skips = collections.Counter(), collections.Counter()
    for rec in records.values():
        counts["drawn"] += 1
        counts["graphed"] += bool(rec.get("graphed"))
        counts["assisted"] += bool(rec.get("assisted"))
        counts["graphed_verify"] += bool((rec.get("graphed_verify") or (False, False))[0])
        counts["graphed_verify_last"] += bool((rec.get("graphed_verify") or (False, False))[1])
        counts["graphed_acceptance"] += bool(rec.get("graphed_acceptance"))
        counts["found_family"] += bool(rec.get("found_family"))
        counts["latent_family"] += bool(rec.get("latent_family"))
        counts["encoder_decoder"] += bool(rec.get("encoder_decoder"))
        counts[{"pass": "passed", "fail": "failed", "stock_err": "skipped_stock_errs"}.get(rec["status"],
                                                                                        rec["status"])] += 1
        if rec.get("skip"):
            skips[_skip_reason(rec["skip"])] += 1
    counts["not_run"] = len(set(seeds) - set(records))  # (--max-failures reached, or interrupted)
    failures = [records[s]["failure"] for s in seeds if s in records and records[s].get("failure")]
    print(f"TOTAL transformers {version} device {args.device} workers {args.workers}: " +
          " ".join(f"{k}={counts[k]}" for k in ("drawn", "passed", "failed", "skipped_stock_errs", "crashed", "graphed",
                                                "assisted", "graphed_verify", "graphed_verify_last",
                                                "graphed_acceptance", "found_family", "latent_family",
                                                "encoder_decoder", "not_run")) +
          f" accounted={counts['drawn'] + counts['not_run']}/{len(seeds)} respawned={spawned - len(seeds[:args.workers])}"
          f" in {time.time() - start:.0f}s")
    for reason, n in skips.most_common(8):
        print(f"  skipped {n}: stock raised {reason}")
    for f in failures:
        scenario = json.dumps(f.get("shrunk") or f["scenario"], sort_keys=True)
        print(f"FAILED seed {f['seed']}: {f['detail'][:1500]}\n  {scenario}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"transformers": version, "device": args.device, "counts": counts, "failures": failures,
                       "skips": skips, "seeds": {s: records[s]["status"] for s in seeds if s in records}}, fh,
                      indent=1, default=str)
    return 1 if failures or counts["crashed"] or counts["not_run"] else 0


if __name__ == "__main__":
    sys.exit(main())
