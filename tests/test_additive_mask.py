"""A replay hands transformers' SDPA attention the additive form of its bool mask, made once per step
(`graphs/piecewise/additive_mask.py`): where the recording proved it equal bit for bit, and nowhere else. Every case
against unpatched stock; on the CPU with the graphs emulated, and on CUDA (the class at the end)."""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _check_against_stock, build_any
from transformers_async_stop.graphs.piecewise import additive_mask
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24)
STEPS = 11  # decode steps of a 12-token call


def _calls(test, model, ids, mask, **kwargs):
    """A recording call, then a replayed one with the conversions counted: (conversions, layers' masks handed)."""
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, **kwargs}
    _check_against_stock(test, model, ids, mask, **kwargs)
    made, handed = [], []
    real_get = additive_mask.StepMasks.get

    def get(self, layer_mask, dtype):
        converted = real_get(self, layer_mask, dtype)
        handed.append(converted.dtype if isinstance(converted, torch.Tensor) else None)
        return converted

    with mock.patch.object(additive_mask, "of", wraps=additive_mask.of) as of, \
            mock.patch.object(additive_mask.StepMasks, "get", get):
        _check_against_stock(test, model, ids, mask, **kwargs)
        made = of.call_count
    forward = tas.last_path().forward or ""
    test.assertTrue(forward.startswith("graphed"), forward)
    test.assertNotIn("eager", forward)
    return made, handed


class _Cases:
    DEVICE = "cpu"

    @parameterized.expand([(f"{family}_{name}", family, dtype, sample)
                           for family in ("llama", "qwen3", "mistral")
                           for name, dtype, sample in (("fp32_greedy", torch.float32, False),
                                                       ("bf16_sample", torch.bfloat16, True))])
    def test_a_padded_batch_gets_one_conversion_per_step_and_equals_stock(self, _, family, dtype, sample):
        # Llama and Mistral: the loop's grown 4D mask; Qwen3: the mask stock's functions make at each replay
        model = build_any(family, device=self.DEVICE, dtype=dtype)
        ids, mask = prompt(batch=3, left_pad=True, device=self.DEVICE)
        made, handed = _calls(self, model, ids, mask, do_sample=sample)
        layers = model.config.num_hidden_layers
        self.assertEqual(made, STEPS)  # once per replayed step, not once per layer
        self.assertEqual(handed, [dtype] * (STEPS * layers))  # every layer got the additive mask, in its dtype

    def test_an_unpadded_batch_converts_nothing(self):
        model = build_any("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        made, handed = _calls(self, model, ids, mask)
        # SDPA's own causal path: no mask at all, as in stock, and no layer proven for a conversion
        self.assertEqual((made, handed), (0, []))

    def test_a_recording_whose_conversion_gives_other_bits_keeps_the_bool_mask(self):
        # a torch converting a bool mask otherwise than the package's expression is caught at the recording: stand
        # in for it with a conversion that masks nothing
        model = build_any("llama", device=self.DEVICE)
        ids, mask = prompt(batch=3, left_pad=True, device=self.DEVICE)
        with mock.patch.object(additive_mask, "of", lambda m, dtype: torch.zeros(m.shape, dtype=dtype,
                                                                                  device=m.device)):
            made, handed = _calls(self, model, ids, mask)
        self.assertEqual(made, 0)
        self.assertEqual(handed, [])  # no layer proven: the replays hand the bool mask, as stock's forward does

    def test_sources_not_read_keep_the_bool_mask(self):
        model = build_any("llama", device=self.DEVICE)
        ids, mask = prompt(batch=3, left_pad=True, device=self.DEVICE)
        with mock.patch.object(additive_mask, "matches", lambda name: False):
            made, handed = _calls(self, model, ids, mask)
        self.assertEqual((made, handed), (0, []))

    def test_an_attention_function_other_than_transformers_sdpa_gets_the_bool_mask(self):
        # the replay calls the function the forward looks up now: a user's, registered under "sdpa" after the
        # recordings were made, gets what stock's forward hands it (a bool mask), never the additive form
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = build_any("llama", device=self.DEVICE)
        ids, mask = prompt(batch=3, left_pad=True, device=self.DEVICE)
        kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
        _check_against_stock(self, model, ids, mask, **kwargs)
        original = ALL_ATTENTION_FUNCTIONS["sdpa"]
        seen = []

        def user_sdpa(module, query, key, value, attention_mask, **kw):
            seen.append(None if attention_mask is None else attention_mask.dtype)
            return original(module, query, key, value, attention_mask, **kw)

        self.assertTrue(additive_mask.allowed(original))
        self.assertFalse(additive_mask.allowed(user_sdpa))
        ALL_ATTENTION_FUNCTIONS["sdpa"] = user_sdpa
        try:
            _check_against_stock(self, model, ids, mask, **kwargs)
        finally:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        self.assertTrue(seen)
        self.assertEqual(set(seen), {torch.bool})

    def test_dropout_in_the_attention_keeps_the_bool_mask(self):
        # a second attention run at the recording would draw dropout's random numbers: not taken
        self.assertFalse(additive_mask._plain({"dropout": 0.1}))
        self.assertFalse(additive_mask._plain({"position_bias": torch.zeros(1)}))
        self.assertTrue(additive_mask._plain({"dropout": 0.0, "scaling": 0.5}))

    def test_the_conversion_is_torchs_meaning_of_a_bool_mask(self):
        keep = torch.tensor([[[[True, False, True]]]])
        converted = additive_mask.of(keep, torch.bfloat16)
        self.assertEqual(converted.dtype, torch.bfloat16)
        self.assertEqual(converted.tolist(), [[[[0.0, float("-inf"), 0.0]]]])


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class AdditiveMaskEmulated(_Cases, unittest.TestCase):
    def run(self, result=None):
        with emulated():
            return super().run(result)


@unittest.skipUnless(torch.cuda.is_available() and RELEASES, "CUDA and transformers 5.17-5.24")
class AdditiveMaskOnCuda(_Cases, unittest.TestCase):
    DEVICE = "cuda"

    def test_a_padded_batch_replays_without_a_sync_per_step(self):
        from test_cuda import syncs_per_step

        model = build_any("llama", device="cuda", dtype=torch.bfloat16)
        ids, mask = prompt(batch=3, left_pad=True, device="cuda")
        _calls(self, model, ids, mask)
        # stock first, as the other no-sync tests: the counter then sees stock's per-step read (a zero below is a
        # measurement), and the process's first sync-debug call, which torch reports once as a sync of its own
        # (H200, docs/gpu-runs/2026-11-29-session2/call5), is not counted against the flag
        with stock():
            stock_syncs = syncs_per_step(model, ids, mask, eos_token_id=None)
        flag_syncs = syncs_per_step(model, ids, mask, eos_token_id=None, async_stopping_criteria=True)
        self.assertGreaterEqual(stock_syncs, 1.0)
        self.assertEqual(flag_syncs, 0.0)


if __name__ == "__main__":
    unittest.main()
