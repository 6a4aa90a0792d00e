"""The sync-free SDPA mask-skip check decides exactly as stock does."""

from __future__ import annotations

import inspect
import itertools
import unittest
import weakref
from unittest import mock

import torch
from parameterized import parameterized

from models import PAD, build, prompt, stock
from transformers_async_stop.sync_free import masking
from transformers_async_stop import patching

CHECKS = ("masking_utils._ignore_causal_mask_sdpa", "masking_utils._ignore_bidirectional_mask_sdpa")


def _call(check, mask, q_length, kv_length, kv_offset, q_offset, local):
    names = inspect.signature(check).parameters
    values = {"query_length": q_length, "q_length": q_length, "kv_length": kv_length, "kv_offset": kv_offset,
              "q_offset": q_offset, "local_attention_size": local, "local_size": local}
    return bool(check(mask, **{k: v for k, v in values.items() if k in names and k != "padding_mask"}))


def _grown_mask(prompt_mask, grown, padded):
    batch = prompt_mask.shape[0]
    return torch.cat([prompt_mask, torch.ones(batch, grown, dtype=torch.bool),
                      torch.zeros(batch, padded, dtype=torch.bool)], dim=1)


class StandInDecidesAsTheRealMask(unittest.TestCase):
    @parameterized.expand([(name,) for name in CHECKS])
    def test_every_shape_and_offset(self, name):
        check = patching.original(name)
        if check is None:
            self.skipTest(f"{name} is not in this transformers release (targets/ says where it is)")
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.ones(3, 5, dtype=torch.bool),  # no padding
            torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool),  # left padding
            torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),  # right padding
            torch.rand(4, 6, generator=g) > 0.3,  # holes anywhere
        ]
        checked = 0
        for prompt_mask, grown, padded in itertools.product(prompts, (0, 1, 4), (0, 3)):
            real = _grown_mask(prompt_mask, grown, padded)
            summary = masking.MaskSummary(prompt_mask)
            valid = prompt_mask.shape[1] + grown
            stand_in = summary.stand_in(valid, real.shape[1])
            total = real.shape[1]
            for q_length, kv_offset, q_offset, local in itertools.product((1, 2), (0, 2), (0, 3), (None, 4, 64)):
                for kv_length in {total - kv_offset, max(1, total - kv_offset - 2), q_length}:
                    args = (q_length, kv_length, kv_offset, q_offset, local)
                    expected = _call(check, real, *args)
                    self.assertEqual(_call(check, stand_in, *args), expected, (prompt_mask.tolist(), grown, padded,
                                                                               args))
                    checked += 1
        self.assertGreater(checked, 100)


class OnlyTaggedMasksTakeTheShortcut(unittest.TestCase):
    def test_untagged_mask_goes_to_the_stock_check(self):
        from transformers import masking_utils

        mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
        with mock.patch.object(masking.MaskSummary, "stand_in", side_effect=AssertionError("used")):
            ours = _call(masking_utils._ignore_causal_mask_sdpa, mask, 1, 3, 0, 0, None)
        self.assertEqual(ours, _call(patching.original(CHECKS[0]), mask, 1, 3, 0, 0, None))

    def test_left_padded_generate_reads_the_mask_once_then_uses_the_host_summary(self):
        model = build("llama")
        ids, mask = prompt(left_pad=True)
        new_tokens = 8
        built, used = [], []
        real_init, real_stand_in = masking.MaskSummary.__init__, masking.MaskSummary.stand_in

        def init(self, m):
            built.append(m.shape)
            real_init(self, m)

        def stand_in(self, *args):
            used.append(args)
            return real_stand_in(self, *args)

        with mock.patch.object(masking.MaskSummary, "__init__", init), \
                mock.patch.object(masking.MaskSummary, "stand_in", stand_in):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=PAD, eos_token_id=None)
        with stock():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=PAD, eos_token_id=None)
        self.assertListEqual(ref.tolist(), out.tolist())
        self.assertEqual(len(built), 1)  # one host read of the prompt mask per call
        self.assertEqual(len(used), new_tokens - 1)  # every decode step decided from the host summary


if __name__ == "__main__":
    unittest.main()


class MovedCopiesKeepTheSummary(unittest.TestCase):
    """accelerate moves a dispatched model's inputs to its main device each forward: the copy is recognised only
    inside generate(), only as a copy of the mask generate() feeds, and only on another device."""

    def setUp(self):
        from transformers_async_stop.sync_free import masking

        self.masking = masking
        self.fed_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
        masking._tag(self.fed_mask, masking.MaskSummary(self.fed_mask), 3)

    def tag_of(self, tensor, inside_generate=True):
        from transformers_async_stop.state.call_state import CALL, CallState

        state = None
        if inside_generate:
            state = CallState(user_cache=False, slice_inputs=True)
            state.fed_mask = weakref.ref(self.fed_mask)
        token = CALL.set(state)
        try:
            return self.masking._tag_of(tensor)
        finally:
            CALL.reset(token)

    def test_copy_on_another_device_shares_the_tag(self):
        moved = self.fed_mask.to("meta")  # stands in for cuda:0 <- cuda:1; never read
        self.assertIs(self.tag_of(moved), getattr(self.fed_mask, self.masking._TAG))

    def test_other_masks_are_not_mistaken_for_copies(self):
        self.assertIsNone(self.tag_of(self.fed_mask.clone()))  # same device: could be anything
        self.assertIsNone(self.tag_of(self.fed_mask[:, :2].to("meta")))  # another shape
        self.assertIsNone(self.tag_of(self.fed_mask.to(device="meta", dtype=torch.bool)))  # another dtype
        self.assertIsNone(self.tag_of(self.fed_mask.to("meta"), inside_generate=False))
