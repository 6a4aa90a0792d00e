"""Streamers see exactly what stock transformers hands them, with the flag on (one-step-late path, forced on CPU).

The deferred loop makes one token more than stock when a stop is seen one step late, then undoes it. A streamer
must never see that token: on 5.17+ our stop check hands tokens over one step late from its own copies, on
5.0-5.16 `LaggedStreamer` holds each token back one step. Either way every `put()` (the prompt first, then one
tensor per kept step) and the single `end()` must equal stock's.
"""

from __future__ import annotations

import contextlib
import io
import threading
import unittest

import pytest

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

from models import PAD, PROMPT_LEN, CountForwards, build, eos_ids_finishing_at, prompt, stock
from test_config import tiny_tokenizer

FAMILIES = ("llama", "gpt2", "qwen2", "mistral")
MAX_NEW = 12


class RecordingStreamer(BaseStreamer):
    """Records a copy of every `put()` value and counts `end()` calls."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0
        self.put_after_end = False

    def put(self, value):
        if self.ends:
            self.put_after_end = True
        self.puts.append(value.detach().clone())

    def end(self):
        self.ends += 1


class StopOnToken(StoppingCriteria):
    """A per-row bool criterion: with no EOS criterion, stock pads nothing, so the undone token is a real token."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _scenario(name, model, ids, mask):
    """generate() kwargs and whether the run must stop before `max_new_tokens`."""
    if name == "eos":
        return dict(eos_token_id=eos_ids_finishing_at(model, ids, mask, [3] * ids.shape[0], MAX_NEW)), True
    if name == "user_criterion":
        token = eos_ids_finishing_at(model, ids, mask, [4] * ids.shape[0], MAX_NEW)[0]
        return dict(eos_token_id=None, stopping_criteria=StoppingCriteriaList([StopOnToken(token)])), True
    if name == "eos_sampling":
        sampling = dict(do_sample=True, top_k=3)
        return dict(eos_token_id=_sampled_eos(model, ids, mask, 2, **sampling), **sampling), True
    if name == "no_early_stop":
        return dict(eos_token_id=eos_ids_finishing_at(model, ids, mask, [None] * ids.shape[0], MAX_NEW)), False
    raise ValueError(name)


def _sampled_eos(model, ids, mask, step, **sampling):
    """An EOS id that row 0 of a seeded sampling run (seed as in `_generate`) first makes at or after `step`."""
    with stock():
        out, _ = _generate(model, ids, mask, None, False, eos_token_id=None, **sampling)
    tokens = out[0, PROMPT_LEN:].tolist()
    return next(t for k, t in enumerate(tokens) if k >= step and t not in tokens[:k] and t != PAD)


SCENARIOS = ("eos", "user_criterion", "eos_sampling", "no_early_stop")


def _generate(model, ids, mask, streamer, flag, seed=11, max_new_tokens=MAX_NEW, **kwargs):
    counter = CountForwards(model)
    try:
        torch.manual_seed(seed)
        if flag:
            kwargs["async_stopping_criteria"] = True
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=max_new_tokens,
                             streamer=streamer, **kwargs)
    finally:
        counter.close()
    return out, counter.count


