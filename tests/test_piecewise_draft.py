"""The assistant's draft steps of assisted decoding through the piecewise-graphed forward (`piecewise.forward_for`).

CPU: the draft's decision and the reason it gives in the assisted call's `last_path().forward` ("draft eager: ..."),
every draft decode step's inputs taken by the recording (the recording itself refused on the CPU, so each step runs
eagerly, equal to stock), a draft batch other than 1 and the draft switch (`piecewise.DRAFT_ON`) stepping aside.

CUDA (skipped without it), and the CPU with the graphs emulated (`testing/emulation.py`): assisted decoding with the
flag, the draft graphed, bit-exact against unpatched transformers (sequences, scores, logits, the returned cache, the
RNG state after the call), Llama/Mistral/Qwen2/Qwen3 drafts, fp32 and bf16, greedy and sampling.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import Qwen3Config, Qwen3ForCausalLM

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, build, prompt, stock
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise import forward, graphs, proof
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases (the draft's loop)
CUDA = torch.cuda.is_available() and RELEASES


def build_any(family: str, seed=0, device="cpu", dtype=torch.float32):
    if family != "qwen3":
        return build(family, seed=seed, device=device, dtype=dtype)
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=128, vocab_size=VOCAB,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def _assisted(target, helper, ids, flag, **kwargs):
    """test_piecewise's generate-and-draw, with the assistant (an unpadded prompt)."""
    return _generate(target, ids, torch.ones_like(ids), flag, assistant_model=helper, **kwargs)


def _check_against_stock(test, target, helper, ids, **kwargs):
    with stock():
        ref, ref_after = _assisted(target, helper, ids, None, **kwargs)
    out, after = _assisted(target, helper, ids, True, **kwargs)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class DraftOnTheCpu(unittest.TestCase):
    def setUp(self):
        self.target, self.helper = build("llama", seed=0), build("llama", seed=1)
        self.ids = prompt(batch=1)[0]

    def test_the_cpu_keeps_the_drafts_eager_forward_and_says_why(self):
        _check_against_stock(self, self.target, self.helper, self.ids, max_new_tokens=10, do_sample=False)
        self.assertEqual(tas.last_path().forward, "draft eager: not CUDA (cpu)")

    def test_every_draft_decode_step_is_taken_by_the_recording(self):
        # the model admitted on the CPU and the recording refused: each draft step gets as far as the recording
        # (its inputs, mask and cache taken), then runs eagerly with the cache as it was
        verdicts = []
        step = forward.PiecewiseForward._step

        def noted(self, inputs):
            made = step(self, inputs)
            if self.role != "verify":  # the target's verify rounds: tests/test_piecewise_verify.py
                verdicts.append((self.draft, made[2]))
            return made

        def refused(*args, **kwargs):
            raise graphs.NotRecordable("refused by the test")

        for sample in (False, True):
            verdicts.clear()
            with mock.patch.object(forward.PiecewiseForward, "_step", noted), \
                    mock.patch.object(forward, "record", refused), \
                    mock.patch.object(piecewise, "why_not_model", lambda model, model_forward: None), \
                    mock.patch.object(forward.proof, "why_not_model", lambda model, model_forward: None):
                _check_against_stock(self, self.target, self.helper, self.ids, max_new_tokens=10, do_sample=sample)
            self.assertEqual(tas.last_path().forward, "draft eager: not recordable: refused by the test")
            self.assertTrue(verdicts)
            self.assertEqual(set(verdicts), {(True, None)})

    def test_a_draft_batch_other_than_1_steps_aside(self):
        from transformers import DynamicCache

        model = self.helper
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.ones(2, 4, dtype=torch.long), use_cache=True, **{_cache_name(): cache})
            inputs = {"input_ids": torch.ones(2, 1, dtype=torch.long), "position_ids": torch.full((2, 1), 4),
                      _cache_name(): cache, "use_cache": True, "return_dict": True}
            draft = forward.PiecewiseForward(model, model.__call__, None, role="draft")
            self.assertEqual(draft._step(inputs)[2], "a draft batch other than 1")
            self.assertIsNone(forward.PiecewiseForward(model, model.__call__, None)._step(inputs)[2])

    def test_the_draft_switch_off_keeps_the_drafts_eager_forward(self):
        config = mock.Mock(is_assistant=True)
        with mock.patch.object(piecewise, "why_not_model", lambda model, model_forward: None):
            self.assertIsInstance(piecewise.forward_for(self.helper, self.helper.__call__, config),
                                  forward.PiecewiseForward)
            with mock.patch.object(piecewise, "DRAFT_ON", False):
                self.assertIsNone(piecewise.forward_for(self.helper, self.helper.__call__, config))


