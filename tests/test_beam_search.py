"""Beam search with the flag: the "are all beams done" verdict is read one step late and the extra step undone.

Compared with stock transformers (patches removed): sequences, sequences_scores, scores, logits, beam_indices,
hidden states, attentions, the returned cache and the RNG state after the call. The forward count proves the
deferred path ran: one forward more than stock whenever the search ends before `max_length`, none at `max_length`.
Most cases end early (many EOS ids); `early_stopping="never"` with a positive length penalty runs to `max_length`.
"""

from __future__ import annotations

import contextlib
import unittest

import pytest
import warnings

import torch
from parameterized import parameterized
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from models import (
    PROMPT_LEN,
    assert_same,
    build,
    generate_and_draw,
    prompt,
    stock,
)
from transformers_async_stop import StockPathWarning
from transformers_async_stop.loops import beam

EARLY_EOS = list(range(20, 40))  # many ids: beams finish within a few steps
MAX_NEW = 12
FULL = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)


class StopAtLength(StoppingCriteria):
    """Every candidate hits it at once: the search ends through "no valid continuation"."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


CASES = [
    ("beams3", dict(num_beams=3)),
    ("beams3_early_true", dict(num_beams=3, early_stopping=True)),
    ("beams3_never_lp2", dict(num_beams=3, early_stopping="never", length_penalty=2.0)),
    ("beams2_negative_lp", dict(num_beams=2, length_penalty=-1.0)),
    ("beams3_return2", dict(num_beams=3, num_return_sequences=2, early_stopping=True)),
    ("beam_sampling", dict(num_beams=2, do_sample=True, early_stopping=True)),
    ("beam_sampling_return2", dict(num_beams=3, do_sample=True, num_return_sequences=2, top_k=10)),
    ("static_cache", dict(num_beams=2, early_stopping=True, cache_implementation="static", disable_compile=True)),
    ("no_valid_continuation", dict(num_beams=3, stopping_criteria=StoppingCriteriaList([StopAtLength(PROMPT_LEN + 4)]),
                                   eos_token_id=None)),
]


def _run(model, ids, mask, flag, eos, **kw):
    kw.setdefault("eos_token_id", eos)
    return generate_and_draw(model, ids, mask, flag, max_new_tokens=MAX_NEW, **kw)


class BeamSearchMatchesStock(unittest.TestCase):
    @parameterized.expand([(n, f, kw) for f in ("llama", "gpt2") for n, kw in CASES])
    def test_outputs_cache_and_rng_match_stock(self, name, family, kw):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        with stock():
            ref, ref_draw, ref_forwards = _run(model, ids, mask, None, EARLY_EOS, **kw, **FULL)
        with warnings.catch_warnings():
            warnings.simplefilter("error", StockPathWarning)  # the deferred path, not the stock fallback
            out, draw, forwards = _run(model, ids, mask, True, EARLY_EOS, **kw, **FULL)
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_draw, draw), "the extra step's draws were not given back")
        # one extra forward, undone, when the verdict stopped the search; none when max_length (a host count) did
        self.assertEqual(forwards, ref_forwards + (1 if ref_forwards < MAX_NEW else 0))

    def test_attentions_match_stock(self):
        model = build("llama", attn="eager")
        ids, mask = prompt(batch=2, left_pad=True)
        kw = dict(num_beams=2, early_stopping=True, output_attentions=True, **FULL)
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, None, EARLY_EOS, **kw)
        out, _, forwards = _run(model, ids, mask, True, EARLY_EOS, **kw)
        assert_same(self, ref, out)
        self.assertEqual(forwards, ref_forwards + 1)

    @pytest.mark.core

    def test_max_length_stop_runs_no_extra_step(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        kw = dict(num_beams=3, eos_token_id=None, **FULL)
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, None, None, **kw)
        out, _, forwards = _run(model, ids, mask, True, None, **kw)
        assert_same(self, ref, out)
        self.assertEqual(ref_forwards, MAX_NEW)
        self.assertEqual(forwards, MAX_NEW)

    @pytest.mark.core

    def test_user_cache_is_returned_as_stock_leaves_it(self):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)
        caches = []
        for flag in (None, True):
            cache = DynamicCache()
            with stock() if flag is None else contextlib.nullcontext():
                out, _, forwards = _run(model, ids, mask, flag, EARLY_EOS, num_beams=2, early_stopping=True,
                                        past_key_values=cache)
            caches.append((out, cache, forwards))
        (ref, ref_cache, ref_forwards), (out, cache, forwards) = caches
        self.assertTrue(torch.equal(ref, out))
        assert_same(self, ref_cache, cache)
        self.assertEqual(forwards, ref_forwards + 1)

    def test_encoder_decoder(self):
        from test_encoder_decoder import build as build_seq2seq

        model = build_seq2seq("t5")
        ids, mask = prompt(batch=2)
        kw = dict(num_beams=3, early_stopping=True, max_new_tokens=MAX_NEW, **FULL)
        results = []
        for flag in (None, True):
            with stock() if flag is None else contextlib.nullcontext():
                results.append(generate_and_draw(model, ids, mask, flag, eos_token_id=list(range(3, 30)), **kw))
        (ref, ref_draw, ref_forwards), (out, draw, forwards) = results
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_draw, draw))
        self.assertLess(ref_forwards, MAX_NEW)
        self.assertEqual(forwards, ref_forwards + 1)


class BeamSearchFallsBackWithOneWarning(unittest.TestCase):
    def test_returned_sliding_window_cache(self):
        model = build("mistral", sliding_window=4)
        ids, mask = prompt(batch=2)
        kw = dict(num_beams=2, early_stopping=True, **FULL)
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, None, EARLY_EOS, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, _, forwards = _run(model, ids, mask, True, EARLY_EOS, **kw)
        ours = [w for w in caught if issubclass(w.category, StockPathWarning)]
        self.assertEqual(len(ours), 1, [str(w.message) for w in ours])
        self.assertIn("cache", str(ours[0].message))
        assert_same(self, ref, out)
        self.assertEqual(forwards, ref_forwards)

    def test_synced_gpus_is_named(self):
        model = build("llama")
        config = GenerationConfig(num_beams=2, async_stopping_criteria=True)
        reason = beam._why_stock(model, config, True, {})
        self.assertIn("synced_gpus", reason)


class FinishedBeamsSurviveTheExtraStep(unittest.TestCase):
    """`_update_finished_beams` in the extra step (known on the host by then) returns the beams it was given."""

    def _update(self, extra):
        from types import SimpleNamespace

        from transformers.generation.utils import GenerationMixin

        from transformers_async_stop.state.call_state import CALL, CallState

        model = build("llama")
        batch, beams, length = 1, 2, 8
        old = (torch.zeros(batch, beams, length, dtype=torch.long), torch.full((batch, beams), -1.0),
               torch.full((batch, beams, length - 2), -1, dtype=torch.int32))
        topk_sequences = torch.ones(batch, 2 * beams, length, dtype=torch.long)
        topk_log_probs = torch.zeros(batch, 2 * beams)  # better than every old score
        topk_beam_indices = torch.zeros(batch, 2 * beams, length - 2, dtype=torch.int32)
        state = CallState(user_cache=False, slice_inputs=True)
        state.ctl = SimpleNamespace(extra=extra)
        token = CALL.set(state)
        try:
            return old, GenerationMixin._update_finished_beams(
                model, sequences=old[0], topk_running_sequences=topk_sequences, beam_scores=old[1],
                topk_log_probs=topk_log_probs, beam_indices=old[2], topk_running_beam_indices=topk_beam_indices,
                is_early_stop_heuristic_unsatisfied=torch.ones(batch, 1, dtype=torch.bool),
                is_sent_finished=torch.zeros(batch, beams, dtype=torch.bool),
                next_token_hits_stopping_criteria=torch.ones(batch, 2 * beams, dtype=torch.bool),
                top_num_beam_mask=torch.tensor([True] * beams + [False] * beams), num_beams=beams, cur_len=4,
                decoder_prompt_len=2, length_penalty=1.0, early_stopping=False,
            )
        finally:
            CALL.reset(token)

    def test_previous_beams_kept_in_the_extra_step(self):
        old, new = self._update(True)
        for before, after in zip(old, new[:3]):
            self.assertTrue(torch.equal(before, after))

    def test_new_beams_taken_in_a_real_step(self):
        old, new = self._update(False)
        self.assertTrue(torch.equal(new[0], torch.ones_like(old[0])))  # the finished candidates replaced the old


if __name__ == "__main__":
    unittest.main()
