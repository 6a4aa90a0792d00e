"""Assisted decoding with a static cache (transformers 5.24+, issue 37): no round's forward writes past the cache.

5.24.0's stock takes a static cache in assisted decoding and never compares a round's reach with the cache's length:
a round that outgrows the cache indexes past the end of its keys and values (`IndexError` on the CPU, a device-side
assert on CUDA, after which the CUDA context is unusable; with the flag the process aborted). With the flag each
round's reach is counted on the host (`loops/assisted/room.py`): where it is past the end, `StaticCacheOverflow` (a
`ValueError` and an `IndexError`) is raised before the forward, at the round where stock's forward fails; where the
cache has room, the output is stock's. Compared against unpatched stock (`models.stock()`).

The CUDA class runs each case in its own process (`scripts/assisted_static_524.py`): a device-side assert or an
abort ends only that child, and its exit status says which.

Issue 43 (`StaticCacheOverflowPaths`): every way a flag call's forward can reach past a static cache, each raising
`StaticCacheOverflow` where stock indexes out of bounds and nowhere else: prompt lookup past
`cache_implementation="static"` (its candidates are not capped by the remaining length), draft and lookup, greedy and
sampling; a cache whose every layer has a sliding window longer than the cache (the layers slide, their crops leave
their device write counter behind, and a later round that fits writes at it, below zero); the room's counters
against real cache layers under random writes and crops; an assistant asking for its own static cache (stock's
`ValueError`); the rows of the script's CUDA matrix (`MATRIX`), each judged on the CPU as the CUDA run judges it.
"""

from __future__ import annotations

import os
import sys
import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StaticCache

from models import TRANSFORMERS_VERSION, build, stock
from transformers_async_stop.loops.assisted.room import Room, StaticCacheOverflow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import assisted_static_524  # noqa: E402

CUDA = torch.cuda.is_available()
TAKES_STATIC = TRANSFORMERS_VERSION >= (5, 24)