def _cache_name():
    from transformers_async_stop.release_checks import cache_kwarg

    return cache_kwarg.name()


class _GraphedDraftCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated (`testing/emulation.py`)."""

    DEVICE = "cuda"

    @parameterized.expand([
        (f"{family}_{dtype_name}_{'sample' if sample else 'greedy'}", family, dtype, sample)
        for family in ("llama", "mistral", "qwen2", "qwen3")
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for sample in (False, True)
    ])
    def test_assisted_decoding_with_a_graphed_draft_equals_stock(self, _, family, dtype, sample):
        target = build("llama", seed=0, device=self.DEVICE, dtype=dtype)
        helper = build_any(family, seed=1, device=self.DEVICE, dtype=dtype)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=sample, eos_token_id=None)
        self.assertTrue(tas.last_path().forward.startswith("draft graphed"), tas.last_path().forward)

    def test_a_draft_stopping_on_eos_equals_stock(self):
        # EOS in the draft: the draft loop's extra step (read one token late) is undone in the assistant's cache
        target, helper = build("llama", seed=0, device=self.DEVICE), build("llama", seed=1, device=self.DEVICE)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        for eos in range(3, 12):
            _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)

    def test_a_second_assisted_call_reuses_the_drafts_graphs(self):
        target, helper = build("llama", seed=0, device=self.DEVICE), build("llama", seed=1, device=self.DEVICE)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
        recordings = dict(forward.graphs_of(helper).recordings)
        # the one-token decode steps and each round's two-token prefill (`dynamic_loop/prefill.py`)
        self.assertEqual(sorted(key[1] for key in recordings), [1, 2])
        _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
        self.assertEqual(dict(forward.graphs_of(helper).recordings), recordings)


    def test_a_draft_recorded_and_unchanged_is_proven_once_per_call_not_per_round(self):
        # each round's assistant generate() is a call: one whose recordings' snapshot is unchanged asks only what a
        # call can change (`proof.why_not_again`, issue 38); a change between two calls is proven again
        target, helper = build("llama", seed=0, device=self.DEVICE), build("llama", seed=1, device=self.DEVICE)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
        with mock.patch.object(piecewise, "why_not_model", wraps=piecewise.why_not_model) as full, \
                mock.patch.object(piecewise, "why_not_again", wraps=piecewise.why_not_again) as again:
            _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
            self.assertEqual(full.call_count, 0)
            self.assertGreater(again.call_count, 1)
            helper.model.layers[0].self_attn.scaling = helper.model.layers[0].self_attn.scaling * 2
            _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
            self.assertGreater(full.call_count, 0)
        self.assertTrue(tas.last_path().forward.startswith("draft graphed"), tas.last_path().forward)

    def test_a_hook_added_between_calls_to_a_recorded_draft_keeps_it_eager(self):
        target, helper = build("llama", seed=0, device=self.DEVICE), build("llama", seed=1, device=self.DEVICE)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
        handle = helper.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 1.0)
        try:
            _check_against_stock(self, target, helper, ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
            self.assertEqual(tas.last_path().forward, "draft eager: a hook on LlamaMLP")
        finally:
            handle.remove()


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class DraftOnCuda(_GraphedDraftCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class DraftEmulatedOnCpu(_GraphedDraftCases, unittest.TestCase):
    """The same cases on the CPU, the draft's graphs emulated (recorded ATen ops replayed without Python)."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())
