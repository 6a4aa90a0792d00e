"""Issue 37, part 2: assisted decoding with a static cache (transformers 5.24+), each case in its own process, so a
device-side assert or an abort ends only that child. Prints one line per case: the child's exit status (a negative
status is the signal that ended it: -6 is SIGABRT), what the call did, and whether CUDA still worked after it.

    python scripts/assisted_static_524.py                  # every case, on CUDA if there is one
    python scripts/assisted_static_524.py --cases flag_small,pinned_free_after_assert

Cases (the issue's scenario: a Llama target and an unrelated Llama draft from configs, an 8-token prompt, 16 new
tokens, a constant schedule of 3 draft tokens, greedy):
- `stock_static`, `flag_static`: `cache_implementation="static"` (on CUDA, 5.24 verifies the rounds after the first
  through the compiled forward); `stock_static_eager`, `flag_static_eager`: the same with `disable_compile=True`.
  With `--log`, each compiled verify forward prints its width and the first layer's counter before and after (a
  sync each: diagnosis only);
- `stock_small`, `flag_small`: a user `StaticCache` of 16 positions, which the call outgrows (stock: `IndexError`
  on the CPU, a device-side assert on CUDA; the flag: `StaticCacheOverflow` before the forward, CUDA still usable);
- `pinned_free_after_assert`: no transformers. A pinned buffer filled by a non-blocking device-to-host copy, then a
  device-side assert, then the buffer freed: whether freeing pinned memory after the assert aborts the process (the
  candidate mechanism for the flag's SIGABRT: the host allocator records an event on free, which fails).

Issue 43, the overflow matrix (`--matrix`, under a minute on an H200: the children run in parallel, two per case):

    python scripts/assisted_static_524.py --matrix            # every row of MATRIX, on CUDA if there is one
    python scripts/assisted_static_524.py --matrix --rows draft_greedy_mid_call,lookup_sliding_counter

Each row of `MATRIX` is one call (a draft model or prompt lookup, greedy or sampling, a user `StaticCache` or
`cache_implementation="static"`, a first round, a later one, a second turn, a sliding-window cache whose write counter
fell behind; eager or through 5.24's compiled verify forward), run by stock in one process and by the flag in
another. Where stock's call fails (on CUDA: a device-side assert, after which that process's CUDA context is lost),
the flag's must raise `StaticCacheOverflow`, exit cleanly, and then run another generate on the same device in the
same process, the same call with room, whose ids equal stock's same call in that process. Where stock returns, the
flag must return the same ids. A row marked `overflow` fails if stock returns (its overflow does not depend on the
tokens); rows marked `either` overflow or not with the tokens the device picks. Prints a table; exits 1 on a
failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("stock_static", "flag_static", "stock_static_eager", "flag_static_eager", "stock_small", "flag_small",
         "pinned_free_after_assert")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="")
    ap.add_argument("--log", action="store_true", help="print each compiled verify forward's reach (syncs)")
    ap.add_argument("--matrix", action="store_true", help="issue 43's overflow matrix (see the module docstring)")
    ap.add_argument("--rows", default=",".join(MATRIX), help="the matrix rows to run (with --matrix)")
    ap.add_argument("--jobs", type=int, default=0, help="children at once (with --matrix; default: one per core)")
    ap.add_argument("--timeout", type=int, default=0,
                    help="seconds per child (with --matrix; default: 150 on CUDA, 1200 on a CPU)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child.startswith("matrix:"):
        return matrix_child(args.child, args.device or default_device())
    if args.child:
        return child(args.child, args.device or default_device(), args.log)
    if args.matrix:
        return run_matrix(args.rows.split(","), args.device, args.jobs, args.timeout)
    for case in args.cases.split(","):
        start = time.time()
        result = run_case(case, args.device, args.log)
        print(f"{case}: {json.dumps(result)} ({time.time() - start:.0f}s)", flush=True)


def default_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_case(case, device="", log=False, timeout=280):
    """Run one case in a child process: its report (a dict), with `rc` and the tail of its stderr."""
    command = [sys.executable, os.path.abspath(__file__), "--child", case]
    if device:
        command += ["--device", device]
    if log:
        command.append("--log")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_child_env(), cwd=ROOT)
    report = {}
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
        elif log and line.startswith("  "):
            print(line)
    report["rc"] = proc.returncode
    if proc.returncode != 0:
        report["stderr"] = proc.stderr[-1500:]
    return report


def _child_env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), ROOT,
                                                                     os.environ.get("PYTHONPATH")])))


def child(case, device, log):
    import faulthandler

    faulthandler.enable()  # an abort prints the Python stack it happened under
    import torch

    report = {"case": case, "device": device}
    if case == "pinned_free_after_assert":
        return _pinned_free_after_assert(report)

    from transformers import StaticCache, __version__

    from models import build, stock
    import transformers_async_stop as tas

    report["transformers"] = __version__
    target = build("llama", device=device)
    draft = build("llama", seed=3, device=device)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.randint(3, 48, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    kwargs = dict(assistant_model=draft, max_new_tokens=16, do_sample=False, pad_token_id=0)
    if "small" in case:
        kwargs["past_key_values"] = StaticCache(config=target.config, max_cache_len=16)
    else:
        kwargs["cache_implementation"] = "static"
    if case.endswith("_eager"):
        kwargs["disable_compile"] = True
    if log:
        _log_compiled_verify(target)
    try:
        if case.startswith("stock"):
            with stock():
                out = target.generate(ids, **kwargs)
        else:
            out = target.generate(ids, async_stopping_criteria=True, **kwargs)
        report["returned"] = out.tolist()
    except Exception as exc:  # noqa: BLE001 - what the call raised is the report
        report["raised"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        report["is_overflow_error"] = type(exc).__name__ == "StaticCacheOverflow"
    del kwargs
    report["cuda_usable_after"] = _usable(device)
    print("REPORT " + json.dumps(report), flush=True)
    import gc

    gc.collect()  # free what the call left (pinned buffers included) before the process ends
    print("freed", flush=True)


def _usable(device):
    import torch

    if device != "cuda":
        return None
    try:
        torch.cuda.synchronize()
        return float((torch.ones(4, device="cuda") * 2).sum().item()) == 8.0
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}"


def _log_compiled_verify(target):
    import torch

    original = type(target).get_compiled_call

    def get_compiled_call(self, config):
        compiled = original(self, config)

        def logged(**inputs):
            layer = inputs["cache"].layers[0]
            width = inputs["input_ids"].shape[-1]
            before = int(layer.cumulative_length)
            out = compiled(**inputs)
            torch.cuda.synchronize()
            print(f"  compiled verify: width {width}, counter {before} -> {int(layer.cumulative_length)}, "
                  f"max_cache_len {layer.max_cache_len}", flush=True)
            return out

        return logged

    type(target).get_compiled_call = get_compiled_call


def _pinned_free_after_assert(report):
    import torch

    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA"
        print("REPORT " + json.dumps(report), flush=True)
        return
    pinned = torch.empty(64, dtype=torch.long, pin_memory=True)
    pinned.copy_(torch.arange(64, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    try:
        torch.zeros(4, device="cuda").index_copy_(0, torch.tensor([9], device="cuda"), torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        report["raised"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    print("REPORT " + json.dumps(report), flush=True)
    del pinned  # the candidate abort: the host allocator records an event for the copy's stream on free
    print("freed", flush=True)


# --- issue 43: the overflow matrix ----------------------------------------------------------------------------------
# row -> (the call, what stock does with it). "overflow": the sequence outgrows the cache whatever tokens the device
# picks (`min_new_tokens` keeps EOS out); "returns": the cache holds the call whatever the tokens; "either": the
# tokens decide (prompt lookup's candidates, a sliding cache's slides), so the device's stock run says which.
# A call: a Llama target (`tests/models.py`, 2 layers, fp32), or Mistral with a 40-token sliding window on every
# layer; a draft model (an unrelated Llama, 3 tokens a round, constant schedule) on an 8-token prompt, or prompt
# lookup (3 tokens, or 10) on a 16-token prompt with repeated n-grams; 16 new tokens; a user `StaticCache` of `room`
# positions, or `cache_implementation="static"` (`room` None: `max_length - 1` positions); the compiled verify
# forward of 5.24 only where `compiled` (CUDA; elsewhere `disable_compile=True`, so a row takes seconds).
MATRIX = {
    "draft_greedy_first_round": (dict(mode="draft", room=10), "overflow"),  # the prompt and 3 candidates: 11 > 10
    "draft_greedy_mid_call": (dict(mode="draft", room=16), "overflow"),
    "draft_sampling_mid_call": (dict(mode="draft", sample=True, room=16), "overflow"),
    "draft_greedy_second_turn": (dict(mode="draft", room=30, max_new_tokens=6, turns=2), "overflow"),
    "lookup_greedy_user_cache": (dict(mode="lookup", room=18), "overflow"),
    "lookup_sampling_user_cache": (dict(mode="lookup", sample=True, room=18), "overflow"),
    # `cache_implementation="static"` (`max_length - 1` positions): lookup's candidates are not capped by the
    # remaining length (a draft's are). The first round's come from the prompt alone: 16 + 10 > 23
    "lookup_greedy_static_first_round": (dict(mode="lookup", lookup=10, max_new_tokens=8), "overflow"),
    "lookup_greedy_static_last_round": (dict(mode="lookup", lookup=10), "either"),
    "lookup_sampling_static_last_round": (dict(mode="lookup", lookup=10, sample=True), "either"),
    # every layer a sliding window longer than the cache: the layers slide, their crops leave the write counter
    # behind, a later round that fits writes at it (CPU: index -20)
    "lookup_sliding_counter": (dict(mode="lookup", family="mistral", room=18), "either"),
    "lookup_sliding_counter_ten": (dict(mode="lookup", family="mistral", room=20, lookup=10), "either"),
    "lookup_sampling_sliding_counter": (dict(mode="lookup", family="mistral", room=20, lookup=10, sample=True),
                                        "either"),
    "draft_greedy_mid_call_compiled": (dict(mode="draft", room=16, compiled=True), "overflow"),
    "lookup_greedy_static_last_round_compiled": (dict(mode="lookup", lookup=10, compiled=True), "either"),
    # controls: where stock returns, the flag returns the same ids
    "draft_greedy_room": (dict(mode="draft", room=40), "returns"),
    "lookup_greedy_static_fits": (dict(mode="lookup", max_new_tokens=8), "either"),
    "lookup_sliding_slid_returns": (dict(mode="lookup", family="mistral", room=14), "either"),
}


def matrix_call(spec, flag, device):
    """One row's call (`MATRIX`): ("returned", ids as a list) or ("raised", the exception)."""
    import torch
    from transformers import StaticCache

    from models import build

    if spec.get("family") == "mistral":
        target = build("mistral", device=device, sliding_window=40)
    else:
        target = build("llama", device=device)
    new = spec.get("max_new_tokens", 16)
    kwargs = dict(do_sample=spec.get("sample", False), pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
    base = torch.randint(3, 48, (1, 8), generator=torch.Generator().manual_seed(1))
    if spec["mode"] == "draft":
        draft = build("llama", seed=3, device=device)
        draft.generation_config.num_assistant_tokens = 3
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
        ids = base
    else:
        kwargs["prompt_lookup_num_tokens"] = spec.get("lookup", 3)
        ids = torch.cat([base, base[:, :6], base], dim=1)[:, :16]  # repeated n-grams: lookup finds candidates
    ids = ids.to(device)
    if spec.get("room") is None:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["past_key_values"] = StaticCache(config=target.config, max_cache_len=spec["room"])
    if not spec.get("compiled"):
        kwargs["disable_compile"] = True
    if flag:
        kwargs["async_stopping_criteria"] = True
    torch.manual_seed(0)
    try:
        for _ in range(spec.get("turns", 1)):  # a chat: each turn continues the sequence on the same cache
            ids = target.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()  # a device-side assert surfaces here at the latest
        return "returned", ids.tolist()
    except Exception as exc:  # noqa: BLE001 - what the call raised is the report
        return "raised", exc


def then_spec(spec):
    """The same call with room (a user cache of 40 positions, within the sliding window, and 8 new tokens): run
    after the row's call, in its process."""
    return dict(spec, room=40, max_new_tokens=8, turns=1)


def _outcome(result) -> dict:
    kind, value = result
    if kind == "returned":
        return {"outcome": "returned", "returned": value}
    from transformers_async_stop.loops.assisted.room import StaticCacheOverflow

    return {"outcome": "raised", "error_type": type(value).__name__, "error": str(value)[:300],
            "is_overflow_error": isinstance(value, StaticCacheOverflow)}


def matrix_child(name, device):
    """`--child matrix:<row>:<stock|flag>`: the row's call, then (the flag's process) the same call with room, by the
    flag and by stock, in the same process. Prints one REPORT line."""
    import faulthandler
    import gc
    import warnings

    faulthandler.enable()
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    from models import stock
    import transformers_async_stop  # noqa: F401 - applies the patches

    _, row, side = name.split(":")
    spec, _ = MATRIX[row]
    report = {"row": row, "side": side, "device": device, "torch": torch.__version__,
              "transformers": transformers.__version__}
    if side == "stock":
        with stock():
            report.update(_outcome(matrix_call(spec, False, device)))
    else:
        report.update(_outcome(matrix_call(spec, True, device)))
        report["path"] = transformers_async_stop.last_path().describe()
    report["usable"] = _usable(device)
    if side == "flag":
        then = then_spec(spec)
        flag_then = _outcome(matrix_call(then, True, device))
        with stock():
            stock_then = _outcome(matrix_call(then, False, device))
        report["then"] = {"flag": flag_then, "stock": stock_then,
                          "equal": flag_then.get("returned") is not None
                          and flag_then.get("returned") == stock_then.get("returned")}
        report["usable_after_then"] = _usable(device)
    print("REPORT " + json.dumps(report), flush=True)
    gc.collect()  # free what the calls left (pinned buffers included) before the process ends
    print("freed", flush=True)


def _matrix_run(row, side, device, timeout):
    command = [sys.executable, os.path.abspath(__file__), "--child", f"matrix:{row}:{side}"]
    if device:
        command += ["--device", device]
    env = _child_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.time()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "rc": None, "seconds": round(time.time() - start)}
    report = {}
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
    if not report:
        report = {"outcome": "died"}
    report["rc"] = proc.returncode
    report["seconds"] = round(time.time() - start)
    if proc.returncode != 0 or report["outcome"] == "died":
        report["stderr"] = proc.stderr[-1200:]
    return report


