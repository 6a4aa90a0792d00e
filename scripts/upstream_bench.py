"""ms/token, GPU busy and blocking syncs per decode step of three variants, one process each:

- `stock`:   unpatched transformers 5.24.0 (RELEASE, the release the series targets);
- `patched`: transformers 5.24.0 with the upstream series (upstream/*.patch), `async_stopping_criteria=True`;
- `plugin`:  unpatched transformers 5.24.0 + `import transformers_async_stop`, `async_stopping_criteria=True`.

Cases (random weights from configs, no download): a Llama-1B-shaped bf16 model with a static cache (auto-compiled on
CUDA) at batch 1 greedy, batch 1 sampling and a left-padded batch of 8; the same model with a DynamicCache at batch 1;
and transformers #43089's own workload (its tiny Llama, its `ExtraSoftmax` processor and a criterion that never
fires), with a DynamicCache and with a static cache. Every call generates exactly its token budget
(`min_new_tokens`), so every variant does the same work and none runs an extra step.

Measured as `python -m transformers_async_stop.bench` does (and with its CUDA helpers, bench/gpu.py, loaded by path so
that the stock and patched processes never import the plug-in): per rep, an N-token and a 1-token call,
(t_N - t_1) / (N - 1) ms/token, median over reps; GPU busy = CUDA kernel time per step (profiler) / ms per token;
syncs per step = (syncs of the N-token call - syncs of the 1-token call) / (N - 1), from torch's sync debug mode.

    # one variant (PYTHONPATH selects the transformers): writes a JSON record
    python scripts/upstream_bench.py --variant stock --json stock.json
    # on the GPU machine: installs the carried wheels (.whl/common, .whl/t524, .whl/upstream) into /tmp folders
    # and runs the three variants one process each, then the table
    python3 scripts/upstream_bench.py --device-run --out "$OUT" [--cases ...] [--reps 7]
    # the table from the JSON records (several calls' records of one variant are merged)
    python scripts/upstream_bench.py --report stock.json patched.json plugin.json
    # CPU smoke test of the whole pipeline (tiny sizes; the deferred paths forced on the CPU)
    python scripts/upstream_bench.py --device-run --smoke --out /tmp/bench-smoke
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("stock", "patched", "plugin")
# The release the series applies to (scripts/upstream_check.sh's VERSION): every variant runs it, from carried wheels
RELEASE = "5.24.0"
RELEASE_WHEELS = ".whl/t524"
# name: (model, cache mode, batch, decode)
CASES = {
    "llama1b-static-b1": ("llama-1b", "static", 1, "greedy"),
    "llama1b-static-b1-sample": ("llama-1b", "static", 1, "sample"),
    "llama1b-static-b8-padded": ("llama-1b", "static", 8, "padded"),
    "llama1b-dynamic-b1": ("llama-1b", "dynamic", 1, "greedy"),
    "issue43089-dynamic": ("tiny-llama", "dynamic", 1, "greedy"),
    "issue43089-static": ("tiny-llama", "static", 1, "greedy"),
}
PROMPT_LEN = 32
SAMPLE_SEED = 1234


def _bench_gpu():
    """transformers_async_stop/bench/gpu.py, loaded by path: it imports only torch and transformers."""
    spec = importlib.util.spec_from_file_location("_tas_bench_gpu", ROOT / "transformers_async_stop" / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the workloads (the same as transformers_async_stop/bench/cases.py; checked in the plugin process) -----------
def _configs(smoke: bool):
    from transformers import LlamaConfig

    tiny = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1)
    if smoke:
        llama_1b = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
    else:
        llama_1b = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256)
    return {"llama-1b": llama_1b, "tiny-llama": tiny}


def _issue_43089_extras(variant: str):
    """#43089's user processor and criterion. The plugin process takes the project's own classes (its ExtraSoftmax
    is declared graph-safe, as the plug-in's README asks of a user); the others get the same two classes here."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    if variant == "plugin":
        from transformers_async_stop.bench.cases import ExtraSoftmax, NeverStop
    else:
        class NeverStop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        class ExtraSoftmax(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores.softmax(-1)

    return {"stopping_criteria": StoppingCriteriaList([NeverStop()]),
            "logits_processor": LogitsProcessorList([ExtraSoftmax()])}


def _check_same_workloads(smoke: bool) -> None:
    from transformers_async_stop.bench import cases

    configs = _configs(smoke)
    assert configs["tiny-llama"].to_dict() == cases.tiny_llama_config().to_dict(), "tiny Llama differs from the bench's"
    if not smoke:
        assert configs["llama-1b"].to_dict() == cases.llama_1b_config().to_dict(), "Llama-1B differs from the bench's"


def _build(config, device, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # built on the device: initialising 1B parameters on the CPU takes longer
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _inputs(batch: int, padded: bool, vocab: int, device):
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab - 1, (batch, PROMPT_LEN), generator=generator)
    mask = torch.ones_like(ids)
    if padded:  # as bench/cases.py: rows 3, 7, ... unpadded, the others 1-3 eighths of the prompt
        step = max(1, PROMPT_LEN // 8)
        for row in range(batch):
            pad = ((row + 1) % 4) * step
            mask[row, :pad] = 0
            ids[row, :pad] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


# --- one variant ------------------------------------------------------------------------------------------------
def _set_up(variant: str, smoke: bool) -> dict:
    """Imports what the variant needs; returns the generate() kwargs that turn its flag on."""
    if variant == "plugin":
        if smoke:
            os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")  # the plug-in's own switch for CPU runs
        import transformers_async_stop  # noqa: F401  (applies the patches)

        _check_same_workloads(smoke)
        return {"async_stopping_criteria": True}
    from transformers.generation.configuration_utils import GenerationConfig

    has_flag = hasattr(GenerationConfig(), "async_stopping_criteria")
    if variant == "stock":
        if has_flag:
            raise SystemExit("stock: this transformers has the series applied (check PYTHONPATH)")
        return {}
    if not has_flag:
        raise SystemExit("patched: this transformers does not have the series (check PYTHONPATH)")
    if smoke:
        # the series' test hook: the CPU counts as CUDA for DeferredStopCheck, so the deferred path runs
        import torch
        from transformers.generation.utils import DeferredStopCheck

        is_supported = DeferredStopCheck.is_supported
        DeferredStopCheck.is_supported = staticmethod(
            lambda device, *a, **k: is_supported(torch.device("cuda") if device.type == "cpu" else device, *a, **k))
    return {"async_stopping_criteria": True}


def _per_step(value_n, value_1, n):
    return None if value_n is None or value_1 is None else (value_n - value_1) / (n - 1)


def measure_variant(variant: str, case_names: list[str], reps: int, new_tokens: int, smoke: bool) -> dict:
    flag = _set_up(variant, smoke)
    import torch
    import transformers

    gpu = _bench_gpu()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    notes: list[str] = []
    gpu.raise_compile_limits(notes)
    if not smoke and transformers.__version__ != RELEASE:
        # the series is measured against the release it targets: another one would not be the same stock
        raise SystemExit(f"{variant}: transformers {transformers.__version__}, not {RELEASE} (check the wheels)")
    configs = _configs(smoke)
    record = {"variant": variant, "transformers": transformers.__version__, "transformers_file": transformers.__file__,
              "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "reps": reps, "new_tokens": new_tokens, "notes": notes, "cases": {}}
    models = {}
    for name in case_names:
        model_name, mode, batch, decode = CASES[name]
        dtype = torch.bfloat16 if cuda and model_name == "llama-1b" else torch.float32
        if model_name not in models:
            models.clear()
            gpu.free(device)
            models[model_name] = _build(configs[model_name], device, dtype)
        model = models[model_name]
        inputs = _inputs(batch, decode == "padded", model.config.vocab_size, device)
        kwargs = dict(inputs, do_sample=decode == "sample", pad_token_id=0)
        if mode == "static":
            kwargs["cache_implementation"] = "static"
        if model_name == "tiny-llama":
            kwargs.update(_issue_43089_extras(variant))
        kw_n = dict(kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        kw_1 = dict(kwargs, max_new_tokens=1, min_new_tokens=1)
        started = time.perf_counter()
        sequences = None
        for _ in range(2):  # warm-up, compilation in static mode
            sequences = gpu.call(model, kw_n, flag)
            gpu.call(model, kw_1, flag)
        per_rep = []
        for _ in range(reps):
            times = []
            for kw in (kw_n, kw_1):
                gpu.sync(device)
                torch.manual_seed(SAMPLE_SEED)
                start = time.perf_counter()
                model.generate(**kw, **flag)
                gpu.sync(device)
                times.append((time.perf_counter() - start) * 1e3)
            per_rep.append(_per_step(times[0], times[1], new_tokens))
        ms = statistics.median(per_rep)
        entry = {"ms_per_token": ms, "ms_per_token_reps": per_rep, "syncs_per_step": None, "gpu_busy": None,
                 "floor_ms_per_token": None, "sequences": sequences.cpu().tolist()}
        if cuda:
            syncs_n, _ = gpu.count_syncs(model, kw_n, flag, device)
            syncs_1, _ = gpu.count_syncs(model, kw_1, flag, device)
            entry["syncs_per_step"] = _per_step(syncs_n, syncs_1, new_tokens)
            busy_n = gpu.gpu_timeline(model, kw_n, flag, device)["busy"]
            busy_1 = gpu.gpu_timeline(model, kw_1, flag, device)["busy"]
            floor = _per_step(busy_n, busy_1, new_tokens)
            entry["floor_ms_per_token"] = floor
            entry["gpu_busy"] = floor / ms if floor is not None and ms > 0 else None
        entry["seconds"] = time.perf_counter() - started
        record["cases"][name] = entry
        print(f"{variant:8s} {name:26s} {ms:8.3f} ms/token  syncs/step {entry['syncs_per_step']}  "
              f"busy {entry['gpu_busy']}  ({entry['seconds']:.0f} s)", flush=True)
    if variant != "plugin" and any(m.startswith("transformers_async_stop") for m in sys.modules):
        raise SystemExit(f"{variant}: the plug-in got imported")
    return record


# --- the table ----------------------------------------------------------------------------------------------------
def report(files: list[str]) -> str:
    records = {}
    for path in files:
        with open(path) as handle:
            record = json.load(handle)
        if record["variant"] in records:  # the same variant from another call (cases split across calls)
            records[record["variant"]]["cases"].update(record["cases"])
        else:
            records[record["variant"]] = record
    first = next(iter(records.values()))
    lines = [f"{first['device']}, torch {first['torch']}, {first['new_tokens']} new tokens, median of "
             f"{first['reps']} reps; ms/token (GPU busy, syncs per step); speed-up over stock; exact = the same "
             "sequences as stock", "",
             "| case | " + " | ".join(v for v in VARIANTS if v in records) + " | patched's share of the plug-in's gain |",
             "|---|" + "---|" * (sum(v in records for v in VARIANTS) + 1)]
    names = [n for n in CASES if any(n in r["cases"] for r in records.values())]
    for name in names:
        stock = records.get("stock", {}).get("cases", {}).get(name)
        cells = []
        for v in VARIANTS:
            if v not in records:
                continue
            entry = records[v]["cases"].get(name)
            if entry is None:
                cells.append("—")
                continue
            parts = [f"{entry['ms_per_token']:.3f}"]
            details = []
            if entry.get("gpu_busy") is not None:
                details.append(f"{100 * entry['gpu_busy']:.0f}%")
            if entry.get("syncs_per_step") is not None:
                details.append(f"{entry['syncs_per_step']:.2f} syncs")
            if stock is not None and v != "stock":
                details.append(f"{stock['ms_per_token'] / entry['ms_per_token']:.2f}x")
                details.append("exact" if entry["sequences"] == stock["sequences"] else "NOT exact")
            cells.append(parts[0] + (f" ({', '.join(details)})" if details else ""))
        share = "—"
        plugin = records.get("plugin", {}).get("cases", {}).get(name)
        patched = records.get("patched", {}).get("cases", {}).get(name)
        if stock and plugin and patched and stock["ms_per_token"] > plugin["ms_per_token"]:
            gain = stock["ms_per_token"] - plugin["ms_per_token"]
            share = f"{100 * (stock['ms_per_token'] - patched['ms_per_token']) / gain:.0f}%"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {share} |")
    lines.append("")
    lines += [f"- {v}: transformers {r['transformers']} from {r['transformers_file']}" for v, r in records.items()]
    return "\n".join(lines)


# --- the device run: every variant in a process of its own -------------------------------------------------------
def _site(name: str, wheel_dirs: list[str]) -> str:
    """The carried wheels of one variant, installed once into /tmp/upstream_bench_<name>."""
    target = f"/tmp/upstream_bench_{name}"
    if not os.path.isdir(target):
        wheels = [w for d in wheel_dirs for w in sorted(glob.glob(str(ROOT / d / "*.whl")))]
        if not wheels:
            raise SystemExit(f"no wheels in {wheel_dirs} (see docs/upstream-pr.md, 'Benchmark')")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", target, *wheels], check=True)
    return target


def device_run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        # here: the venv's own transformers for stock and plugin, the series' source tree for patched
        sites = {"stock": "", "plugin": "", "patched": args.patched_src or ""}
    else:
        stock_site = _site("stock", [".whl/common", RELEASE_WHEELS])
        sites = {"stock": stock_site, "plugin": stock_site,
                 "patched": _site("upstream", [".whl/common", ".whl/upstream"])}
    files, failed = [], []
    for variant in args.variants.split(","):
        path = out / f"{variant}.json"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (sites[variant], str(ROOT)) if p)
        command = [sys.executable, __file__, "--variant", variant, "--json", str(path), "--cases", args.cases,
                   "--reps", str(args.reps), "--new-tokens", str(args.new_tokens)] + (["--smoke"] if args.smoke else [])
        with open(out / f"{variant}.log", "w") as log:
            code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if code == 0:
            files.append(str(path))
            print("\n".join(line for line in (out / f"{variant}.log").read_text().splitlines()
                            if line.startswith(variant)), flush=True)
        else:
            failed.append(variant)
            print(f"{variant}: FAILED (exit {code}); the end of {variant}.log:", flush=True)
            print("\n".join((out / f"{variant}.log").read_text().splitlines()[-15:]), flush=True)
    if files:
        table = report(files)
        (out / "table.md").write_text(table + "\n")
        print(table)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--device-run", action="store_true")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--report", nargs="+")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): checks that the script works")
    parser.add_argument("--patched-src", help="--smoke --device-run: the patched sources for the patched variant")
    parser.add_argument("--json")
    parser.add_argument("--out")
    args = parser.parse_args()
    args.reps = args.reps or (2 if args.smoke else 7)
    args.new_tokens = args.new_tokens or (8 if args.smoke else 128)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.report:
        print(report(args.report))
        return 0
    if args.device_run:
        return device_run(args)
    if not args.variant or not args.json:
        parser.error("--variant and --json, or --device-run --out, or --report")
    record = measure_variant(args.variant, args.cases.split(","), args.reps, args.new_tokens, args.smoke)
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
