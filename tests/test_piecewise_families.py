"""The piecewise-graphed decode forward (`piecewise/`) for the families beyond Llama, Mistral, Qwen2 and Qwen3:
Phi-3, GPT-2, OPT (5.18+) and Gemma 3 with full-attention layers (and where Gemma 2 and sliding-window Gemma 3 stand).

Each case runs on CUDA (skipped without it) and on the CPU with the graphs emulated (`testing/emulation.py`: the
recorded ATen ops replayed without the model's Python, so what a recording bakes in shows as on CUDA): bit-exact
against unpatched transformers (sequences, scores, logits, the returned cache, contiguous, the RNG state after the
call), fp32 and bf16, batch 1 and a left-padded batch, greedy and sampling, a returned cache used again; and
`last_path().forward` says the forward was graphed, or why it stepped aside.

CPU only: each family's reasons to step aside (a rope with per-length state, a sliding window, cross-attention...),
and Phi-3's own input preparation in the dynamic-cache loop (its cache dropped at `original_max_position_embeddings`).
"""

from __future__ import annotations

import contextlib
import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers.utils import logging as hf_logging

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, build, prompt, stock
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _check_against_stock, _generate  # the same generate-and-draw and comparison

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases
CUDA = torch.cuda.is_available() and RELEASES
GRAPHED = ("phi3", "gpt2", "gemma3")  # the families whose decode forward is replayed (Gemma 3: full attention only)
# OPT, read on 5.18-5.24 (on 5.17 it stays eager: tests/test_piecewise_opt.py)
GRAPHED += ("opt",) if TRANSFORMERS_VERSION >= (5, 18) else ()
# the loop grows no 4D mask for them (`dynamic_loop/wide_mask.py` reads Llama, Mistral and Qwen2): with padding the
# model builds its 4D mask from the 2D one inside every forward, and so does each replay (`masks.mask_call`)


def _build(family, device="cpu", dtype=torch.float32, **overrides):
    """`models.build`, OPT (`test_piecewise_opt.build_opt`), and Gemma 3 (text) with full-attention layers unless
    `layer_types` says otherwise."""
    if family == "opt":
        from test_piecewise_opt import build_opt

        return build_opt(device, dtype, **overrides)
    if family != "gemma3":
        return build(family, device=device, dtype=dtype, **overrides)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    kwargs = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=128, vocab_size=VOCAB, pad_token_id=PAD,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.5, sliding_window=4,
                  layer_types=["full_attention", "full_attention"])
    kwargs.update(overrides)
    config = Gemma3TextConfig(**kwargs)
    config._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def _why(model):
    with torch.no_grad():
        return proof.why_not_model(model, model.__call__)