class StreamerSeesStockTokens(unittest.TestCase):
    def _check_early_stop(self, ref, ref_forwards, on_forwards, early):
        stopped_early = ref.shape[1] < PROMPT_LEN + MAX_NEW
        if early:
            self.assertTrue(stopped_early, "the scenario was meant to stop before max_new_tokens")
        # the deferred loop ran and made (then undid) one extra token exactly when a stop was seen one step late
        self.assertEqual(on_forwards, ref_forwards + (1 if stopped_early else 0))

    @parameterized.expand([(f, s) for f in FAMILIES for s in SCENARIOS])
    def test_base_streamer_put_calls_equal_stock_and_end_called_once(self, family, scenario):
        model = build(family)
        ids, mask = prompt(batch=1)
        kw, early = _scenario(scenario, model, ids, mask)
        with stock():
            ref_streamer = RecordingStreamer()
            ref, ref_forwards = _generate(model, ids, mask, ref_streamer, False, **kw)
        streamer = RecordingStreamer()
        on, on_forwards = _generate(model, ids, mask, streamer, True, **kw)

        self.assertListEqual(ref.tolist(), on.tolist())
        self._check_early_stop(ref, ref_forwards, on_forwards, early)
        self.assertEqual(streamer.ends, 1, "end() must be called exactly once")
        self.assertFalse(streamer.put_after_end, "put() after end()")
        # same tensors, same order, same count as stock: the first put() is the prompt
        self.assertEqual(len(streamer.puts), len(ref_streamer.puts), "number of put() calls")
        for i, (a, b) in enumerate(zip(ref_streamer.puts, streamer.puts)):
            self.assertEqual(a.shape, b.shape, f"put #{i} shape")
            self.assertEqual(a.dtype, b.dtype, f"put #{i} dtype")
            self.assertTrue(torch.equal(a, b), f"put #{i}: stock {a.tolist()} vs flag on {b.tolist()}")
        # every kept token exactly once, in order, and nothing beyond (the undone extra token is never delivered)
        self.assertTrue(torch.equal(streamer.puts[0], ids), "the first put() is the prompt")
        delivered = [t for value in streamer.puts[1:] for t in value.reshape(-1).tolist()]
        self.assertListEqual(delivered, on[0, PROMPT_LEN:].tolist())

    @parameterized.expand([(f, s) for f in ("llama", "gpt2") for s in SCENARIOS])
    def test_text_streamer_prints_the_decoded_output_once(self, family, scenario):
        model = build(family)
        tokenizer = tiny_tokenizer()
        ids, mask = prompt(batch=1)
        kw, early = _scenario(scenario, model, ids, mask)

        def run(flag):
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                out, forwards = _generate(model, ids, mask, TextStreamer(tokenizer, skip_prompt=True), flag, **kw)
            return out, forwards, buffer.getvalue()

        with stock():
            ref, ref_forwards, ref_text = run(False)
        on, on_forwards, text = run(True)

        self.assertListEqual(ref.tolist(), on.tolist())
        self._check_early_stop(ref, ref_forwards, on_forwards, early)
        self.assertEqual(text, ref_text)
        # TextStreamer ends the stream with one newline: printed once, all of it, nothing more
        self.assertEqual(text, tokenizer.decode(on[0, PROMPT_LEN:]) + "\n")

    @parameterized.expand([(f, s) for f in ("llama", "qwen2") for s in SCENARIOS])
    def test_text_iterator_streamer_yields_the_decoded_output_once(self, family, scenario):
        model = build(family)
        tokenizer = tiny_tokenizer()
        ids, mask = prompt(batch=1)
        kw, early = _scenario(scenario, model, ids, mask)

        def run(flag):
            streamer = TextIteratorStreamer(tokenizer, skip_prompt=False, timeout=60)
            result, errors, chunks = {}, [], []

            def consume():
                try:
                    for chunk in streamer:  # StopIteration only on the stop signal end() puts
                        chunks.append(chunk)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            consumer = threading.Thread(target=consume)
            consumer.start()
            try:
                result["out"], result["forwards"] = _generate(model, ids, mask, streamer, flag, **kw)
            finally:
                consumer.join(timeout=60)
            self.assertFalse(consumer.is_alive(), "the consumer never saw the end of the stream")
            self.assertEqual(errors, [])
            # end() puts exactly one stop signal: nothing may be left behind it
            self.assertTrue(streamer.text_queue.empty(), "text or a second stop signal after the end")
            return result["out"], result["forwards"], chunks

        with stock():
            ref, ref_forwards, ref_chunks = run(False)
        on, on_forwards, chunks = run(True)

        self.assertListEqual(ref.tolist(), on.tolist())
        self._check_early_stop(ref, ref_forwards, on_forwards, early)
        self.assertListEqual(chunks, ref_chunks)
        self.assertEqual("".join(chunks), tokenizer.decode(on[0]))


class BatchedCustomStreamer(unittest.TestCase):
    """A custom `BaseStreamer` is not limited to one row in stock: rows that stop early are streamed as padding."""

    @parameterized.expand([(f,) for f in ("llama", "gpt2")])
    @pytest.mark.core
    def test_put_calls_equal_stock_with_rows_stopping_at_different_steps(self, family):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        eos = eos_ids_finishing_at(model, ids, mask, [1, 3, 5], MAX_NEW)
        with stock():
            ref_streamer = RecordingStreamer()
            ref, ref_forwards = _generate(model, ids, mask, ref_streamer, False, eos_token_id=eos)
        streamer = RecordingStreamer()
        on, on_forwards = _generate(model, ids, mask, streamer, True, eos_token_id=eos)

        self.assertListEqual(ref.tolist(), on.tolist())
        self.assertLess(ref.shape[1], PROMPT_LEN + MAX_NEW, "the reference run must stop early")
        self.assertEqual(on_forwards, ref_forwards + 1)
        self.assertEqual(streamer.ends, 1)
        self.assertEqual(len(streamer.puts), len(ref_streamer.puts))
        for i, (a, b) in enumerate(zip(ref_streamer.puts, streamer.puts)):
            self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype), f"put #{i}")
            self.assertTrue(torch.equal(a, b), f"put #{i}: stock {a.tolist()} vs flag on {b.tolist()}")
        self.assertTrue(torch.equal(torch.stack(streamer.puts[1:], dim=1), on[:, PROMPT_LEN:]))


class StreamerAcrossCalls(unittest.TestCase):
    def test_second_call_streams_only_its_own_tokens(self):
        """A stopped call's held-back or in-flight token must not leak into the next call's stream."""
        model = build("llama")
        ids, mask = prompt(batch=1)
        eos = eos_ids_finishing_at(model, ids, mask, [2], MAX_NEW)
        other_ids, other_mask = prompt(batch=1, seed=5)

        def two_calls(flag):
            first, second = RecordingStreamer(), RecordingStreamer()
            out1, _ = _generate(model, ids, mask, first, flag, eos_token_id=eos)
            out2, _ = _generate(model, other_ids, other_mask, second, flag, max_new_tokens=4, eos_token_id=None)
            return (out1, first), (out2, second)

        with stock():
            ref = two_calls(False)
        on = two_calls(True)
        for (ref_out, ref_streamer), (out, streamer) in zip(ref, on):
            self.assertListEqual(ref_out.tolist(), out.tolist())
            self.assertEqual(streamer.ends, 1)
            self.assertEqual([p.tolist() for p in streamer.puts], [p.tolist() for p in ref_streamer.puts])


if __name__ == "__main__":
    unittest.main()
