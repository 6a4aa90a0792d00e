"""The project's equality cases, run against a transformers with the upstream series (upstream/*.patch) applied and the
plug-in NOT imported, and compared with unpatched transformers 5.24.0 (scripts/upstream_check.sh runs it).

    python tests/upstream_equality.py run OUT.pt             # unpatched 5.24.0: stock only
    python tests/upstream_equality.py run OUT.pt --patched   # patched: flag off and flag on
    python tests/upstream_equality.py compare STOCK.pt PATCHED.pt

The cases are tests/test_equivalence.py's (three families x its scenarios: EOS per row, max_length, min_new_tokens,
left padding, user criteria, sampling) with all the outputs it compares, plus a returned static cache, a user
DynamicCache, a streamer, a nested generate(), beam search and an encoder-decoder model. `--patched` runs every case
twice: without the flag, and with it on the deferred path, forced on the CPU the way the series' own tests do it
(`DeferredStopCheck.is_supported` sees the CPU as CUDA). `compare` asks for stock == patched flag off == patched
flag on, bit for bit, including the RNG state after each call, and for the deferred path to have run: one forward
more than stock exactly where stock stopped before its length limit, none elsewhere.

tests/models.py and tests/test_equivalence.py import the plug-in for their own tests; a stand-in module takes its
place here (its `stock()` is then a no-op), and `run` refuses to go on if the real plug-in got imported anyway.
Not collected by pytest (the file name does not start with `test_`).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from unittest.mock import patch

HERE = Path(__file__).resolve().parent


CASE_FILES = (HERE / "models.py", HERE / "test_equivalence.py")


def stand_in_module():
    """What the shared cases use of the plug-in, inert (tests/test_upstream_stand_in.py checks it covers them)."""
    stand_in = types.ModuleType("transformers_async_stop")
    stand_in.is_patched = lambda: False
    stand_in.unpatch = stand_in.apply = lambda: None
    # without the plug-in no hook is watched, so a passive mark changes nothing: the hook as given
    stand_in.passive_hook = lambda hook: hook
    stand_in.StockPathWarning = type("StockPathWarning", (UserWarning,), {})
    stand_in.STAND_IN = True
    return stand_in


def _import_cases():
    """tests/models.py and tests/test_equivalence.py, with a stand-in for the plug-in."""
    sys.modules["transformers_async_stop"] = stand_in_module()
    sys.path.insert(0, str(HERE))
    import models
    import test_equivalence

    loaded = [name for name in sys.modules if name.startswith("transformers_async_stop.")]
    if loaded or not getattr(sys.modules["transformers_async_stop"], "STAND_IN", False):
        raise SystemExit(f"the plug-in was imported ({loaded}): this check must run transformers alone")
    return models, test_equivalence


def _forced_deferral():
    """The series' test hook: `DeferredStopCheck` treats the CPU as CUDA (where the flag decides)."""
    import torch
    from transformers.generation.utils import DeferredStopCheck

    is_supported = DeferredStopCheck.is_supported

    def as_if_on_cuda(device, *args, **kwargs):
        return is_supported(torch.device("cuda") if device.type == "cpu" else device, *args, **kwargs)

    return patch.object(DeferredStopCheck, "is_supported", staticmethod(as_if_on_cuda))


def _plain(value):
    """A generate() output as nested dicts, lists and tensors (caches as their layers' tensors), for torch.save."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if hasattr(value, "self_attention_cache"):
        return {"self": _plain(value.self_attention_cache), "cross": _plain(value.cross_attention_cache)}
    if hasattr(value, "layers"):
        return [
            {name: _plain(getattr(layer, name)) for name in ("keys", "values", "cumulative_length")
             if isinstance(getattr(layer, name, None), torch.Tensor)}
            for layer in value.layers
        ]
    if isinstance(value, dict) or (hasattr(value, "keys") and callable(value.keys)):
        return {key: _plain(value[key]) for key in value.keys()}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _cases(models, equivalence):
    """(name, model, input ids, mask, generate kwargs, a function of the call for extra records)."""
    import torch
    from transformers import (
        DynamicCache,
        LogitsProcessor,
        LogitsProcessorList,
        T5Config,
        T5ForConditionalGeneration,
    )
    from transformers.generation.streamers import BaseStreamer

    for family in equivalence.FAMILIES:
        for scenario in equivalence.SCENARIOS:
            model = models.build(family)
            ids, mask, kwargs, _ = equivalence._scenario(scenario, model, family)
            yield f"{family}/{scenario}", model, ids, mask, {**kwargs, **equivalence.FULL_OUTPUTS}

    model = models.build("llama")
    ids, mask = models.prompt()
    eos = models.eos_ids_finishing_at(model, ids, mask, [3, 5, 7])
    yield "llama/static_cache_returned", model, ids, mask, dict(
        max_new_tokens=12, eos_token_id=eos, cache_implementation="static", return_dict_in_generate=True,
        output_scores=True)
    yield "llama/beam_search", model, ids, mask, dict(
        max_new_tokens=12, eos_token_id=eos, num_beams=2, return_dict_in_generate=True, output_scores=True)
    yield "llama/user_dynamic_cache", model, ids, mask, dict(
        max_new_tokens=12, eos_token_id=eos, user_cache=lambda: DynamicCache(config=model.config),
        return_dict_in_generate=True)

    class Recorder(BaseStreamer):
        def __init__(self):
            self.values = []

        def put(self, value):
            self.values.append(value.clone())

        def end(self):
            self.values.append("end")

    one_ids, one_mask = ids[:1], mask[:1]
    yield "llama/streamer", model, one_ids, one_mask, dict(
        max_new_tokens=12, eos_token_id=models.eos_ids_finishing_at(model, one_ids, one_mask, [4]), streamer=Recorder)

    class NestedGenerate(LogitsProcessor):
        """Calls another model's generate() (with the same flag) at every step."""

        def __init__(self, inner, flag):
            self.inner, self.flag, self.calls = inner, flag, 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            extra = {} if self.flag is None else {"async_stopping_criteria": self.flag}
            inner = self.inner.generate(input_ids[:, -3:], max_new_tokens=4, eos_token_id=3, pad_token_id=models.PAD,
                                        **extra)
            return scores + inner[:, -1:].to(scores.dtype) * 1e-3

    inner = models.build("gpt2", seed=1)
    yield "llama/nested_generate", model, ids, mask, dict(
        max_new_tokens=12, eos_token_id=eos, logits_processor=lambda flag: NestedGenerate(inner, flag))

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=models.VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, pad_token_id=models.PAD,
        eos_token_id=2, decoder_start_token_id=models.PAD, initializer_factor=5.0)).eval()
    greedy = t5.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    yield "t5/eos_rows_differ", t5, ids, mask, dict(
        max_new_tokens=10, eos_token_id=greedy[:, 3].tolist(), return_dict_in_generate=True, output_scores=True)


