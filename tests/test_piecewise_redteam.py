"""Holes the red team found in the piecewise-graphed forward, on the CPU under the emulation of CUDA graphs
(`testing.emulation.emulated()`): each case compares a flag-on call (graphed) with unpatched transformers.

Each class names its hole (A-F, B2: the red team of 2026-11-25, /work/notes/redteam-piecewise/); each failed on
5.17, 5.23 and 5.24 (A on 5.17 only) before its fix in `piecewise/forward.py` / `piecewise/graphs.py`, and pins it.
"""

from __future__ import annotations

import contextlib
import unittest

import torch
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import transformers_async_stop as tas
from adversarial_helpers import cache_state
from models import PAD, TRANSFORMERS_VERSION, build, stock
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases
REQUIRE_PATH = True  # (a check of the cases themselves turns it off with the emulation: the eager flag run = stock)


def _ids(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 48, shape, generator=g)


def _cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


class _RaiseAt(StoppingCriteria):
    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError(f"criterion raised at call {self.at}")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _conversation(model, flag, turns):
    """Runs `turns` (each: a function (model, cache, previous output, flag) -> output or exception) on one cache;
    what the caller observes: each call's output or exception, and the cache after it."""
    cache, seen, out = _cache(model), [], None
    for turn in turns:
        try:
            with torch.no_grad():
                out = turn(model, cache, out, flag)
            seen.append(("out", out.clone()))
        except (ValueError, KeyboardInterrupt) as exc:
            seen.append(("raised", f"{type(exc).__name__}: {exc}"))
        seen.append(("cache", {k: v.clone() if isinstance(v, torch.Tensor) else v
                               for k, v in cache_state(cache).items()}))
        if flag:
            seen.append(("path", tas.last_path().forward))
    return seen


def _compare(test, turns, family="llama", each_run=contextlib.nullcontext):
    """`each_run`: a context around each run (stock's, then the flag's)."""
    with stock(), each_run():
        ref = _conversation(build(family), False, turns)
    with emulated(), each_run():
        got = _conversation(build(family), True, turns)
    paths = [value for kind, value in got if kind == "path"]
    got = [(kind, value) for kind, value in got if kind != "path"]
    # the emulation engaged: the piecewise forward decided (graphed, or eager for a reason of the step's)
    if REQUIRE_PATH:
        test.assertTrue(any(p is not None and "not CUDA" not in p for p in paths), paths)
    test.assertEqual(len(ref), len(got))
    for (kind, a), (kind_b, b) in zip(ref, got):
        test.assertEqual(kind, kind_b)
        if kind == "cache":
            test.assertEqual(a.keys(), b.keys())
            for key in a:
                same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
                test.assertTrue(same, (key, paths))
        elif kind == "out":
            test.assertTrue(torch.equal(a, b), (a.tolist(), b.tolist(), paths))
        else:
            test.assertEqual(a, b)


def _kwargs(flag, **kwargs):
    kwargs.update(do_sample=False, pad_token_id=PAD, eos_token_id=None)
    if flag:
        kwargs["async_stopping_criteria"] = True
    return kwargs


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class MaskShorterThanTheCache(unittest.TestCase):
    """HOLE A (CUDA usage fuzzer seeds 51, 177, 1339, 1443 on 5.17; reproduced here under the emulation, all four
    with this one cause): a 2D attention mask shorter than the cache + 1. Stock's `create_causal_mask` then masks the
    cache's last positions at each decode step (the mask is aligned to the mask's length, not the cache's); the
    eager flag path does the same, but `piecewise.steps.attention_mask` sees an unpadded 2D mask and gives the
    attention no mask at all, so the replayed steps attend to every cached position. The mask comes out short where a
    continued cache holds more positions than the conversation fed: a chunked prefill on a continued cache (stock
    prefills the whole conversation again on top of the cache), or the conversation fed again after a call that
    raised mid-call (the cache kept that call's steps)."""

    def test_a_chunked_prefill_on_a_continued_cache(self):
        # seeds 177, 51 (shrunk): a first call, then the whole conversation with prefill_chunk_size
        def first(model, cache, _, flag):
            return model.generate(_ids(1, (1, 2)), past_key_values=cache, **_kwargs(flag, max_new_tokens=1))

        def second(model, cache, out, flag):
            ids = torch.cat([out, _ids(2, (1, 5))], 1)
            return model.generate(ids, past_key_values=cache, **_kwargs(flag, max_new_tokens=4, prefill_chunk_size=3))

        _compare(self, [first, second])

    def test_the_conversation_fed_again_after_a_call_that_raised(self):
        # seeds 1339, 1443 (shrunk): a criterion raises mid-call, the user sends the conversation plus one token
        prompt = _ids(1, (1, 6))

        def first(model, cache, _, flag):
            return model.generate(prompt, past_key_values=cache, **_kwargs(
                flag, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([_RaiseAt(7)])))

        def second(model, cache, _, flag):
            ids = torch.cat([prompt, _ids(2, (1, 1))], 1)
            return model.generate(ids, past_key_values=cache, **_kwargs(flag, max_new_tokens=3))

        _compare(self, [first, second])



