"""The package's own host time per decode step in the per-step staleness / default-deny checks (issue 32).

    python3 scripts/step_checks_cost.py [--layers 16] [--steps 200] [--runs 5] [--batch 1]

Runs `generate(async_stopping_criteria=True)` with a DynamicCache on a Llama shaped like Llama-3.2-1B by module count
(16 decoder layers, the real layer structure; hidden size 64: the checks' cost depends on the modules, not the
widths), on the CPU, under the CUDA-graph emulation (test-only `transformers_async_stop.testing.emulation`), so the
decode forward replays piecewise as on a GPU. Each check function is wrapped with `time.perf_counter_ns` and its
time summed over the call; the table gives microseconds per decode step (the median over `--runs` calls, each of
`--steps` new tokens; "hot": each check called again 200 times in a row with its last arguments after each call, the
CPU caches warm, the lowest over the runs). The garbage collector is off during the timed calls: a collection of the
whole heap (milliseconds) would otherwise land in whichever check happened to trigger it:

- `WatchSet.why_eager` (before 2026-11-29: `PiecewiseForward._why_not_observed`): hook tables, module dicts,
  training flags, rebound names, modes;
- `PiecewiseForward._step`: the inputs, the mask, the recording key (with `settings.read()`, also shown alone);
- `ModelGraphs.changed`: the recordings' staleness (entries, classes, ModuleList lengths, `__dict__` sizes, pointers,
  and since 2026-11-29 the code state of the watched functions);
- `HookWatch.hooked`: the controller's hook / foreign-module / forward-wrapper check.

To compare two versions of the package on one machine, run this file against each (an older checkout first on
`PYTHONPATH`: the script prints the package's path). Not a test: no assertion; the wrapper adds ~0.1 us a call.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")  # the deferred path on the CPU
os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_PIECEWISE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop.graphs.piecewise import forward, settings  # noqa: E402
from transformers_async_stop.testing.emulation import emulated  # noqa: E402
from transformers_async_stop.undo import module_state  # noqa: E402

# (label, owner, attribute name): the timed functions; a later row runs inside an earlier one where indented
try:  # the per-step guards: stage 4 of the proof pipeline (an older checkout: the forward's own method)
    from transformers_async_stop.graphs.piecewise.proof import WatchSet as _GUARDS  # noqa: E402
    _GUARD = "why_eager"
except ImportError:  # pragma: no cover (a checkout before 2026-11-29)
    _GUARDS, _GUARD = forward.PiecewiseForward, "_why_not_observed"
CHECKS = (
    (f"{_GUARDS.__name__}.{_GUARD}", _GUARDS, _GUARD),
    ("PiecewiseForward._step", forward.PiecewiseForward, "_step"),
    ("  of which settings.read", settings, "read"),
    ("ModelGraphs.changed", forward.ModelGraphs, "changed"),
    ("HookWatch.hooked", module_state.HookWatch, "hooked"),
)
TOTALS: dict = {}
LAST: dict = {}  # label -> (function, args, kwargs) of its last call in the run


def _timed(label, function):
    def wrapper(*args, **kwargs):
        LAST[label] = (function, args, kwargs)
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            total = TOTALS.setdefault(label, [0, 0])
            total[0] += time.perf_counter_ns() - start
            total[1] += 1
    return wrapper


def _install() -> None:
    for label, owner, name in CHECKS:
        function = getattr(owner, name, None)
        if function is not None:
            setattr(owner, name, _timed(label, function))


def _hot(label, repeat=200) -> float:
    """Microseconds a call of the check's function takes when called again and again with its last arguments (caches
    warm, nothing else in between): the checks read and do not change what they read."""
    if label not in LAST:
        return 0.0
    function, args, kwargs = LAST[label]
    start = time.perf_counter_ns()
    for _ in range(repeat):
        function(*args, **kwargs)
    return (time.perf_counter_ns() - start) / 1000 / repeat


def _model(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # Llama-3.2-1B's layout (16 layers, GQA 32/8 heads' ratio, tied embeddings), narrow
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = _model(args.layers)
    ids = torch.randint(3, 256, (args.batch, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.steps, min_new_tokens=args.steps,
                  do_sample=False, pad_token_id=0, async_stopping_criteria=True)
    _install()
    per_run = {label: [] for label, _, _ in CHECKS}
    hot = {label: [] for label, _, _ in CHECKS}
    calls = {}
    with emulated(), torch.no_grad():
        model.generate(ids, **kwargs)  # records the pieces; not counted
        print(f"package: {os.path.dirname(tas.__file__)}", file=sys.stderr)
        print(f"path: {tas.last_path().forward}", file=sys.stderr)
        for _ in range(args.runs):
            TOTALS.clear()
            gc.collect()
            gc.disable()  # a collection of the whole heap (milliseconds) would land in whichever check allocated last
            try:
                model.generate(ids, **kwargs)
            finally:
                gc.enable()
            steps = args.steps - 1  # decode steps (the first token is the prefill's)
            for label, _, _ in CHECKS:
                total, count = TOTALS.get(label, (0, 0))
                per_run[label].append(total / 1000 / steps)
                calls[label] = count / steps
            for label, _, _ in CHECKS:
                hot[label].append(_hot(label) * calls[label])
        print(f"path: {tas.last_path().forward}", file=sys.stderr)
    modules = sum(1 for _ in model.modules())
    print(f"{args.layers} layers, {modules} modules, batch {args.batch}, {args.steps - 1} decode steps x "
          f"{args.runs} runs; torch {torch.__version__}")
    print("in-run: us per decode step inside generate() (median over the runs; min in brackets); hot: the same call "
          "repeated back to back after each run (min over the runs)")
    print(f"{'check':40s} {'calls/step':>10s} {'in-run':>9s} {'(min)':>9s} {'hot':>9s}")
    top, top_hot = [], []
    for label, _, _ in CHECKS:
        values = per_run[label]
        if not label.startswith(" "):
            top.append(values)
            top_hot.append(hot[label])
        print(f"{label:40s} {calls.get(label, 0):10.2f} {statistics.median(values):9.1f} {min(values):9.1f} "
              f"{min(hot[label]):9.1f}")
    sums = [sum(run) for run in zip(*top)]
    sums_hot = [sum(run) for run in zip(*top_hot)]
    print(f"{'total (top-level rows)':40s} {'':10s} {statistics.median(sums):9.1f} {min(sums):9.1f} "
          f"{min(sums_hot):9.1f}")
    graphs = forward.graphs_of(model)
    print(f"what the checks walk: ModelGraphs {len(graphs.entries)} (dict, name, object) entries, "
          f"{len(graphs.functions)} torch names, {len(graphs.tensors)} tensor pointers, {len(graphs.modules)} classes "
          f"and __dict__ sizes")


if __name__ == "__main__":
    main()
