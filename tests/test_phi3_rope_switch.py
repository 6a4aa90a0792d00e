"""Phi-3 past its rope switch: the flag's output equals stock's wherever the stop lands.

Phi-3's own `prepare_inputs_for_generation` drops the cache at the step whose input first passes
`original_max_position_embeddings` (its rope switches from short to long factors there), and that step's forward
fills a new cache (with the whole sequence from 5.20 on, the last token alone before, so that 5.17-5.19 drop it again
at every later step; 4.57 drops it only with a `rope_scaling` set). With the flag, a stop is read one step late and
the extra step is undone: had the extra step been a refill, no crop could give stock's cache back. These cases place
the stop before the switch, at the step before it (the extra step is the refill), on it and past it, greedy and
seeded sampling, on transformers' own loop with the package's stop check (the plain deferred path: every release
before 5.17, `TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP=0` from 5.17 on) and on the dynamic-cache loop (5.17+), and
compare everything the caller sees with unpatched transformers: sequences, scores, logits, the returned cache, a
cache the caller passed in, and the RNG after the call.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from transformers_async_stop.release_checks import cache_kwarg

from models import PAD, TRANSFORMERS_VERSION, assert_same, assert_same_cache, build, prompt, stock

MAX_NEW = 9
# the stop's position relative to the switch: the index of the EOS token in the sequence minus
# `original_max_position_embeddings` (0: stock stops at the step before the switch, so the flag's extra step is the
# forward that refills the cache; 1: stock's last step is that refill)
OFFSETS = (-1, 0, 1, 2)
MODES = ("greedy", "sample")
PATHS = ("plain", "dynamic")


def _model(limit: int):
    model = build("phi3", original_max_position_embeddings=limit)
    if TRANSFORMERS_VERSION < (5, 0):
        # 4.57 drops the cache at the switch only with a rope scaling set: the rotary embedding was built without it
        # (default rope), the preparation reads it at every step
        model.config.rope_scaling = {"rope_type": "default"}
    return model


def _run(model, ids, mask, mode, flag, eos, seed=7, cache=None):
    kwargs = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=MAX_NEW, eos_token_id=eos,
                  return_dict_in_generate=True, output_scores=True, output_logits=True,
                  do_sample=mode == "sample")
    if mode == "sample":
        kwargs.update(top_k=0, temperature=1.0)
    if flag:
        kwargs["async_stopping_criteria"] = True
    if cache is not None:
        kwargs[cache_kwarg.name()] = cache
    torch.manual_seed(seed)
    out = model.generate(ids, **kwargs)
    return out, torch.rand(4)


def _case(mode, offset):
    """(model, ids, mask, eos): an EOS id whose first generated occurrence is at index `limit + offset` of the
    sequence, for the first `limit` (from the prompt's length on) where one exists."""
    ids, mask = prompt(batch=1)
    length = ids.shape[1]
    for limit in range(length, length + 4):
        model = _model(limit)
        with stock():
            out, _ = _run(model, ids, mask, mode, False, None)
        tokens = out.sequences[0].tolist()
        at = limit + offset
        if length <= at < len(tokens) and tokens[at] not in tokens[length:at] and tokens[at] != PAD:
            return model, ids, mask, tokens[at]
    raise AssertionError(f"no EOS stops {mode} decoding at offset {offset} from the switch")


def _fresh_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # 4.57
        return DynamicCache()


def _assert_stock_outcome(test, ref, out, ref_draw, draw, report, offset):
    """The flag's sequences, scores, logits, returned cache and RNG after the call are stock's; a stop at or past the
    switch had its verdict read at once, with the switch named as the reason."""
    assert_same(test, ref.sequences, out.sequences, "sequences")
    assert_same(test, ref.scores, out.scores, "scores")
    if ref.logits is not None:
        assert_same(test, ref.logits, out.logits, "logits")
    assert_same_cache(test, cache_kwarg.of_output(ref), cache_kwarg.of_output(out))
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_draw, draw), "RNG after the call")
    if offset >= 0:
        test.assertEqual(report.path, "immediate", report.describe())
        test.assertIn("drops the cache", report.reason or "", report.describe())


class Phi3RopeSwitchTest(unittest.TestCase):
    def _env(self, path):
        if path == "dynamic" and TRANSFORMERS_VERSION < (5, 17):
            self.skipTest("the dynamic-cache loop runs on transformers 5.17+")
        value = "0" if path == "plain" else ""
        return mock.patch.dict(os.environ, {"TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP": value})

    @parameterized.expand([(m, o, p) for p in PATHS for m in MODES for o in OFFSETS])
    def test_stop_near_the_rope_switch_returns_stocks_output_cache_and_rng(self, mode, offset, path):
        with self._env(path):
            model, ids, mask, eos = _case(mode, offset)
            with stock():
                ref, ref_draw = _run(model, ids, mask, mode, False, eos)
            out, draw = _run(model, ids, mask, mode, True, eos)
            report = tas.last_path()
        self.assertIn(report.path, ("deferred", "immediate"), report.describe())
        self.assertEqual(report.loop == "dynamic", path == "dynamic", report.describe())
        # the case is the one asked for: stock stops with the EOS at `original_max_position_embeddings + offset`
        self.assertEqual(ref.sequences.shape[1], model.config.original_max_position_embeddings + offset + 1)
        _assert_stock_outcome(self, ref, out, ref_draw, draw, report, offset)

    @parameterized.expand([(m, o, p) for p in PATHS for m in MODES for o in OFFSETS])
    def test_stop_near_the_rope_switch_leaves_a_passed_cache_as_stock(self, mode, offset, path):
        # the caller's own cache object is the one dropped at the switch: it keeps what it held then, as in stock
        with self._env(path):
            model, ids, mask, eos = _case(mode, offset)
            ref_cache, cache = _fresh_cache(model), _fresh_cache(model)
            with stock():
                ref, ref_draw = _run(model, ids, mask, mode, False, eos, cache=ref_cache)
            out, draw = _run(model, ids, mask, mode, True, eos, cache=cache)
        assert_same(self, ref, out)
        assert_same_cache(self, ref_cache, cache, "passed cache")
        self.assertEqual(cache_kwarg.of_output(ref) is ref_cache, cache_kwarg.of_output(out) is cache)
        self.assertTrue(torch.equal(ref_draw, draw), "RNG after the call")


