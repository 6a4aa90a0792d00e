"""What the usage fuzzer (usage_runner.py) builds and observes beyond generate()'s output, for issue 25's dimensions.

- `rope_config`: a drawn rope scaling (`dynamic`, `longrope`, `yarn`, `llama3`) as the running release spells it
  (`rope_parameters` from 5.0, `rope_scaling` before), with a small `max_position_embeddings` /
  `original_max_position_embeddings` so that the tiny model crosses it within a call;
- `grad_context`: the autograd context a call or its inputs are made in (`inference_mode`, `no_grad`, none);
- `module_state`: every buffer, parameter, plain attribute (ints, floats, tensors: a rotary module's
  `max_seq_len_cached`, `inv_freq`, `long_inv_freq`, `attention_scaling`) and hook count of every module, and the
  model's attention implementation: state a forward may change (dynamic rope) or a leftover of a failure may leave;
- `tensor_flags`: whether each tensor of an output or cache is an inference tensor / requires grad (a user's in-place
  edit of an inference tensor outside inference mode raises: it is observable);
- `graphed_context`: the piecewise-graphed forward as the scenario's `graphed` draws it for the flag run: `emulated`
  (the CPU emulation of CUDA graphs, `testing/emulation.py`: the path runs on CPU models), `off`
  (`TRANSFORMERS_ASYNC_STOP_PIECEWISE=0`), `natural` (as the device takes it: on CUDA, graphed);
- `alias_signature`: which of the tensors the caller got (output scores, logits, what callbacks received and kept,
  streamer values) are the same object or share storage with an earlier one (an in-place edit of one shows in the
  other: `out.scores[i] is out.logits[i]` in stock when no processor changes the scores).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
from transformers import LlamaConfig

from adversarial_helpers import cache_state

NEW_SPELLING = "rope_parameters" in inspect.signature(LlamaConfig).parameters  # transformers >= 5.0
ROPE_FAMILIES = ("llama", "qwen2", "mistral", "phi3")
HEAD_DIM = 8  # models.build: hidden 16, 2 heads (longrope's factors: one per rotary frequency, HEAD_DIM // 2)


def rope_family(family: str, rope) -> str:
    # transformers before 5.0: Mistral's config takes no rope scaling (its rotary module fails on one): Llama's
    if rope and not NEW_SPELLING and family == "mistral":
        return "llama"
    return family


def rope_config(family: str, rope: dict | None) -> dict:
    """Config constructor kwargs for the drawn `rope` ({"type", "factor", "orig", "max_pos"}), or {}."""
    if not rope:
        return {}
    kind, orig = rope["type"], rope["orig"]
    params = {"rope_type": kind}
    extra = {"max_position_embeddings": rope["max_pos"]}
    if kind in ("dynamic", "linear"):
        params["factor"] = rope["factor"]
    elif kind == "longrope":
        half = HEAD_DIM // 2
        params["short_factor"] = [1.0 + 0.1 * i for i in range(half)]
        params["long_factor"] = [rope["factor"] + i for i in range(half)]
        params["original_max_position_embeddings"] = orig
    elif kind == "yarn":
        params.update(factor=rope["factor"], original_max_position_embeddings=orig)
    elif kind == "llama3":
        params.update(factor=rope["factor"], low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=orig)
    if NEW_SPELLING:
        params["rope_theta"] = 10000.0
        return {"rope_parameters": params, **extra}
    if kind == "longrope":
        # 4.x reads the switch point from the config itself; Phi-3 wants exactly type, short_factor, long_factor
        del params["original_max_position_embeddings"]
        extra["original_max_position_embeddings"] = orig
        if family == "phi3":
            params = {"type": "longrope", "short_factor": params["short_factor"],
                      "long_factor": params["long_factor"]}
    return {"rope_scaling": params, **extra}


@contextlib.contextmanager
def grad_context(name):
    if name == "inference_mode":
        with torch.inference_mode():
            yield
    elif name == "no_grad":
        with torch.no_grad():
            yield
    else:
        yield


@contextlib.contextmanager
def graphed_context(value):
    """The flag run's piecewise forward as drawn (`usage_dimensions._graphed`); None or `natural`: as it is."""
    from transformers_async_stop.graphs.piecewise import PIECEWISE_ENV

    if value == "emulated":
        from transformers_async_stop.testing.emulation import emulated

        with emulated(), _env(PIECEWISE_ENV, "1"):  # (on even where the environment turned it off)
            yield
    elif value == "off":
        with _env(PIECEWISE_ENV, "0"):
            yield
    else:
        yield


@contextlib.contextmanager
def _env(name, value):
    # this one variable set and put back (`mock.patch.dict` would clear and refill the whole environment on the way
    # out, which a second thread of a scenario could read half-refilled)
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _plain(value):
    return value is None or isinstance(value, (bool, int, float, str, torch.Tensor))


def module_state(model, hooks=True) -> dict:
    """`hooks`: count each module's hooks too (only for a model built for this run: transformers installs its own
    output-capturing hooks on a model's first call that asks for hidden states and keeps them)."""
    out = {"attn": getattr(model.config, "_attn_implementation", None)}
    for name, module in model.named_modules():
        for key, buf in module.named_buffers(recurse=False):
            out[f"{name}:buffer:{key}"] = buf
        for key, param in module.named_parameters(recurse=False):
            out[f"{name}:param:{key}"] = param
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training" and _plain(value):
                out[f"{name}:{key}"] = value
        counts = [len(getattr(module, h, ())) for h in ("_forward_hooks", "_forward_pre_hooks")]
        if hooks and any(counts):
            out[f"{name}:hooks"] = counts
    return out


def _tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif hasattr(x, "layers") or type(x).__name__.endswith("Cache"):
        _tensors(list(cache_state(x).values()), out)
    elif hasattr(x, "keys") and callable(x.keys) and hasattr(x, "__getitem__"):
        for k in x.keys():
            _tensors(x[k], out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    return out


def tensor_flags(x) -> list:
    return [(t.is_inference(), t.requires_grad) for t in _tensors(x, [])]


def _storage(t):
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def alias_signature(named) -> list:
    """For each (name, tensor) in order: the name of the first earlier one that is the same object, and of the first
    earlier one sharing its storage (None: none). Names, not ids, so two runs' signatures compare."""
    seen, sig = [], []
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            continue
        ptr = _storage(t)
        same = next((n for n, u, _ in seen if u is t), None)
        shared = next((n for n, _, p in seen if ptr is not None and p == ptr), None)
        sig.append((name, same, shared))
        seen.append((name, t, ptr))
    return sig


def output_tensors(out) -> list:
    """(name, tensor) of an output's sequences, per-step scores and logits (what an alias can join)."""
    if out is None or isinstance(out, torch.Tensor):
        return [("sequences", out)] if out is not None else []
    named = [("sequences", out.sequences)]
    for key in ("scores", "logits"):
        for i, t in enumerate(getattr(out, key, None) or ()):
            named.append((f"{key}[{i}]", t))
    return named
