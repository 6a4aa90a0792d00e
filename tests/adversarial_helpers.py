"""Helpers for the adversarial tests (test_adversarial.py) and the fuzz's adversarial shapes (test_fuzz.py).

Everything here is plain test code: callbacks that nest a `generate()`, raise, draw random numbers or read a
streamer; cache constructors that follow each release's signature; and an exact comparison of any cache's state
(every tensor, dict and counter a cache or its layers hold), for caches `models.assert_same` does not know
(`MambaCache`, linear-attention layers) and for the state a cache is left in after an exception.
"""

from __future__ import annotations

import inspect

import torch
from transformers import (
    DynamicCache,
    EosTokenCriteria,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    MaxLengthCriteria,
    StaticCache,
    StoppingCriteria,
)
from transformers.generation.streamers import BaseStreamer

import transformers_async_stop as tas
from models import PAD, pick_eos, stock

# --- the model of the issue: a tiny random Llama, vocab 64, eos_token_id=2, prompt [[5, 6, 7, 8]] -------------------
ISSUE_IDS = [[5, 6, 7, 8]]


def issue_model(**overrides):
    """The issue's model. With seed 0 its greedy continuation of ISSUE_IDS is 9, 2, 38, 41, 13, 59, 24, 6, ...
    (eos_token_id=41 stops it at the 4th new token, a token 38 at the 3rd)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         eos_token_id=2, pad_token_id=PAD, bos_token_id=1, initializer_range=0.5)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def judge_model():
    """A second tiny model (GPT-2, one layer, vocab 48 like `models.build`) for a generate() nested in a callback."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    config = GPT2Config(vocab_size=48, n_embd=16, n_layer=1, n_head=2, n_positions=64, pad_token_id=PAD,
                        bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config).eval()


def issue_ids():
    return torch.tensor(ISSUE_IDS)


# --- caches ------------------------------------------------------------------------------------------------------
def static_cache(model, max_cache_len: int, batch_size: int = 1):
    """A user StaticCache of `max_cache_len` positions, whatever the release's constructor looks like."""
    params = inspect.signature(StaticCache).parameters
    kwargs = {"config": model.config, "max_cache_len": max_cache_len}
    for name in ("max_batch_size", "batch_size"):  # older signatures also want the batch size
        if name in params:
            kwargs[name] = batch_size
    if "dtype" in params:
        kwargs["dtype"] = model.dtype
    if "device" in params:
        kwargs["device"] = model.device
    return StaticCache(**kwargs)


def config_cache(model):
    """The DynamicCache generate() would build for `model` (sliding-window layers where the config has them)."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # releases whose DynamicCache takes no config
        return DynamicCache()


def _flatten(value, path, out):
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            _flatten(value[key], f"{path}[{key!r}]", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, f"{path}[{i}]", out)
    elif value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        out[path] = value
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("transformers"):
        _flatten_object(value, path, out)
    else:
        out[path] = type(value)


def _flatten_object(obj, path, out):
    out[f"{path}.__class__"] = type(obj)
    for name, value in sorted(vars(obj).items()):
        if name.startswith("__"):
            continue
        _flatten(value, f"{path}.{name}", out)


def cache_state(cache) -> dict:
    """Every piece of state a cache object holds (its layers included), flattened to {path: tensor or value}."""
    out = {}
    _flatten_object(cache, "cache", out)
    return out


def assert_same_cache_state(test, a, b, path="cache"):
    """Exact equality of two caches' whole state: tensors (shape, dtype, values), counters, flags, layer types."""
    sa, sb = cache_state(a), cache_state(b)
    test.assertEqual(sorted(sa), sorted(sb), f"{path}: the caches hold different attributes")
    for key, x in sa.items():
        y = sb[key]
        where = path + key[len("cache"):]
        if isinstance(x, torch.Tensor):
            test.assertIsInstance(y, torch.Tensor, where)
            test.assertEqual((x.shape, x.dtype), (y.shape, y.dtype), where)
            test.assertTrue(torch.equal(x, y), f"{where} differs")
        else:
            test.assertEqual(x, y, where)


# --- callbacks -----------------------------------------------------------------------------------------------------
class Boom(RuntimeError):
    """Raised on purpose by a callback inside generate()."""


class Interrupt(KeyboardInterrupt):
    """A Ctrl-C arriving inside a callback: a `BaseException`, which `except Exception` cleanup never sees."""


class RaiseAtCall(LogitsProcessor):
    """Raises `Boom` at its call number `at` (0 = the prefill step), before returning anything."""

    def __init__(self, at: int):
        self.at = at
        self.calls = 0

    def __call__(self, input_ids, scores):
        call = self.calls
        self.calls += 1
        if call == self.at:
            raise Boom(f"processor call {call}")
        return scores


class RecordingStreamer(BaseStreamer):
    """Records a copy of every `put()` value (as lists) and counts `end()` calls."""

    def __init__(self):
        self.puts: list[list] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.detach().cpu().tolist())

    def end(self):
        self.ends += 1


class NoiseProcessor(LogitsProcessor):
    """Adds small `torch.rand` noise to the scores: draws from the global RNG even in a greedy call."""

    def __init__(self, scale: float = 1e-3):
        self.scale = scale

    def __call__(self, input_ids, scores):
        return scores + self.scale * torch.rand(scores.shape, device=scores.device)


