"""A replay runs none of the model's Python, so every plain attribute a forward reads (a norm's epsilon, an attention's
scaling, the rotary embedding's attention scaling, a config field) is baked into the recorded graphs. User code that
rebinds one (between calls, or mid-call from a criterion) must make the recordings stale, as a replaced parameter
does: stock reads the new value at its next forward. Run on the CPU with the graphs emulated (`testing/emulation.py`);
the staleness check is the same code on CUDA."""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)

TWEAKS = {
    "a_norm_epsilon": lambda model: setattr(model.model.norm, "variance_epsilon", 0.5),
    "an_attention_scaling": lambda model: setattr(model.model.layers[0].self_attn, "scaling", 0.01),
    "the_rotary_attention_scaling": lambda model: setattr(model.model.rotary_emb, "attention_scaling", 3.0),
    "the_config_layer_count": lambda model: setattr(model.config, "num_hidden_layers", 1),
}


class _TweakAt(StoppingCriteria):
    """Applies `tweak(model)` once, when the sequence reaches `length` tokens; never stops."""

    def __init__(self, model, length, tweak):
        self.model, self.length, self.tweak = model, length, tweak

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.tweak(self.model)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, ids, mask, flag, **kwargs):
    extra = {} if flag is None else {"async_stopping_criteria": flag}
    return model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False,
                          eos_token_id=None, return_dict_in_generate=True, output_logits=True, **extra, **kwargs)


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"})
class RebindingAnAttributeTheForwardReads(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    @parameterized.expand(list(TWEAKS))
    def test_mid_call_makes_the_recording_stale(self, name):
        outputs = []
        for flag in (None, True):
            model = build("llama")
            ids, mask = prompt(batch=1)
            criteria = StoppingCriteriaList([_TweakAt(model, ids.shape[1] + 3, TWEAKS[name])])
            with stock() if flag is None else mock.patch.dict(os.environ, {}):
                outputs.append(_generate(model, ids, mask, flag, stopping_criteria=criteria))
        assert_same(self, *outputs)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    @parameterized.expand(list(TWEAKS))
    def test_between_calls_makes_the_recording_stale(self, name):
        model = build("llama")
        ids, mask = prompt(batch=1)
        _generate(model, ids, mask, True)  # records
        self.assertEqual(len(forward.graphs_of(model).recordings), 1)
        TWEAKS[name](model)
        with stock():
            ref = _generate(model, ids, mask, None)
        out = _generate(model, ids, mask, True)
        assert_same(self, ref, out)

    @parameterized.expand([("mid_call", True), ("between_calls", False)])
    def test_weights_rebound_to_new_values_make_the_recording_stale(self, _, mid_call):
        # `p.data = new` moves the storage: a replay would keep reading the old memory (the emulation pins it as a
        # CUDA graph does), so only the staleness check makes the step record the new weights
        def rescale(model):
            for param in model.parameters():
                param.data = param.data * 1.5

        outputs = []
        for flag in (None, True):
            model = build("llama")
            ids, mask = prompt(batch=1)
            if not mid_call:
                with stock() if flag is None else mock.patch.dict(os.environ, {}):
                    _generate(model, ids, mask, flag)
                rescale(model)
            criteria = StoppingCriteriaList([_TweakAt(model, ids.shape[1] + 3, rescale)] if mid_call else [])
            with stock() if flag is None else mock.patch.dict(os.environ, {}):
                outputs.append(_generate(model, ids, mask, flag, stopping_criteria=criteria))
        assert_same(self, *outputs)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_an_unchanged_model_keeps_its_recording_across_steps_and_calls(self):
        # the check must not see the forward's own per-step work as a change (that would record every step)
        model = build("llama")
        ids, mask = prompt(batch=1)
        _generate(model, ids, mask, True)
        first = forward.graphs_of(model).recordings
        recording = next(iter(first.values()))
        _generate(model, ids, mask, True)
        self.assertIs(next(iter(forward.graphs_of(model).recordings.values())), recording)


if __name__ == "__main__":
    unittest.main()
