"""Side-by-side timing and equality of the piecewise-graphed decode forward (issue 27), on one CUDA device.

    PYTHONPATH=.:tests python3 scripts/piecewise_check.py [--quick] [--cases=b1,b8]

For each case: unpatched transformers ("stock"), the flag with the eager forward ("flag"), and the flag with the
piecewise-graphed forward ("piecewise"), in the same process, alternating. Prints ms/token (median of the timed
calls, after one warm-up call each; the piecewise warm-up is the first call, which records, timed separately),
whether sequences (and, for one call each, every step's logits) are bit-identical to stock, `last_path().forward`,
the recording's capture time and the memory the recordings keep. Cases: transformers #43089's tiny Llama as written
(its processor and criterion, fp32, b1, 64 tokens), and a Llama-1B-shaped bf16 model from config (b1 greedy, b1
sampling, left-padded b8 greedy; 128 tokens).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, StoppingCriteriaList

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop.bench.cases import (  # noqa: E402
    AlwaysPassStoppingCriteria,
    ExtraSoftmaxLogitsProcessor,
    llama_1b_config,
    tiny_llama_config,
)
from transformers_async_stop.graphs.piecewise import forward, proof  # noqa: E402

ENV = proof.PIECEWISE_ENV


def build(config, dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def run(model, ids, mask, mode, seed=0, **kwargs):
    """One generate() call in `mode`; (output, seconds). "piecewise" is the flag as it comes (no variable set)."""
    extra = {}
    if mode == "stock":
        tas.unpatch()
    else:
        extra["async_stopping_criteria"] = True
        if mode == "piecewise":
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = "0"
    try:
        torch.manual_seed(seed)
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs, **extra)
        torch.cuda.synchronize()
        return out, time.perf_counter() - started
    finally:
        if mode == "stock":
            tas.apply()


def _same(a, b) -> bool:
    """Sequences, every step's logits and the returned cache, bit for bit."""
    return (torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits)
            and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
            and all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                    for x, y in zip(a.past_key_values.layers, b.past_key_values.layers)))


def case(name, model, ids, mask, new_tokens, reps, **kwargs):
    kwargs = dict(max_new_tokens=new_tokens, pad_token_id=0, **kwargs)
    full = dict(return_dict_in_generate=True, output_logits=True)
    result = {"case": name}
    ref, _ = run(model, ids, mask, "stock", **full, **kwargs)
    again, _ = run(model, ids, mask, "stock", **full, **kwargs)
    result["stock_repeatable"] = _same(ref, again)
    result["nan_in_logits"] = any(bool(torch.isnan(x).any()) for x in ref.logits)
    del again
    gc.collect()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    on, first = run(model, ids, mask, "piecewise", **full, **kwargs)  # the first call records
    path = tas.last_path()
    result["forward"] = path.forward if path is not None else None
    result["piecewise_equal"] = _same(ref, on)
    result["contiguous"] = all(x.keys.is_contiguous() and x.values.is_contiguous() for x in on.past_key_values.layers)
    del on
    gc.collect()
    result["kept_allocated_MiB"] = round((torch.cuda.memory_allocated() - allocated) / 2**20, 2)
    result["kept_reserved_MiB"] = round((torch.cuda.memory_reserved() - reserved) / 2**20, 2)
    recordings = list(forward.graphs_of(model).recordings.values())
    result["capture_s"] = [round(r.capture_seconds, 4) for r in recordings]
    result["first_call_s"] = round(first, 4)
    flag, _ = run(model, ids, mask, "flag", **full, **kwargs)
    result["flag_equal"] = _same(ref, flag)
    del flag, ref
    times = {mode: [] for mode in ("stock", "flag", "piecewise")}
    for mode in times:  # warm-up
        run(model, ids, mask, mode, **kwargs)
    for _ in range(reps):
        outs = {}
        for mode in times:
            outs[mode], seconds = run(model, ids, mask, mode, **kwargs)
            times[mode].append(seconds)
        for mode in ("flag", "piecewise"):
            if not torch.equal(outs[mode], outs["stock"]):
                result.setdefault("timed_mismatch", []).append(mode)
    generated = outs["stock"].shape[1] - ids.shape[1]
    for mode, values in times.items():
        result[f"{mode}_ms_per_token"] = round(statistics.median(values) * 1000 / generated, 3)
        result[f"{mode}_all_ms_per_token"] = [round(v * 1000 / generated, 3) for v in values]
    result["tokens"] = generated
    result["last_forward"] = tas.last_path().forward
    return result


def guarded(results, name, *args, **kwargs):
    try:
        results.append(case(name, *args, **kwargs))
        print(json.dumps(results[-1]), flush=True)
    except Exception:  # one case's failure must not hide the others'
        import traceback

        traceback.print_exc()


def main():
    quick = "--quick" in sys.argv
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--cases=")), None)
    results = []
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers",
          __import__("transformers").__version__, flush=True)

    tiny = build(tiny_llama_config(), torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 8), generator=g).cuda()
    guarded(results, "issue-43089 as written (fp32 b1)", tiny, ids, torch.ones_like(ids), 64, 5,
            logits_processor=LogitsProcessorList([ExtraSoftmaxLogitsProcessor()]),
            stopping_criteria=StoppingCriteriaList([AlwaysPassStoppingCriteria()]), do_sample=False)
    del tiny
    if not quick:
        big = build(llama_1b_config(), torch.bfloat16)
        ids = torch.randint(3, 32000, (1, 32), generator=g).cuda()
        for name, kwargs in (("llama-1b bf16 b1 greedy", dict(do_sample=False, eos_token_id=None)),
                             ("llama-1b bf16 b1 sample", dict(do_sample=True, top_k=0, top_p=1.0, eos_token_id=None))):
            if only is None or "b1" in only:
                guarded(results, name, big, ids, torch.ones_like(ids), 128, 2, **kwargs)
        ids8 = torch.randint(3, 32000, (8, 32), generator=g).cuda()
        mask8 = torch.ones_like(ids8)
        for row in range(8):
            mask8[row, :row * 3] = 0
            ids8[row, :row * 3] = 0
        if only is None or "b8" in only:
            guarded(results, "llama-1b bf16 b8 left-padded greedy", big, ids8, mask8, 128, 2, do_sample=False,
                    eos_token_id=None)

    print()
    print(f"{'case':40s} {'stock':>8s} {'flag':>8s} {'piecewise':>9s}  stock=stock  pw=stock  flag=stock  "
          f"capture_s  forward")
    for r in results:
        equal = r["piecewise_equal"] and "piecewise" not in r.get("timed_mismatch", ())
        print(f"{r['case']:40s} {r['stock_ms_per_token']:8.3f} {r['flag_ms_per_token']:8.3f} "
              f"{r['piecewise_ms_per_token']:9.3f}  {str(r['stock_repeatable']):11s}  {str(equal):8s}  "
              f"{str(r['flag_equal']):10s}  {r['capture_s']}  {r['forward']}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "piecewise_timing.json"), "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
