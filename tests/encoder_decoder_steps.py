"""Shared by the encoder-decoder graphed-forward tests (Whisper, BART's family, T5): the piecewise forward driven step
by step against the model's own forward on unpatched stock, each on its own copy of one prefilled cache."""

from __future__ import annotations

import copy
import types

import torch

from models import assert_same, stock
from transformers_async_stop.graphs.piecewise import forward
from transformers_async_stop.release_checks import cache_kwarg


def assert_steps_equal_stock(test, model, encoder, prompt, pieces: str, extra=None, steps: int = 4):
    """Prefill `model`'s decoder with `prompt` over `encoder` (its outputs), then run `steps` one-token decode steps
    through a `PiecewiseForward` and through stock's forward: the same output type and fields, the step's encoder
    outputs carried, the caller's cache returned, the same logits and caches at every step; every step graphed (the
    first records). `extra`: further inputs of every forward (the encoder's `attention_mask`)."""
    from transformers import DynamicCache, EncoderDecoderCache

    extra = extra or {}
    name = cache_kwarg.name()
    device = prompt.device
    with torch.no_grad():
        ours = EncoderDecoderCache(DynamicCache(), DynamicCache())
        model(encoder_outputs=encoder, decoder_input_ids=prompt, use_cache=True, **extra, **{name: ours})
        theirs = copy.deepcopy(ours)
        report = types.SimpleNamespace(forward=None, verify=None)
        step = forward.PiecewiseForward(model, model.__call__, report)
        token = torch.tensor([[5], [9]], device=device)
        for index in range(steps):
            inputs = {"decoder_input_ids": token, "encoder_outputs": encoder, "use_cache": True, "return_dict": True,
                      **extra}
            got = step(**{**inputs, name: ours})
            with stock():
                want = model(**{**inputs, name: theirs})
            test.assertEqual(type(got), type(want))
            test.assertEqual(list(got.keys()), list(want.keys()))
            test.assertIs(got.encoder_last_hidden_state, encoder.last_hidden_state)
            test.assertIs(cache_kwarg.of_output(got), ours)
            test.assertTrue(torch.equal(got.logits, want.logits), index)
            assert_same(test, ours, theirs)
            token = want.logits[:, -1:].argmax(-1)
    test.assertEqual((step.replayed, step.eager_steps), (steps, 0))  # the first step recorded (counted graphed)
    test.assertEqual(report.forward, f"{pieces}: {steps} decode steps")