def judge(expect, ref, got, device) -> list:
    """What is wrong with a row (an empty list: it passes). `ref`: stock's child's report, `got`: the flag's."""
    problems = []
    if got.get("rc") != 0 or got.get("outcome") in (None, "died", "timeout"):
        problems.append(f"the flag's process did not exit cleanly (rc {got.get('rc')}, {got.get('outcome')})")
        return problems
    if ref.get("outcome") == "timeout":
        problems.append("stock's process timed out")
        return problems
    if ref.get("outcome") == "returned":
        if expect == "overflow":
            problems.append("stock returned: the row no longer outgrows its cache (or stock's kernels wrote out of "
                            "bounds without an assert)")
        if got.get("returned") != ref.get("returned"):
            problems.append("the flag did not return stock's ids")
    else:  # stock raised (CPU: IndexError; CUDA: a device-side assert) or its process died
        if expect == "returns":
            problems.append("stock failed where the cache has room")
        if device == "cpu" and ref.get("error_type") != "IndexError":
            problems.append(f"stock raised {ref.get('error_type')}, not the IndexError of an out-of-bounds write")
        if not got.get("is_overflow_error"):
            problems.append(f"the flag did not raise StaticCacheOverflow ({got.get('outcome')} "
                            f"{got.get('error_type', '')})")
    then = got.get("then") or {}
    if not then.get("equal"):
        problems.append("the next generate in the flag's process did not return stock's ids")
    if device == "cuda" and not (got.get("usable") is True and got.get("usable_after_then") is True):
        problems.append("CUDA was not usable in the flag's process afterwards")
    return problems


