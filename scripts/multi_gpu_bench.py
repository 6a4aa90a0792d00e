"""Stock transformers against `async_stopping_criteria=True` on two GPUs, in one call (issue 33, part 5).

    NCCL_NVLS_ENABLE=0 python scripts/multi_gpu_bench.py [--quick] [--json PATH]      # two CUDA devices
    python scripts/multi_gpu_bench.py --device cpu --tiny                            # the same code, on CPU

A Llama-8B-shaped bf16 model with random weights (built from a config, no download) in two set-ups:
- `dm-*`: split over cuda:0 and cuda:1 by accelerate's `dispatch_model`, a balanced map (embeddings and the first
  half of the layers on cuda:0, the rest, the norm and the head on cuda:1; `hf_device_map` set as
  `from_pretrained(device_map=...)` sets it), one process;
- `tp-*`: tensor parallelism, `tp_plan="auto"` under torch.distributed.run, 2 ranks over NCCL (NVLink multicast
  off), loading a checkpoint this script writes first (scripts/multi_gpu_tp_worker.py).
Each with a DynamicCache and a static cache (transformers compiles its forward on CUDA), greedy, batch 1 and a
left-padded batch 8. Per configuration, stock and flag alternate in one process (scripts/multi_gpu_measure.py):
ms/token (median over reps), blocking syncs per decode step, each GPU's busy fraction, the path the flag took
(`last_path().describe()`), and whether the flag's token ids equal stock's. A Markdown table goes to stdout, the
full record to --json.

On CPU (`--device cpu --tiny`) the same code runs with a tiny Llama: the "two devices" of the split are both the
CPU (accelerate's hooks forced), the tensor-parallel ranks talk over gloo, and the flag's deferred path is forced
(TRANSFORMERS_ASYNC_STOP_FORCE=1). Its timings say nothing; it checks that the script works (tests/
test_multi_gpu_bench.py).

Configurations start only while the time budget (--budget-s) lasts; those left are reported as skipped. Order:
tensor parallelism first (its ranks load the checkpoint while nothing else runs), then the split's DynamicCache
runs, then its static-cache runs (the compilations).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import multi_gpu_measure as mm  # noqa: E402
from multi_gpu_report import header, markdown, merge_ranks, summary  # noqa: E402

from transformers_async_stop import FORCE_ENV, apply  # noqa: E402
from transformers_async_stop.bench import gpu  # noqa: E402

REPS, QUICK_REPS = 5, 3
NEW_TOKENS, QUICK_NEW_TOKENS, TINY_NEW_TOKENS = 64, 32, 8
QUICK_LAYERS = 8
# configurations start within this many seconds of the script's start. A device call ends at 10 minutes, and a
# static-cache configuration started late compiles twice (stock and flag) before it is timed: the JSON and Markdown
# are rewritten after every configuration, so that a call cut off keeps what it finished
BUDGET_S = 400


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", help=f"comma list of {', '.join(mm.CONFIGS)}, or 'all' (default: "
                                     f"{','.join(mm.DEFAULT_CONFIGS)})")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda with two devices, else an error")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B shape (CPU tests)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} layers of the 8B shape, "
                                                        f"{QUICK_NEW_TOKENS} tokens, {QUICK_REPS} reps")
    p.add_argument("--layers", type=int, help="decoder layers (default: 32; quick: 8; tiny: 2)")
    p.add_argument("--new-tokens", type=int, help=f"tokens per call, >= 2 (default {NEW_TOKENS}, quick "
                                                  f"{QUICK_NEW_TOKENS}, tiny {TINY_NEW_TOKENS})")
    p.add_argument("--reps", type=int, help=f"timed reps per variant (default {REPS}, quick/tiny {QUICK_REPS})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="no configuration starts after this many "
                                                                    f"seconds (default {BUDGET_S})")
    p.add_argument("--tp-checkpoint", metavar="DIR", help="where the tensor-parallel ranks' checkpoint is written "
                                                          "(reused when it is there; default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="write every record as JSON (rewritten after each configuration)")
    p.add_argument("--markdown", metavar="PATH", help="write the table there too (rewritten after each one)")
    args = p.parse_args(argv)
    names = mm.CONFIGS if args.configs == "all" else mm.DEFAULT_CONFIGS if not args.configs else tuple(
        n.strip() for n in args.configs.split(",") if n.strip())
    unknown = [n for n in names if n not in mm.CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {', '.join(mm.CONFIGS)}")
    # the order they run in: tensor parallelism, then the split's dynamic, then its static runs
    args.config_list = sorted(dict.fromkeys(names), key=lambda n: (n.startswith("dm"), "static" in n, n))
    args.reps = args.reps or (QUICK_REPS if args.quick or args.tiny else REPS)
    args.new_tokens = args.new_tokens or (TINY_NEW_TOKENS if args.tiny else QUICK_NEW_TOKENS if args.quick
                                          else NEW_TOKENS)
    args.layers = args.layers or (None if args.tiny else QUICK_LAYERS if args.quick else None)
    if args.new_tokens < 2 or args.reps < 1:
        p.error("--new-tokens must be >= 2 (decode time is differenced against a 1-token call), --reps >= 1")
    return args


def devices_of(args) -> list[torch.device]:
    if args.device == "cpu":
        return [torch.device("cpu")] * 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices (or --device cpu --tiny to check the script)")
    return [torch.device("cuda", 0), torch.device("cuda", 1)]


def build(config, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # built on the device: initialising 8B parameters on the CPU first takes longer than a configuration
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def balanced_map(model, devices: list[torch.device]) -> dict:
    """Embeddings and the first half of the layers on the first device; the rest, the norm and the head on the
    second. GPUs by index (as `from_pretrained(device_map="auto")` writes them), the CPU as "cpu"."""
    first, second = (d.index if d.type == "cuda" else "cpu" for d in devices)
    layers = len(model.model.layers)
    device_map = {}
    for name, _ in model.model.named_children():
        if name == "layers":
            device_map.update({f"model.layers.{i}": first if i < layers // 2 else second for i in range(layers)})
        else:
            device_map[f"model.{name}"] = second if name == "norm" else first
    device_map["lm_head"] = second
    return device_map


def split(model, devices: list[torch.device]):
    from accelerate import dispatch_model

    device_map = balanced_map(model, devices)
    # on CPU both halves are the CPU: force accelerate's hooks, so that the forward runs through them as on GPUs
    model = dispatch_model(model, device_map=device_map, force_hooks=devices[0].type == "cpu")
    model.hf_device_map = device_map  # what `from_pretrained(device_map=...)` sets; static caches place layers by it
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(args, names: list[str], checkpoint: str, dtype: str, deadline: float, cpu: bool) -> list[dict]:
    """The tensor-parallel configurations in 2 ranks; one record per configuration (both ranks merged)."""
    results = tempfile.mkdtemp(prefix="tp_results_")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    if cpu:
        env.update({"CUDA_VISIBLE_DEVICES": "", FORCE_ENV: "1", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), os.path.join(HERE, "multi_gpu_tp_worker.py"), checkpoint, results,
           "--configs", ",".join(names), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
           "--dtype", dtype, "--deadline", str(deadline)]
    # the ranks start no configuration past the deadline; one that runs may finish, within a minute's grace
    limit = max(60.0, deadline - time.time() + 120)
    error = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        if proc.returncode != 0:
            error = f"ranks exited {proc.returncode}: {_first_error(proc.stderr)}"
            print(proc.stderr[-6000:], file=sys.stderr)
    except subprocess.TimeoutExpired as exc:
        error = f"ranks cut off after {limit:.0f} s"
        print(exc.stderr[-6000:] if isinstance(exc.stderr, str) else exc.stderr, file=sys.stderr)
    reports = []
    for rank in range(2):
        path = os.path.join(results, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as fh:
                reports.append(json.load(fh))
    shutil.rmtree(results, ignore_errors=True)
    if error:
        print(f"tensor parallel: {error}", file=sys.stderr)
    return merge_ranks(names, reports, error)


def write_outputs(args, head: dict, records: list[dict]) -> str:
    table = markdown(head, records)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": head, "records": records}, fh, indent=1)
    return table


def _first_error(stderr: str) -> str:
    """The ranks' exception line (`OSError: ...`), not the launcher's ChildFailedError that follows it."""
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line)  # the launcher's prefix of a rank's lines
        if re.match(r"[\w.]*(Error|Exception)\b.*:", line) and "ChildFailedError" not in line:
            return line.strip()[:300]
    return stderr.strip().splitlines()[-1][:300] if stderr.strip() else "no output"


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = devices_of(args)
    # on CPU the flag's deferred path is forced (for the ranks too), as the bench forces it; given back afterwards
    forced = devices[0].type == "cpu" and FORCE_ENV not in os.environ
    if forced:
        os.environ[FORCE_ENV] = "1"
    try:
        return _main(args, devices)
    finally:
        if forced:
            os.environ.pop(FORCE_ENV, None)


def _main(args, devices: list[torch.device]) -> int:
    started = time.time()
    deadline = started + args.budget_s
    cpu = devices[0].type == "cpu"
    apply()
    notes = []
    gpu.raise_compile_limits(notes)  # stock and flag compile the static forward for two batch sizes each
    dtype = "fp32" if cpu else "bf16"
    config = mm.llama_config(args.tiny, args.layers)
    tp_names = [n for n in args.config_list if n.startswith("tp")]
    dm_names = [n for n in args.config_list if n.startswith("dm")]

    def progress(text):
        print(f"[{time.time() - started:5.0f}s] {text}", file=sys.stderr, flush=True)

    progress(f"building the model ({config.num_hidden_layers} layers, hidden {config.hidden_size}) on {devices[0]}")
    from transformers_async_stop.bench.cases import DTYPES

    model = build(config, devices[0], DTYPES[dtype])
    records = []
    tmp = None
    if tp_names:
        checkpoint = args.tp_checkpoint
        if checkpoint is None:
            tmp = tempfile.mkdtemp(prefix="multi_gpu_ckpt_")
            checkpoint = tmp
        if not os.path.exists(os.path.join(checkpoint, "config.json")):
            progress(f"writing the tensor-parallel checkpoint to {checkpoint}")
            model.save_pretrained(checkpoint)
    if dm_names:
        model = split(model, devices)
        if not cpu:
            torch.cuda.empty_cache()  # the moved half's old copy on cuda:0: the tensor-parallel rank there needs it
    else:
        del model
        gpu.free(devices[0])
    def done(found: list[dict]) -> None:
        records.extend(found)
        for record in found:
            progress(f"{record['config']}: {summary(record)}")
        write_outputs(args, header(args, config, devices, notes, time.time() - started), records)

    try:
        if tp_names:
            progress(f"tensor parallel, 2 ranks: {', '.join(tp_names)}")
            done(run_tp(args, tp_names, checkpoint, dtype, deadline, cpu))
        for name in dm_names:
            if time.time() > deadline:
                done([mm.error_record(name, "skipped: past the time budget")])
                continue
            progress(f"device_map split: {name}")
            try:
                done([mm.measure(model, name, args.new_tokens, dtype, devices[0], sorted(set(devices), key=str),
                                 args.reps)])
            except Exception as exc:  # noqa: BLE001  (the other configurations still run)
                traceback.print_exc()
                done([mm.error_record(name, f"{type(exc).__name__}: {exc}")])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    progress("done")
    print(write_outputs(args, header(args, config, devices, notes, time.time() - started), records))
    # an error, or token ids that differ from stock's, fails the run; a configuration skipped for time does not
    failed = [r["config"] for r in records if (r["error"] and not r["error"].startswith("skipped"))
              or r.get("equal") is False]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
