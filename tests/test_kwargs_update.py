"""With the flag, a decode step's `_update_model_kwargs_for_generation` is the per-call `KwargsUpdate` (5.5.4+):
each step's model kwargs equal what stock transformers' own function returns for the same inputs."""

from __future__ import annotations

import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized

from models import PAD, TRANSFORMERS_VERSION, CountForwards, assert_same, build, eos_ids_finishing_at, prompt, stock
from transformers_async_stop.sync_free import kwargs_update
from transformers_async_stop import patching

TAKEN = TRANSFORMERS_VERSION >= (5, 5)


class KwargsUpdateEqualsStock(unittest.TestCase):
    @parameterized.expand([(f, padded, beams) for f in ("llama", "gpt2") for padded in (False, True)
                           for beams in (1, 2)])
    @pytest.mark.core
    def test_each_step_kwargs_and_the_output_equal_stock(self, family, padded, beams):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=padded)
        kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, num_beams=beams,
                  eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, 4, 5]), return_dict_in_generate=True,
                  output_scores=True)
        original = patching.original("GenerationMixin._update_model_kwargs_for_generation")
        real_call = kwargs_update.KwargsUpdate.__call__
        used = []

        def checked(lean, outputs, model_kwargs, *args):
            # stock's function on a copy of the same inputs, then ours on the real ones
            reference = original(model, outputs, dict(model_kwargs), *args)
            result = real_call(lean, outputs, model_kwargs, *args)
            self.assertEqual(sorted(result), sorted(reference))
            for key in reference:
                if isinstance(reference[key], torch.Tensor):
                    self.assertEqual(result[key].stride(), reference[key].stride(), key)
                assert_same(self, reference[key], result[key], key)
            used.append(True)
            return result

        with stock():
            ref = model.generate(ids, **kw)
        forwards = CountForwards(model)
        try:
            # the deferred path's update: the dynamic-cache loop (dynamic_loop/) makes its inputs without it
            with mock.patch.object(kwargs_update.KwargsUpdate, "__call__", checked), \
                    mock.patch.dict(os.environ, {"TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP": "0"}):
                out = model.generate(ids, async_stopping_criteria=True, **kw)
        finally:
            forwards.close()
        assert_same(self, ref, out)
        # one update per forward; every one after the prefill's is the per-call update
        self.assertEqual(len(used), forwards.count - 1 if TAKEN else 0)

    def test_a_model_with_its_own_update_keeps_it(self):
        model = build("llama")
        type(model)._update_model_kwargs_for_generation = lambda self, *a, **k: super(
            type(model), self)._update_model_kwargs_for_generation(*a, **k)
        try:
            self.assertIsNone(kwargs_update.KwargsUpdate.for_model(model))
        finally:
            del type(model)._update_model_kwargs_for_generation


if __name__ == "__main__":
    unittest.main()