def _stock_cell(report) -> str:
    outcome = report.get("outcome")
    if outcome == "returned":
        return "returned"
    if outcome == "raised":
        error = report.get("error", "")
        kind = report.get("error_type")
        if "device-side assert" in error:
            kind += " (device-side assert)"
        usable = report.get("usable")
        return kind + ("" if usable is None else ", CUDA lost" if usable is not True else ", CUDA ok")
    return f"{outcome} (rc {report.get('rc')})"


def _flag_cell(report, ref) -> str:
    outcome = report.get("outcome")
    if outcome == "returned":
        return "returned, = stock" if report.get("returned") == ref.get("returned") else "returned, DIFFERS"
    if outcome == "raised":
        return report.get("error_type")
    return f"{outcome} (rc {report.get('rc')})"


def _then_cell(report, device) -> str:
    then = report.get("then")
    if not then:
        return "-"
    cell = "generate = stock" if then.get("equal") else f"generate: {then['flag'].get('outcome')}, differs"
    if device == "cuda":
        cell += ", CUDA ok" if report.get("usable") is True and report.get("usable_after_then") is True \
            else ", CUDA LOST"
    return cell


def matrix_results(rows, device="", jobs=0, timeout=0):
    """Run the rows (two children each, in parallel): {row: (expect, stock's report, flag's report, problems)}."""
    from concurrent.futures import ThreadPoolExecutor

    device = device or default_device()
    timeout = timeout or (150 if device == "cuda" else 1200)
    unknown = [row for row in rows if row not in MATRIX]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(MATRIX)}")
    # the compiled rows first: they take longest
    tasks = sorted(((row, side) for row in rows for side in ("stock", "flag")),
                   key=lambda task: not MATRIX[task[0]][0].get("compiled"))
    jobs = jobs or max(2, min(len(tasks), os.cpu_count() or 2))
    with ThreadPoolExecutor(jobs) as pool:
        reports = dict(zip(tasks, pool.map(lambda task: _matrix_run(*task, device, timeout), tasks)))
    results = {}
    for row in rows:
        expect = MATRIX[row][1]
        ref, got = reports[(row, "stock")], reports[(row, "flag")]
        results[row] = (expect, ref, got, judge(expect, ref, got, device))
    return results