def _cache_argument() -> str:
    """generate()'s name for a cache: `cache` since 5.24 (`past_key_values` is deprecated there), before it
    `past_key_values`."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def _call(models, model, ids, mask, kwargs, flag):
    """One generate() call of a case: its output, the RNG draw after it, forward calls, extra records."""
    from transformers import LogitsProcessorList

    kwargs = dict(kwargs)
    extra = {}
    if "user_cache" in kwargs:
        extra["cache"] = kwargs[_cache_argument()] = kwargs.pop("user_cache")()
    if isinstance(kwargs.get("streamer"), type):
        kwargs["streamer"] = streamer = kwargs["streamer"]()
        extra["streamed"] = streamer.values
    if callable(kwargs.get("logits_processor")):
        processor = kwargs["logits_processor"](flag)
        kwargs["logits_processor"] = LogitsProcessorList([processor])
        extra["processor_calls"] = lambda: processor.calls
    output, after, forwards = models.generate_and_draw(model, ids, mask, flag, **kwargs)
    if "processor_calls" in extra:
        extra["processor_calls"] = extra["processor_calls"]()
    prompt_length = 1 if model.config.is_encoder_decoder else ids.shape[1]  # the decoder starts from one token
    limit = prompt_length + kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else kwargs.get("max_length")
    return {"output": _plain(output), "rng_after": after, "forwards": forwards, "extra": _plain(extra),
            "length_limit": limit}


def run(out: str, patched: bool) -> None:
    import torch
    import transformers

    models, equivalence = _import_cases()
    results = {"transformers": transformers.__version__, "file": transformers.__file__, "cases": {}}
    for name, model, ids, mask, kwargs in _cases(models, equivalence):
        if patched:
            record = {"off": _call(models, model, ids, mask, kwargs, False)}
            with _forced_deferral():
                record["on"] = _call(models, model, ids, mask, kwargs, True)
        else:
            record = {"stock": _call(models, model, ids, mask, kwargs, None)}
        results["cases"][name] = record
        print(name, {key: value["forwards"] for key, value in record.items()}, flush=True)
    torch.save(results, out)


def _differences(a, b, path):
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and (
            a.shape == b.shape and torch.equal(a, b))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _stopped_early(record) -> bool:
    sequences = record["output"]["sequences"] if isinstance(record["output"], dict) else record["output"]
    limit = record["length_limit"]
    return limit is not None and sequences.shape[-1] < limit


def compare(stock_file: str, patched_file: str) -> int:
    import torch

    stock = torch.load(stock_file, weights_only=False)
    patched = torch.load(patched_file, weights_only=False)
    print(f"stock:   transformers {stock['transformers']} ({stock['file']})")
    print(f"patched: transformers {patched['transformers']} ({patched['file']})")
    if stock["file"] == patched["file"]:
        print("FAIL: both runs imported the same transformers")
        return 1
    failures, deferred = [], 0
    if stock["cases"].keys() != patched["cases"].keys():
        failures.append(f"cases differ: {sorted(stock['cases'].keys() ^ patched['cases'].keys())}")
    for name in sorted(stock["cases"].keys() & patched["cases"].keys()):
        ref, off, on = stock["cases"][name]["stock"], patched["cases"][name]["off"], patched["cases"][name]["on"]
        for label, record in (("flag off", off), ("flag on", on)):
            for key in ("output", "rng_after", "extra"):
                failures += [f"{name} {label}: {d}" for d in _differences(ref[key], record[key], key)]
        failures += [f"{name} flag off: {d}" for d in _differences(ref["forwards"], off["forwards"], "forwards")]
        # beam search is not deferred; everything else stopped early pays exactly one extra, undone, forward
        expected = 1 if _stopped_early(ref) and "beam" not in name else 0
        if on["forwards"] - ref["forwards"] != expected:
            failures.append(f"{name} flag on: {on['forwards']} forwards, stock {ref['forwards']}, expected "
                            f"{expected} more (the deferred path did not run as it should)")
        deferred += expected
    for failure in failures:
        print("FAIL:", failure)
    print(f"{len(stock['cases'])} cases, {deferred} of them stopped early on the deferred path; "
          f"{'all equal' if not failures else f'{len(failures)} differences'}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run")
    run_parser.add_argument("out")
    run_parser.add_argument("--patched", action="store_true", help="transformers has the series: flag off and on")
    compare_parser = sub.add_parser("compare")
    compare_parser.add_argument("stock")
    compare_parser.add_argument("patched")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "run":
        run(args.out, args.patched)
        return 0
    return compare(args.stock, args.patched)


if __name__ == "__main__":
    sys.exit(main())