class AtLength(StoppingCriteria):
    """Every row is done once the sequence is `length` long (a device verdict, read one step late with the flag)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def _beam_run(model, ids, mask, sample, flag, offset, seed=7, cache=None):
    """Beam search that stock stops at the sequence length `limit + offset`: the flag's extra step's input is
    `limit + offset + 1` long (offset 0: that extra step is the refill; 1: stock's last step is)."""
    stop = StoppingCriteriaList([AtLength(model.config.original_max_position_embeddings + offset + 1)])
    kwargs = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=MAX_NEW, eos_token_id=None, num_beams=2,
                  num_return_sequences=2, early_stopping=True, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, do_sample=sample, stopping_criteria=stop)
    if flag:
        kwargs["async_stopping_criteria"] = True
    if cache is not None:
        kwargs[cache_kwarg.name()] = cache
    torch.manual_seed(seed)
    out = model.generate(ids, **kwargs)
    return out, torch.rand(4)


class Phi3RopeSwitchBeamTest(unittest.TestCase):
    @parameterized.expand([(s, o) for s in (False, True) for o in OFFSETS])
    def test_beam_search_stopping_near_the_rope_switch_returns_stocks_output_cache_and_rng(self, sample, offset):
        ids, mask = prompt(batch=1)
        model = _model(ids.shape[1] + 2)
        with stock():
            ref, ref_draw = _beam_run(model, ids, mask, sample, False, offset)
        out, draw = _beam_run(model, ids, mask, sample, True, offset)
        report = tas.last_path()
        self.assertIn(report.path, ("deferred", "immediate"), report.describe())
        self.assertEqual(len(ref.scores), model.config.original_max_position_embeddings + offset + 1 - ids.shape[1])
        _assert_stock_outcome(self, ref, out, ref_draw, draw, report, offset)

    @parameterized.expand([(s, o) for s in (False, True) for o in OFFSETS])
    def test_beam_search_stopping_near_the_rope_switch_leaves_a_passed_cache_as_stock(self, sample, offset):
        ids, mask = prompt(batch=1)
        model = _model(ids.shape[1] + 2)
        ref_cache, cache = _fresh_cache(model), _fresh_cache(model)
        with stock():
            ref, ref_draw = _beam_run(model, ids, mask, sample, False, offset, cache=ref_cache)
        out, draw = _beam_run(model, ids, mask, sample, True, offset, cache=cache)
        assert_same(self, ref, out)
        assert_same_cache(self, ref_cache, cache, "passed cache")
        self.assertTrue(torch.equal(ref_draw, draw), "RNG after the call")


class Phi3RopeSwitchAssistedTest(unittest.TestCase):
    """A Phi-3 assistant's draft loop (the package's deferred `_sample` inside a deferred assisted call) crosses its own
    switch too: a draft stopped one token late by its confidence criterion must not have refilled the assistant's
    cache in the undone step (5.0: later rounds drafted from the refilled cache, and sampling drew differently)."""

    @parameterized.expand([(m,) for m in MODES])
    def test_assisted_decoding_across_the_rope_switch_equals_stock(self, mode):
        ids, mask = prompt(batch=1)
        length = ids.shape[1]
        for limit in (length + 1, length + 2):
            model, assistant = _model(limit), build("phi3", seed=1, original_max_position_embeddings=limit)
            assistant.config.rope_scaling = model.config.rope_scaling
            kwargs = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=MAX_NEW, return_dict_in_generate=True,
                          output_scores=True, assistant_model=assistant, do_sample=mode == "sample")
            with stock():
                torch.manual_seed(5)
                tokens = model.generate(ids, eos_token_id=None, **kwargs).sequences[0].tolist()
            for at in range(length, len(tokens)):
                if tokens[at] in tokens[length:at]:
                    continue
                with self.subTest(limit=limit, at=at):
                    with stock():
                        torch.manual_seed(5)
                        ref = model.generate(ids, eos_token_id=tokens[at], **kwargs)
                        ref_draw = torch.rand(4)
                    torch.manual_seed(5)
                    out = model.generate(ids, eos_token_id=tokens[at], async_stopping_criteria=True, **kwargs)
                    draw = torch.rand(4)
                    assert_same(self, ref, out)
                    self.assertTrue(torch.equal(ref_draw, draw), "RNG after the call")


if __name__ == "__main__":
    unittest.main()