def run_matrix(rows, device="", jobs=0, timeout=0):
    import torch
    import transformers

    device = device or default_device()
    start = time.time()
    results = matrix_results(rows, device, jobs, timeout)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"issue 43 overflow matrix: {name}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{len(rows)} rows, each by stock and by the flag in their own processes")
    header = ("row", "expect", "stock's process", "flag's process", "then, in the flag's process", "verdict")
    table = [header]
    for row, (expect, ref, got, problems) in results.items():
        table.append((row, expect, _stock_cell(ref), _flag_cell(got, ref), _then_cell(got, device),
                      "ok" if not problems else "FAIL"))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    failed = {row: result for row, result in results.items() if result[3]}
    for row, (_, ref, got, problems) in failed.items():
        print(f"\nFAIL {row}: " + "; ".join(problems))
        for side, report in (("stock", ref), ("flag", got)):
            print(f"  {side}: " + json.dumps({k: v for k, v in report.items() if k != "returned"})[:1500])
    overflowed = sum(1 for _, ref, _, _ in results.values() if ref.get("outcome") in ("raised", "died"))
    raised = sum(1 for _, _, got, _ in results.values() if got.get("is_overflow_error"))
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed ({overflowed} rows where stock failed, "
          f"{raised} where the flag raised StaticCacheOverflow; {time.time() - start:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