class InnerGenerate:
    """Runs `model.generate(...)` on the outer call's last tokens, and records every inner output (LLM-as-judge).

    `flag`: the inner call's `async_stopping_criteria` (None: not passed). `kwargs`: the inner call's generate
    arguments. The inner call's result only steers the outer call through `bias` (a bonus on the inner call's
    first generated token), so that a wrong inner result also changes the outer output."""

    def __init__(self, model, flag=None, tail: int = 3, bias: float = 0.0, seed: int | None = None,
                 make_cache=None, **kwargs):
        self.model = model
        self.flag = flag
        self.tail = tail
        self.bias = bias
        self.seed = seed
        self.make_cache = make_cache  # model -> a fresh user cache for each inner call (None: generate's own)
        self.kwargs = dict(kwargs)
        self.records: list = []

    def judge(self, input_ids):
        tail = input_ids[:, -self.tail:]
        kwargs = dict(self.kwargs)
        if self.flag is not None and tas.is_patched():
            # under `models.stock()` the inner call is stock's (the field does not exist there)
            kwargs["async_stopping_criteria"] = self.flag
        if self.seed is not None:
            torch.manual_seed(self.seed + input_ids.shape[1])
        if self.make_cache is not None:
            kwargs["past_key_values"] = self.make_cache(self.model)
        out = self.model.generate(tail, attention_mask=torch.ones_like(tail), pad_token_id=PAD, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        self.records.append(_detached(out))
        return sequences


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    return {key: _detached_value(value) for key, value in out.items() if key != "past_key_values"}


def _detached_value(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(_detached_value(v) for v in value)
    return value


class InnerGenerateProcessor(LogitsProcessor):
    def __init__(self, inner: InnerGenerate):
        self.inner = inner

    def __call__(self, input_ids, scores):
        sequences = self.inner.judge(input_ids)
        if self.inner.bias:
            # one row per outer row (an inner call returning several sequences per row: the first of each)
            step = max(sequences.shape[0] // scores.shape[0], 1)
            first = sequences[::step, self.inner.tail].to(scores.device) % scores.shape[-1]
            scores = scores.clone()
            scores[torch.arange(scores.shape[0], device=scores.device), first] += self.inner.bias
        return scores


class InnerGenerateCriterion(StoppingCriteria):
    """A stopping criterion that consults an inner generate() and never stops by itself."""

    def __init__(self, inner: InnerGenerate):
        self.inner = inner

    def __call__(self, input_ids, scores, **kwargs):
        self.inner.judge(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class MaxLengthOrToken(MaxLengthCriteria):
    """A MaxLengthCriteria subclass that also stops a row whose last token is `token` (its own `__call__`)."""

    def __init__(self, max_length: int, token: int):
        super().__init__(max_length=max_length)
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        done = super().__call__(input_ids, scores, **kwargs)
        return done | (input_ids[:, -1] == self.token)


class EosOnlyAfter(EosTokenCriteria):
    """An EosTokenCriteria subclass whose `__call__` only honours its EOS ids from `min_length` on, and counts
    its calls."""

    def __init__(self, eos_token_id, min_length: int):
        super().__init__(eos_token_id=eos_token_id)
        self.min_length = min_length
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        done = super().__call__(input_ids, scores, **kwargs)
        if input_ids.shape[1] < self.min_length:
            done = torch.zeros_like(done)
        return done


def stock_min_cache_len(make_run, start: int, stop: int = 64) -> int:
    """The smallest `max_cache_len` with which stock transformers' run `make_run(cache_len)` does not raise."""
    with stock():
        for length in range(start, stop):
            try:
                make_run(length)
            except IndexError:
                continue
            return length
    raise AssertionError(f"stock needs more than {stop - 1} cache positions")


def eos_from_stock_run(model, ids, mask, steps_per_row, max_new_tokens, seed=123, make_kwargs=dict):
    """EOS ids that make row r stop at (about) step `steps_per_row[r]` (None: never) of the stock run of the same
    call without EOS: same seed (as `models.generate_and_draw`), same arguments (`make_kwargs()` builds fresh
    callbacks for each run). Like `models.eos_ids_finishing_at`, but also right under sampling, dropout or noise."""
    with stock():
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens,
                             eos_token_id=None, **make_kwargs())
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    generated = sequences[:, ids.shape[1]:].tolist()
    eos = pick_eos(generated, steps_per_row)
    if not eos:
        raise AssertionError(f"no EOS id stops the rows at {steps_per_row} in {generated}")
    return eos


class RaiseAtCallCriterion(StoppingCriteria):
    """A stopping criterion that raises `Boom` at its call number `at` (0 = after the prefill step)."""

    def __init__(self, at: int):
        self.at = at
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        call = self.calls
        self.calls += 1
        if call == self.at:
            raise Boom(f"criterion call {call}")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class RaisingStreamer(RecordingStreamer):
    """A streamer whose consumer goes away: its `put()` number `at` (0 = the prompt) raises `error` (`Boom`)."""

    def __init__(self, at: int, error: type = Boom):
        super().__init__()
        self.at = at
        self.error = error

    def put(self, value):
        super().put(value)
        if len(self.puts) - 1 == self.at:
            raise self.error(f"streamer put {self.at}")
