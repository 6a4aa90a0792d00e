"""The graphed decode forward of multi-head latent attention (issue 45): DeepSeek-V3 and the families that cache
compressed latents and decompress them after the cache update with their attention module's `expand_kv`
(`graphs/piecewise/proof/attention.py`, `Cut.derive`).

Each family built from its own config class at its defaults but for the sizes (DeepSeek-V3: a LoRA'd query,
interleaved rope, a dense layer then a routed-experts layer with shared experts and group-limited routing), SDPA, a
`DynamicCache`: bit-exact against unpatched transformers (sequences, scores, logits, the returned cache, the RNG
state after the call), greedy and sampling, batch 1 and a left-padded batch, on the CPU with the graphs emulated and
on CUDA; `last_path().forward` says graphed, two pieces per layer. Then what keeps the forward eager: a derivation
that is not transformers' own (replaced on the class, before the call or by a criterion mid-call), or set on an
instance.
"""

from __future__ import annotations

import unittest

import torch
import transformers
from parameterized import parameterized
from transformers import StoppingCriteria

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, prompt, stock
from latent_models import FAMILIES, available, build_latent
from test_piecewise import _check_against_stock
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
CUDA = torch.cuda.is_available() and RELEASES


def _attention_class(model):
    return type(model.model.layers[0].self_attn)


class _LatentCases:
    DEVICE = "cuda"
    DTYPE = torch.bfloat16

    def _model(self, family):
        if not available(family):
            self.skipTest(f"{family}: not in transformers {transformers.__version__}")
        return build_latent(family, device=self.DEVICE, dtype=self.DTYPE)

    @parameterized.expand([(f"{family}_{kind}", family, kind) for family in FAMILIES
                           for kind in ("greedy", "sample", "padded")])
    def test_each_family_equals_stock_and_is_graphed(self, _, family, kind):
        model = self._model(family)
        padded = kind == "padded"
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        for _ in range(2):  # the second call replays what the first recorded (proven per recording)
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=kind == "sample",
                                 eos_token_id=None)
        # two layers: per layer a piece up to its cache update and one up to its derivation, then the last one
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces): 9 decode steps"),
                        f"{family}: {tas.last_path().forward}")

    def test_a_derivation_replaced_on_the_class_keeps_the_forward_eager_and_runs(self):
        model = self._model("deepseek_v3")
        cls = _attention_class(model)
        original = cls.expand_kv
        calls = []

        def counted(self, kv_nope, k_rot):  # a user's wrapper: stock calls it at every step, so must the flag
            calls.append(kv_nope.shape[2])
            return original(self, kv_nope, k_rot)

        ids, mask = prompt(batch=1, device=self.DEVICE)
        cls.expand_kv = counted
        try:
            with stock():
                model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
            seen_by_stock, calls[:] = list(calls), []
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        finally:
            cls.expand_kv = original
        # which check names it first depends on whether this process proved the class before (`names.watched`)
        self.assertRegex(tas.last_path().forward,
                         r"^eager: .*expand_kv (was replaced|is not transformers' own)")
        # `_check_against_stock` ran stock, then the flag: each saw the lengths stock's forwards see
        self.assertEqual(calls, seen_by_stock * 2)

    def test_a_derivation_on_an_instance_keeps_the_forward_eager(self):
        model = self._model("deepseek_v3")
        attention = model.model.layers[1].self_attn
        attention.expand_kv = _attention_class(model).expand_kv.__get__(attention)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        self.assertIn("an instance-level expand_kv", tas.last_path().forward)

    def test_a_derivation_replaced_mid_call_is_seen_at_the_next_step(self):
        model = self._model("deepseek_v3")
        cls = _attention_class(model)
        original = cls.expand_kv

        def doubled(self, kv_nope, k_rot):  # changes the values: a replay that kept the original would differ
            keys, values = original(self, kv_nope, k_rot)
            return keys, values * 2

        class SwapAtStep(StoppingCriteria):
            def __init__(self):
                self.steps = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.steps += 1
                if self.steps == 4:
                    cls.expand_kv = doubled
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=4, do_sample=False, eos_token_id=None)  # recorded
        try:
            with stock():
                ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                     stopping_criteria=[SwapAtStep()])
            cls.expand_kv = original
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 stopping_criteria=[SwapAtStep()], async_stopping_criteria=True)
        finally:
            cls.expand_kv = original
        self.assertTrue(torch.equal(ref, out))
        # the replays before the swap, then the steps after it eager (the name watch sees the class's attribute
        # rebound before the per-step check of its code does)
        self.assertRegex(tas.last_path().forward,
                         r"^graphed .*eager: DeepseekV3Attention\.expand_kv (was replaced|is not transformers' own)")


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
class LatentAttentionEmulated(_LatentCases, unittest.TestCase):
    DEVICE = "cpu"
    DTYPE = torch.float32

    def setUp(self):
        self.enterContext(emulated())


@unittest.skipUnless(CUDA, "CUDA and transformers 5.17-5.24")
class LatentAttentionOnCuda(_LatentCases, unittest.TestCase):
    DTYPE = torch.float32


@unittest.skipUnless(CUDA, "CUDA and transformers 5.17-5.24")
class LatentAttentionOnCudaBf16(_LatentCases, unittest.TestCase):
    """bf16, as users run these models (the red team of 2026-11-29 saw stock's own bf16 forward fault on CUDA at a
    configuration whose heads did not match: run this class in a process of its own)."""


if __name__ == "__main__":
    unittest.main()
