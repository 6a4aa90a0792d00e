"""Assisted decoding with a static cache (transformers 5.24+, issue 37): no round's forward writes past the cache.

5.24.0's stock takes a static cache in assisted decoding and never compares a round's reach with the cache's length:
a round that outgrows the cache indexes past the end of its keys and values (`IndexError` on the CPU, a device-side
assert on CUDA, after which the CUDA context is unusable; with the flag the process aborted). With the flag each
round's reach is counted on the host (`loops/assisted/room.py`): where it is past the end, `StaticCacheOverflow` (a
`ValueError` and an `IndexError`) is raised before the forward, at the round where stock's forward fails; where the
cache has room, the output is stock's. Compared against unpatched stock (`models.stock()`).

The CUDA class runs each case in its own process (`scripts/assisted_static_524.py`): a device-side assert or an
abort ends only that child, and its exit status says which.
"""

from __future__ import annotations

import os
import sys
import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StaticCache

from models import TRANSFORMERS_VERSION, build, stock
from transformers_async_stop.loops.assisted.room import StaticCacheOverflow

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


if __name__ == "__main__":
    unittest.main()
