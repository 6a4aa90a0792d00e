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
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.device or default_device(), args.log)
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), ROOT,
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
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


if __name__ == "__main__":
    main()