class Calls(LogitsProcessor):
    """Counts its calls (the draft's and the verify's): the rounds that ran before the error."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def _models(device="cpu"):
    target = build("llama", device=device)
    draft = build("llama", seed=3, device=device)  # an unrelated draft: rounds of every length
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return target, draft


def _prompt(device="cpu"):
    return torch.randint(3, 48, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)


def _call(flag, device="cpu", room=None, max_new_tokens=16, turns=1):
    """(outcome, cache counter, processor calls): outcome is ("returned", ids) or ("raised", exception)."""
    target, draft = _models(device)
    calls = Calls()
    kwargs = dict(assistant_model=draft, do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([calls]))
    cache = None
    if room is None:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["past_key_values"] = cache = StaticCache(config=target.config, max_cache_len=room)
    if flag:
        kwargs["async_stopping_criteria"] = True
    ids = _prompt(device)
    try:
        for _ in range(turns):  # a chat: each turn continues the sequence on the same cache
            ids = target.generate(ids, max_new_tokens=max_new_tokens, **kwargs)
        outcome = ("returned", ids.cpu())
    except Exception as exc:  # noqa: BLE001 - what the call raised is compared
        outcome = ("raised", exc)
    counter = None
    if cache is not None:  # (a cache no forward wrote is not initialized: nothing in it)
        counter = int(cache.layers[0].cumulative_length) if cache.layers[0].is_initialized else 0
    return outcome, counter, calls.calls


def _stock_and_flag(**kw):
    with stock():
        ref = _call(False, **kw)
    return ref, _call(True, **kw)


@unittest.skipUnless(TAKES_STATIC, "stock refuses a static cache in assisted decoding before 5.24")
class StaticCacheRoomInAssistedDecoding(unittest.TestCase):
    device = "cpu"

    # 10: the first round (the prompt and its 3 candidates) does not fit; 16, 22: a later round reaches past the end
    @parameterized.expand([("first_round", 10), ("mid_call", 16), ("last_position_missing", 22)])
    def test_a_round_past_a_user_static_cache_raises_before_its_forward(self, _, room):
        (ref, ref_counter, ref_calls), (got, counter, calls) = _stock_and_flag(device=self.device, room=room)
        self.assertEqual(ref[0], "raised", "stock returned: the case no longer outgrows the cache")
        if self.device == "cpu":
            self.assertIsInstance(ref[1], IndexError)  # index_copy_ out of bounds
        self.assertEqual(got[0], "raised")
        self.assertIsInstance(got[1], StaticCacheOverflow)
        self.assertIsInstance(got[1], ValueError)
        self.assertIsInstance(got[1], IndexError)  # what stock's CPU forward raises there
        self.assertIn(f"max_cache_len={room}", str(got[1]))
        # the same rounds ran (the processors saw the same calls), and the flag's forward was never launched: its
        # cache's counter stays within the cache (stock's moved past the end before its write failed)
        self.assertEqual(calls, ref_calls)
        self.assertLessEqual(counter, room)
        self.assertGreater(ref_counter, room)

    @parameterized.expand([("exact", 23), ("roomy", 40), ("cache_implementation", None)])
    def test_a_static_cache_with_room_returns_stocks_output(self, _, room):
        (ref, ref_counter, ref_calls), (got, counter, calls) = _stock_and_flag(device=self.device, room=room)
        self.assertEqual(ref[0], "returned", f"stock raised: {ref[1]!r}")
        self.assertEqual(got[0], "returned", f"the flag raised: {got[1]!r}")
        self.assertTrue(torch.equal(ref[1], got[1]), (ref[1].tolist(), got[1].tolist()))
        self.assertEqual((counter, calls), (ref_counter, ref_calls))

    @parameterized.expand([("outgrown", 30), ("room", 40)])
    def test_a_second_turn_is_counted_from_the_caches_own_counter(self, name, room):
        # turn 1 leaves 13 positions; turn 2 feeds its whole sequence after them (5.24's first round re-feeds what the
        # cache holds) and reaches position 32 by its end: 30 positions hold turn 1 but not turn 2
        (ref, ref_counter, ref_calls), (got, counter, calls) = _stock_and_flag(device=self.device, room=room,
                                                                               max_new_tokens=6, turns=2)
        self.assertEqual(calls, ref_calls)
        if name == "room":
            self.assertEqual(ref[0], "returned", f"stock raised: {ref[1]!r}")
            self.assertTrue(torch.equal(ref[1], got[1]))
            self.assertEqual(counter, ref_counter)
            return
        self.assertEqual(ref[0], "raised", "stock returned: the case no longer outgrows the cache")
        self.assertIsInstance(got[1], StaticCacheOverflow)
        self.assertLessEqual(counter, room)


def _row(spec, flag):
    """A call as the script's CUDA matrix makes it (`assisted_static_524.matrix_call`), on the CPU: ("returned",
    ids) or ("raised", exception)."""
    return assisted_static_524.matrix_call(spec, flag, "cpu")


def _row_stock_and_flag(spec):
    with stock():
        ref = _row(spec, False)
    return ref, _row(spec, True)


@unittest.skipUnless(TAKES_STATIC, "stock refuses a static cache in assisted decoding before 5.24")
class StaticCacheOverflowPaths(unittest.TestCase):
    """Issue 43: the paths by which a flag call's forward can reach past a static cache (CPU only: on CUDA stock's
    out-of-bounds write is a device-side assert, run in child processes by the CUDA class)."""

    def assert_raises_where_stock_indexes_out_of_bounds(self, spec):
        ref, got = _row_stock_and_flag(spec)
        self.assertEqual(ref[0], "raised", "stock returned: the case no longer reaches past the cache")
        self.assertIsInstance(ref[1], IndexError)
        self.assertNotIsInstance(ref[1], StaticCacheOverflow)
        self.assertEqual(got[0], "raised", "the flag returned where stock's forward indexes out of bounds")
        self.assertIsInstance(got[1], StaticCacheOverflow, repr(got[1]))
        return ref, got

    def assert_returns_stocks_output(self, spec):
        ref, got = _row_stock_and_flag(spec)
        self.assertEqual(ref[0], "returned", f"stock raised: {ref[1]!r}")
        self.assertEqual(got[0], "returned", f"the flag raised where stock returns: {got[1]!r}")
        self.assertEqual(got[1], ref[1])

    # prompt lookup with `cache_implementation="static"` (`max_length - 1` positions): its candidates are not capped by
    # the remaining length, so a round reaches past the cache: the first (the prompt's own n-grams propose 10 tokens
    # after a 16-token prompt: 26 > 23) or the last
    @parameterized.expand([
        ("first_round_greedy", dict(lookup=10, max_new_tokens=8)),
        ("first_round_sampling", dict(lookup=10, max_new_tokens=8, sample=True)),
        ("last_round_greedy", dict(lookup=10)),
        ("last_round_sampling", dict(lookup=10, sample=True)),
    ])
    def test_prompt_lookup_past_a_static_cache_implementation_raises_before_its_forward(self, _, spec):
        self.assert_raises_where_stock_indexes_out_of_bounds(dict(mode="lookup", **spec))

    @parameterized.expand([
        ("lookup_greedy", dict(mode="lookup", room=18)),
        ("lookup_sampling", dict(mode="lookup", room=18, sample=True)),
        ("draft_sampling", dict(mode="draft", room=16, sample=True)),
        ("draft_sampling_first_round", dict(mode="draft", room=10, sample=True)),
    ])
    def test_a_user_static_cache_too_small_raises_before_its_forward(self, _, spec):
        self.assert_raises_where_stock_indexes_out_of_bounds(spec)

    # every layer of the target has a 40-token sliding window (Mistral's default kind), and the cache is shorter:
    # a round past `max_cache_len` slides the layers without an error, but moves only their host counter; the crops
    # move both back, so the device counter (where an in-bounds write goes) falls behind, below zero, and the next
    # round that fits in the layers writes there (stock: `index -6 is out of bounds`)
    @parameterized.expand([
        ("greedy", dict(room=18)),
        ("sampling", dict(room=18, sample=True)),
        ("ten_candidates_greedy", dict(room=20, lookup=10)),
        ("ten_candidates_sampling", dict(room=22, lookup=10, sample=True)),
    ])
    def test_a_sliding_window_cache_whose_write_counter_fell_behind_raises_before_its_forward(self, _, spec):
        ref, got = self.assert_raises_where_stock_indexes_out_of_bounds(dict(mode="lookup", family="mistral", **spec))
        self.assertIn("index -", str(ref[1]))
        self.assertIn("sliding-window layers", str(got[1]))

    # the same caches where the layers slid but no later write lands outside them: stock returns (the layers dropped
    # what slid out), and so does the flag, with stock's ids
    @parameterized.expand([("room_14", 14), ("room_16", 16), ("room_20", 20), ("room_22", 22)])
    def test_a_sliding_window_cache_that_slid_returns_stocks_output(self, _, room):
        self.assert_returns_stocks_output(dict(mode="lookup", family="mistral", room=room))

    @parameterized.expand([("greedy", False), ("sampling", True)])
    def test_a_static_cache_implementation_that_fits_returns_stocks_output(self, _, sample):
        self.assert_returns_stocks_output(dict(mode="lookup", max_new_tokens=8, sample=sample))
        self.assert_returns_stocks_output(dict(mode="draft", sample=sample))  # a draft's candidates always fit

    def test_after_the_error_the_next_call_returns_stocks_output(self):
        got = _row(dict(mode="lookup", family="mistral", room=18), True)
        self.assertIsInstance(got[1], StaticCacheOverflow)
        for spec in (dict(mode="lookup", family="mistral", room=40), dict(mode="draft", room=40, sample=True)):
            self.assert_returns_stocks_output(spec)

    # the assistant is called with `cache_implementation` unset, which its own generation config fills: its first
    # round builds a static cache sized for the draft, and the second finds both (stock's `ValueError`); so too with
    # a draft stopped early by its confidence, the deferred draft loop's lagged stop (its extra step, where it takes
    # one, would write one position short of that cache's end)
    @parameterized.expand([("one_round", 2, 0.0), ("two_rounds", 16, 0.0), ("confidence_stop", 16, 0.99)])
    def test_an_assistant_asking_for_its_own_static_cache_gets_stocks_outcome(self, name, new_tokens, threshold):
        def call(flag):
            target, draft = _models()
            draft.generation_config.cache_implementation = "static"
            draft.generation_config.assistant_confidence_threshold = threshold
            flag_kwarg = {"async_stopping_criteria": True} if flag else {}
            try:
                return "returned", target.generate(_prompt(), assistant_model=draft, max_new_tokens=new_tokens,
                                                   pad_token_id=0, **flag_kwarg).tolist()
            except Exception as exc:  # noqa: BLE001
                return "raised", (type(exc), str(exc))

        with stock():
            ref = call(False)
        self.assertEqual(ref[0], "returned" if name == "one_round" else "raised", ref)
        self.assertEqual(call(True), ref)

    @parameterized.expand([("llama", "full"), ("mistral", "sliding"), ("qwen2", "hybrid")])
    def test_the_room_raises_exactly_where_a_static_layer_indexes_out_of_bounds(self, family, _):
        # random rounds (a prefill, then up to 19 writes of 1-11 tokens, each followed by a crop of up to all but one
        # of them) on a real StaticCache, against the room's prediction: it raises before a write exactly where the
        # layers' own update raises, and counts what they hold
        import random

        overrides = {"mistral": dict(sliding_window=40), "llama": {}}.get(family)
        if family == "qwen2":
            target = build("qwen2", config_kwargs=dict(use_sliding_window=True, sliding_window=40, max_window_layers=1))
        else:
            target = build(family, **overrides)
        config = target.config
        heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        rng = random.Random(family)
        raised = returned = 0
        for trial in range(150):
            size = rng.randint(4, 40)  # within the sliding window (a longer cache is not croppable)
            cache = StaticCache(config=config, max_cache_len=size)
            room = Room(cache)
            for step in range(rng.randint(1, 20)):
                width = rng.randint(1, 30) if step == 0 else rng.randint(1, 11)
                fed = {"input_ids": torch.zeros(1, width, dtype=torch.long)}
                try:
                    room.check(fed)
                    predicted = None
                except StaticCacheOverflow as exc:
                    predicted = exc
                actual = None
                try:
                    for index in range(len(cache.layers)):
                        keys = torch.randn(1, heads, width, dim)
                        cache.update(keys, keys, index)
                except IndexError as exc:
                    actual = exc
                self.assertEqual(predicted is None, actual is None,
                                 f"trial {trial} step {step}: width {width}, max_cache_len {size}: room "
                                 f"{predicted!r}, the layers {actual!r}")
                if actual is not None:
                    raised += 1
                    break
                removed = rng.randint(0, width - 1)
                cache.crop(-removed)
                room.advance(fed, removed)
            else:
                returned += 1
        self.assertGreaterEqual(min(raised, returned), 3, (raised, returned))  # both outcomes are exercised

    def test_the_cuda_matrix_rows_hold_on_the_cpu(self):
        # every row the CUDA check runs, in this process: judged as the CUDA run judges it (stock's IndexError here
        # stands for its device-side assert), the follow-up call after it included
        for row, (spec, expect) in assisted_static_524.MATRIX.items():
            with self.subTest(row=row):
                ref, got = _row_stock_and_flag(spec)
                then = assisted_static_524.then_spec(spec)
                flag_then = assisted_static_524._outcome(_row(then, True))
                with stock():
                    stock_then = assisted_static_524._outcome(_row(then, False))
                got = dict(assisted_static_524._outcome(got), rc=0, then={
                    "flag": flag_then, "stock": stock_then, "equal": flag_then.get("returned") is not None
                    and flag_then.get("returned") == stock_then.get("returned")})
                ref = dict(assisted_static_524._outcome(ref), rc=0)
                self.assertEqual(assisted_static_524.judge(expect, ref, got, "cpu"), [], (ref, got))


@unittest.skipUnless(not TAKES_STATIC and TRANSFORMERS_VERSION >= (5, 0), "5.x before 5.24")
class StaticCacheRefusedBefore524(unittest.TestCase):
    def test_the_flag_raises_stocks_error(self):
        (ref, _, _), (got, _, _) = _stock_and_flag(room=40)
        self.assertEqual(ref[0], "raised")
        self.assertEqual((type(got[1]), str(got[1])), (type(ref[1]), str(ref[1])))


@unittest.skipUnless(CUDA and TAKES_STATIC, "CUDA and transformers 5.24+ only")
class StaticCacheRoomInAssistedDecodingCuda(StaticCacheRoomInAssistedDecoding):
    """In-process on CUDA only where no device-side assert can happen (a cache with room); the cases that outgrow
    the cache run in child processes: stock's assert would poison this process's CUDA context."""

    device = "cuda"

    @parameterized.expand([("first_round", 10), ("mid_call", 16), ("last_position_missing", 22)])
    def test_a_round_past_a_user_static_cache_raises_before_its_forward(self, _, room):
        self.skipTest("stock's device-side assert would end this process's CUDA context: see the child processes")

    @parameterized.expand([("outgrown", 30)])
    def test_a_second_turn_is_counted_from_the_caches_own_counter(self, name, room):
        self.skipTest("stock's device-side assert would end this process's CUDA context: see the child processes")

    def test_a_cache_too_small_raises_the_clear_error_and_cuda_stays_usable(self):
        report = assisted_static_524.run_case("flag_small", "cuda")
        self.assertEqual(report["rc"], 0, report)  # -6: SIGABRT
        self.assertTrue(report.get("is_overflow_error"), report)
        self.assertIs(report.get("cuda_usable_after"), True, report)

    def test_the_issues_scenario_never_takes_the_process_down(self):
        # `cache_implementation="static"`, an 8-token prompt, 16 new tokens, 3 draft tokens: on CUDA 5.24 verifies
        # through the compiled forward (issue 37: stock hit a device-side assert, the flag's process aborted)
        ref = assisted_static_524.run_case("stock_static", "cuda")
        got = assisted_static_524.run_case("flag_static", "cuda")
        self.assertGreaterEqual(got["rc"], 0, got)  # not ended by a signal
        self.assertEqual(got["rc"], 0, got)
        if "returned" in ref:
            self.assertEqual(got.get("returned"), ref["returned"], (ref, got))
        else:
            self.assertIn("raised", got, (ref, got))
        self.assertIs(got.get("cuda_usable_after"), True, got)

    def test_the_overflow_matrix(self):
        # issue 43: every row by stock and by the flag in their own processes (`--matrix` prints the table): where
        # stock's kernels device-assert, the flag raises StaticCacheOverflow, and its process runs the next generate
        results = assisted_static_524.matrix_results(list(assisted_static_524.MATRIX), "cuda")
        failed = {row: (problems, ref, got) for row, (_, ref, got, problems) in results.items() if problems}
        self.assertEqual(failed, {})


if __name__ == "__main__":
    unittest.main()