@contextlib.contextmanager
def _sdpa_raising_at(call, exc):
    """transformers' "sdpa" attention re-registered (`AttentionInterface.register`, the public way) as one that raises
    `exc` at its `call`-th call: with a 2-layer model, calls 1-2 are the prefill's, 3-4 the first decode step's (the
    step the piecewise forward records), 5 onwards replays'."""
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    had = "sdpa" in AttentionInterface._global_mapping
    calls = [0]

    def attention(module, query, key, value, mask, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise exc(f"attention raised at call {call}")
        return real(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("sdpa", attention)
    try:
        yield
    finally:
        if had:
            AttentionInterface.register("sdpa", real)
        else:
            AttentionInterface._global_mapping.pop("sdpa", None)


def _then_again(model, cache, _, flag):
    ids = torch.cat([_ids(1, (1, 5)), _ids(7, (1, 2))], 1)
    return model.generate(ids, past_key_values=cache, **_kwargs(flag, max_new_tokens=4))


def _first_call(model, cache, _, flag):
    return model.generate(_ids(1, (1, 5)), past_key_values=cache, **_kwargs(flag, max_new_tokens=6))


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class ExceptionInsideTheRecordingForward(unittest.TestCase):
    """HOLE D: an exception the model's forward raises while the piecewise forward records it (here from the
    attention function a user registered for "sdpa"; on a GPU also an out-of-memory error, say) is taken for a
    refused capture: `PiecewiseForward._record` catches every Exception, marks the key failed and runs the step again
    eagerly, so generate() returns where stock raises (and the user's function ran twice for that step). A
    BaseException (KeyboardInterrupt) is re-raised, but `graphs.record` first restores the cache to before the step,
    where stock's cache keeps the layers this step's forward had updated."""

    def test_an_exception_raised_by_the_attention_while_recording_reaches_the_caller(self):
        for call in (3, 4):
            with self.subTest(call=call):
                _compare(self, [_first_call, _then_again], each_run=lambda: _sdpa_raising_at(call, ValueError))

    def test_a_keyboard_interrupt_while_recording_leaves_the_cache_as_stock_does(self):
        for call in (3, 4):
            with self.subTest(call=call):
                _compare(self, [_first_call, _then_again], each_run=lambda: _sdpa_raising_at(call, KeyboardInterrupt))


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class PythonTheReplaySkips(unittest.TestCase):
    """HOLE B: a torch function the model's modules call from Python, rebound by the user between two calls
    (`torch.nn.functional.silu`, which `nn.SiLU.forward`, Llama's MLP activation, looks up per call): stock's next
    call runs the new one; the replays of the recording made before run the old kernels. (`proof.names.watched`
    covers the modeling module's functions and the module classes' forwards, not the torch functions they call.)
    B2: the same for a tensor operator (`Tensor.__add__`), which no name in the forward's code looks up.

    HOLE C: a Python observer active around generate(), a `TorchFunctionMode` (a counting or logging mode, as
    profilers and debuggers install): stock's every decode step calls it; a replay none (CUDA: a
    `TorchDispatchMode` sees no replayed op either; the emulation dispatches its replays, so only the CUDA case shows
    that one). The path does not step aside for an active mode as it does for a hook."""

    def test_a_torch_function_rebound_between_calls_is_used_by_the_next_call(self):
        real = torch.nn.functional.silu

        def doubled(x, inplace=False):
            return real(x) * 2.0

        def first(model, cache, _, flag):
            return model.generate(_ids(1, (1, 5)), past_key_values=cache, **_kwargs(flag, max_new_tokens=5))

        def second(model, cache, out, flag):
            torch.nn.functional.silu = doubled
            try:
                ids = torch.cat([out, _ids(7, (1, 2))], 1)
                return model.generate(ids, past_key_values=cache, **_kwargs(flag, max_new_tokens=5))
            finally:
                torch.nn.functional.silu = real

        _compare(self, [first, second])

    def test_a_tensor_operator_rebound_between_calls_is_used_by_the_next_call(self):
        # HOLE B2 (after B's fix, 42d5976): an operator (`residual + hidden_states` is `Tensor.__add__`, looked up by
        # the interpreter, not by a name in the forward's code) rebound between calls; stock's next call runs it
        real = torch.Tensor.__add__

        def bumped(self, other):
            out = real(self, other)
            return out * 1.5 if isinstance(out, torch.Tensor) and out.is_floating_point() else out

        def first(model, cache, _, flag):
            return model.generate(_ids(1, (1, 5)), past_key_values=cache, **_kwargs(flag, max_new_tokens=4))

        def second(model, cache, out, flag):
            torch.Tensor.__add__ = bumped
            try:
                ids = torch.cat([out, _ids(7, (1, 2))], 1)
                return model.generate(ids, past_key_values=cache, **_kwargs(flag, max_new_tokens=4))
            finally:
                torch.Tensor.__add__ = real

        _compare(self, [first, second])

    def test_a_function_mode_active_around_generate_sees_every_decode_step(self):
        class CountLinear(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.nn.functional.linear:
                    self.calls += 1
                return func(*args, **(kwargs or {}))

        counts = []
        for flag in (False, True):
            model, mode = build("llama"), CountLinear()
            with (emulated() if flag else stock()), mode, torch.no_grad():
                model.generate(_ids(1, (1, 5)), **_kwargs(flag, max_new_tokens=6))
            counts.append(mode.calls)
        self.assertEqual(counts[0], counts[1], "F.linear calls seen by the mode: stock, flag")



@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class UserMaskFunction(unittest.TestCase):
    """HOLE E: a mask function the user registered for "sdpa" (`AttentionMaskInterface.register`, transformers'
    public way to change masking) is what stock's `create_causal_mask` calls at every decode step; the piecewise
    forward never calls it (the recording hands the forward a 4D sentinel, and `_attention_mask` gives an unpadded
    batch's replays no mask at all, as stock's own sdpa mask function would), so the replayed steps attend where the
    user's mask forbids. (`proof.names.watched` covers `create_causal_mask` itself, not the mask registry.) The flag's
    eager forward equals stock here, and a padded batch steps aside."""

    def test_a_registered_sdpa_mask_function_shapes_every_decode_step(self):
        from transformers import masking_utils

        real = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        had = "sdpa" in masking_utils.AttentionMaskInterface._global_mapping

        def without_the_first_position(*args, **kwargs):
            mask = real(*args, **{**kwargs, "allow_is_causal_skip": False})
            mask = mask.clone()
            mask[..., 0] = False  # no query attends to the first token (a user's sink removal)
            return mask

        def call(model, cache, _, flag):
            return model.generate(_ids(1, (2, 5)), past_key_values=cache, **_kwargs(flag, max_new_tokens=6))

        masking_utils.AttentionMaskInterface.register("sdpa", without_the_first_position)
        try:
            _compare(self, [call])
        finally:
            if had:
                masking_utils.AttentionMaskInterface.register("sdpa", real)
            else:
                masking_utils.AttentionMaskInterface._global_mapping.pop("sdpa", None)



class _AtCall(StoppingCriteria):
    """Calls `fn()` at its `at`-th call; never stops."""

    def __init__(self, at, fn):
        self.at, self.fn, self.calls = at, fn, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.fn()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class SlidingWindowSetMidCall(unittest.TestCase):
    """HOLE F: Mistral's (and Phi-3's) `config.sliding_window` set by a criterion mid-call (None -> 3): stock's next decode steps
    mask all but the last 3 positions (`create_causal_mask` reads the config per step). The rebound config field
    makes the piecewise recordings stale, but the step records again and replays with `_attention_mask`'s decision
    (no mask for an unpadded batch): no window. The sliding-window refusal (`proof.why_not_model`) runs once per
    call only. (Set between calls, the next call steps aside, equal to stock; the flag's eager forward equals stock.)"""

    def test_a_sliding_window_set_by_a_criterion_applies_to_the_later_steps(self):
        def call(model, cache, _, flag):
            window = _AtCall(3, lambda: setattr(model.config, "sliding_window", 3))
            return model.generate(_ids(1, (1, 6)), past_key_values=cache, **_kwargs(
                flag, max_new_tokens=10, stopping_criteria=StoppingCriteriaList([window])))

        for family in ("mistral", "phi3"):  # (Phi-3 picks its mask function by config.sliding_window per call too)
            with self.subTest(family):
                _compare(self, [call], family=family)


if __name__ == "__main__":
    unittest.main()