class _FamilyCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"

    @parameterized.expand([
        (f"{family}_{dtype_name}_{'padded' if padded else 'b1'}_{'sample' if sample else 'greedy'}",
         family, dtype, padded, sample)
        for family in GRAPHED
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for padded in (False, True)
        for sample in (False, True)
    ])
    def test_the_graphed_forward_equals_stock(self, _, family, dtype, padded, sample):
        model = _build(family, device=self.DEVICE, dtype=dtype)
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=12, do_sample=sample, eos_token_id=None)
        self.assertTrue(tas.last_path().describe().startswith("deferred, dynamic loop, forward "),
                        tas.last_path().describe())
        # a padded batch too: each replay makes the 4D mask with stock's functions from the step's 2D mask
        self.assertTrue(tas.last_path().forward.startswith("graphed (3 pieces): 11 decode steps"),
                        tas.last_path().forward)

    @parameterized.expand([(family,) for family in GRAPHED])
    def test_a_returned_cache_used_again_equals_stock(self, family):
        model = _build(family, device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD,
                      return_dict_in_generate=True)
        with stock():
            first = model.generate(ids, attention_mask=mask, **kwargs)
            ids2 = torch.cat([first.sequences, ids[:, :2]], dim=-1)
            ref = model.generate(ids2, attention_mask=torch.ones_like(ids2),
                                 **{cache_kwarg.name(): cache_kwarg.of_output(first)}, **kwargs)
        on1 = model.generate(ids, attention_mask=mask, async_stopping_criteria=True, **kwargs)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        on = model.generate(ids2, attention_mask=torch.ones_like(ids2),
                            **{cache_kwarg.name(): cache_kwarg.of_output(on1)}, async_stopping_criteria=True, **kwargs)
        assert_same(self, ref, on)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    @parameterized.expand([(family,) for family in GRAPHED])
    def test_a_stop_mid_call_equals_stock(self, family):
        # the stop is read one step late: the deferred step's forward (a replay) is undone
        model = _build(family, device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        with stock():  # sampled with the seed `_generate` sets: the same draws up to the stop
            free, _ = _generate(model, ids, mask, None, max_new_tokens=10, do_sample=True, eos_token_id=None)
        generated = free.sequences[0, ids.shape[1]:].tolist()
        eos = next(t for k, t in enumerate(generated[:8]) if k >= 1 and t not in generated[:k])
        out = _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=True, eos_token_id=eos)
        self.assertLess(out.sequences.shape[1], ids.shape[1] + 10)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_phi3_past_its_rope_switch_equals_stock(self):
        # Phi-3's own input preparation drops the cache once the sequence passes `original_max_position_embeddings`:
        # that step prefills the whole sequence (eager), the later ones replay again; a stop whose deferred step
        # would be that prefill reads its verdict at once (an undo cannot give the old cache back)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        limit = ids.shape[1] + 2
        model = build("phi3", device=self.DEVICE, original_max_position_embeddings=limit)
        with stock():
            free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                                  eos_token_id=None)
        _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        if TRANSFORMERS_VERSION >= (5, 20):
            self.assertEqual(tas.last_path().forward, "graphed (3 pieces): 8 decode steps; 1 eager: not a one-token "
                                                      "decode step")
        else:  # 5.17-5.19 feed the last token alone with no cache from there on (stock's own): every step is eager
            self.assertRegex(tas.last_path().forward, r"^graphed \(3 pieces\): 2 decode steps; \d+ eager: a NoneType$")
        eos = free[0, limit].item()  # the token whose step ends where the next forward would drop the cache
        self.assertNotIn(eos, free[0, ids.shape[1]:limit].tolist())
        out = _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=False, eos_token_id=eos)
        self.assertEqual(out.sequences.shape[1], limit + 1)

    def test_gemma3_with_final_logit_softcapping_equals_stock(self):
        model = _build("gemma3", device=self.DEVICE, final_logit_softcapping=3.0)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=None)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_gpt2_warns_of_padding_as_stock_does(self):
        # stock drops an all-ones mask (5.18+), and GPT-2's forward then checks each step's ids for the pad token and
        # warns once: a replay skips the forward's Python, so the piecewise forward runs that check before it. Row 0
        # finishes first: the later steps feed it the pad token
        model = build("gpt2", device=self.DEVICE)
        ids, mask = prompt(batch=2, device=self.DEVICE)
        with stock():
            free = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                                  eos_token_id=None)
        rows = free[:, ids.shape[1]:].tolist()
        eos = next(t for k, t in enumerate(rows[0]) if k >= 2 and t not in rows[0][:k] and t not in rows[1])
        logs = []
        for flag in (None, True):
            hf_logging.warning_once.cache_clear()
            with self.assertLogs("transformers", level="WARNING") as seen, \
                    (stock() if flag is None else contextlib.nullcontext()):
                hf_logging.get_logger("transformers").warning("start")
                out, _ = _generate(model, ids, mask, flag, max_new_tokens=8, do_sample=False, eos_token_id=eos)
            logs.append([line for line in seen.output if "attention_mask" in line])
            if flag is None:
                ref = out
        assert_same(self, ref, out)
        self.assertEqual(len(logs[0]), 1 if TRANSFORMERS_VERSION >= (5, 18) else 0)  # 5.17 keeps the mask
        self.assertEqual(logs[0], logs[1])
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class FamiliesOnCuda(_FamilyCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class FamiliesEmulatedOnCpu(_FamilyCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@unittest.skipUnless(RELEASES, "the piecewise forward's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class FamiliesStepAside(unittest.TestCase):
    """What each family is refused for (on the CPU every reason but the device's is told)."""

    @parameterized.expand([(family,) for family in GRAPHED])
    def test_a_read_family_on_the_cpu_is_refused_only_for_the_device(self, family):
        self.assertEqual(_why(_build(family)), "not CUDA (cpu)")

    def test_phi3_with_a_longrope_steps_aside(self):
        model = build("phi3")
        model.model.rotary_emb.rope_type = "longrope"  # its short/long factors switch with the length
        self.assertEqual(_why(model), "rope type 'longrope' has per-length state")

    def test_phi3_with_a_sliding_window_takes_the_path(self):
        # its masks are answered on the host per layer (issue 36, tests/test_piecewise_sliding.py)
        self.assertEqual(_why(build("phi3", sliding_window=4)), "not CUDA (cpu)")

    def test_gpt2_with_cross_attention_steps_aside(self):
        self.assertEqual(_why(build("gpt2", add_cross_attention=True)), "cross-attention layers")

    def test_gemma3_with_sliding_layers_takes_the_path(self):
        self.assertEqual(_why(_build("gemma3", layer_types=None)), "not CUDA (cpu)")

    def test_gemma3_with_sliding_layers_takes_the_dynamic_loop_and_the_graphed_forward(self):
        # its cache holds `DynamicSlidingWindowLayer`s: the dynamic-cache loop takes it (issue 36; more cases in
        # tests/test_piecewise_sliding.py)
        model = _build("gemma3", layer_types=None)
        ids, mask = prompt(batch=1)
        with emulated():
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().describe().startswith("deferred, dynamic loop, forward graphed"),
                        tas.last_path().describe())

    def test_gemma3_with_attention_softcapping_takes_the_path(self):
        # each replay hands the attention function the `softcap` stock's forward passes (SDPA's ignores it, eager's
        # applies it: tests/test_piecewise_attention_implementations.py)
        self.assertEqual(_why(_build("gemma3", attn_logit_softcapping=50.0)), "not CUDA (cpu)")

    def test_gemma3_with_bidirectional_attention_steps_aside(self):
        self.assertEqual(_why(_build("gemma3", use_bidirectional_attention=True)), "bidirectional attention")

    def test_gemma3_with_a_dynamic_rope_steps_aside(self):
        model = _build("gemma3")
        model.model.rotary_emb.rope_type = {"full_attention": "dynamic"}
        self.assertEqual(_why(model), "rope type 'dynamic' has per-length state")

    def test_gemma2_with_its_eager_attention_takes_the_path(self):
        # transformers refuses SDPA for it (attention logit soft-capping): found (`proof/discover.py`), its eager
        # attention called at every replay (tests/test_piecewise_attention_implementations.py)
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, vocab_size=VOCAB, pad_token_id=PAD)
        config._attn_implementation = "eager"
        self.assertEqual(_why(Gemma2ForCausalLM(config).eval()), "not CUDA (cpu)")

    def test_a_family_read_only_by_its_base_class_steps_aside(self):
        from transformers import GPT2DoubleHeadsModel

        model = GPT2DoubleHeadsModel(build("gpt2").config).eval()
        self.assertEqual(_why(model), "GPT2DoubleHeadsModel is not transformers' own GPT2LMHeadModel")


if __name__ == "__main__":
    unittest.main()
