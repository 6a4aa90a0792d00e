"""OPT's graphed decode forward, read by hand (`graphs/piecewise/proof/family.py` FAMILIES, the digests of
"piecewise forward (opt)" in `targets/piecewise_rows.py`, 5.18.0-5.24.0).

OPT's base forward reads the cache's length on the host (`past_seen_tokens = cache.get_seq_length()`) at every step, so
a recording bakes the recording step's value in. It reaches no output: it only feeds the mask of ones made when the
forward gets no `attention_mask` (a branch no recording takes: its mask is the 4D sentinel; in stock those ones only
feed the next two), the `position_ids is None` branch (never taken: every recording and replay is handed the step's
positions) and `embed_positions`, which ignores it once `position_ids` is given. A step without `position_ids` stays
eager, named. On 5.17 the ones reached `create_causal_mask`: the row is not listed there, and OPT stays eager (the
automatic proof refuses the host read).

Each case against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after the call):
OPT-125m-shaped (norms before, `final_layer_norm`) and OPT-350m-shaped (norms after, no final norm, `project_in` /
`project_out`, no biases), greedy, seeded sampling, a left-padded batch, two calls, eager attention, assisted
decoding, a stop at the position table's last row; on CUDA (skipped without it) and on the CPU with the graphs emulated.
"""

from __future__ import annotations

import copy
import os
import types
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, prompt, stock
from test_piecewise import _check_against_stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
READ = (5, 18) <= TRANSFORMERS_VERSION <= (5, 24)  # the releases of the OPT row
CUDA = torch.cuda.is_available() and READ
# OPT-350m's layout: a word embedding narrower than the hidden size (`project_in` / `project_out`), layer norms after
# the attention and the MLP, no final layer norm, no biases
OPT_350M = dict(hidden_size=32, word_embed_proj_dim=16, ffn_dim=64, do_layer_norm_before=False, enable_bias=False)


def build_opt(device="cpu", dtype=torch.float32, attn="sdpa", **overrides):
    """A tiny random OPT (125m's layout unless `overrides` say otherwise: norms before, a final layer norm)."""
    from transformers import OPTConfig, OPTForCausalLM

    kwargs = dict(hidden_size=16, word_embed_proj_dim=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=128, vocab_size=VOCAB, init_std=0.5, pad_token_id=PAD, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(overrides)
    config = OPTConfig(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return OPTForCausalLM(config).to(device=device, dtype=dtype).eval()


class _OptCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"

    @parameterized.expand([
        (f"{layout}_{dtype_name}_{kind}", layout, dtype, kind)
        for layout in ("125m", "350m")
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for kind in ("greedy", "sample", "padded")
    ])
    def test_two_calls_equal_stock_and_replay(self, _, layout, dtype, kind):
        model = build_opt(self.DEVICE, dtype, **(OPT_350M if layout == "350m" else {}))
        if layout == "350m":
            self.assertIsNotNone(model.model.decoder.project_in)
            self.assertIsNone(model.model.decoder.final_layer_norm)
        padded = kind == "padded"
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        for call in range(2):  # the second call replays the first call's recording
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=kind == "sample",
                                 eos_token_id=None)
            path = tas.last_path()
            self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward graphed"), path.describe())
            # every decode step of each call replayed: the first records at its first step
            self.assertEqual(path.forward, "graphed (3 pieces): 9 decode steps", (call, path.forward))

    @parameterized.expand([("greedy",), ("padded",)])
    def test_eager_attention_equals_stock(self, kind):
        # its mask is made at every replay by stock's functions from the step's own mask
        model = build_opt(self.DEVICE, attn="eager")
        padded = kind == "padded"
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        self.assertEqual(tas.last_path().forward, "graphed (3 pieces): 9 decode steps")

    def test_assisted_decoding_with_an_opt_target_and_draft_equals_stock(self):
        # the verify forward of K tokens (its mask made at every replay from the step's own) and the draft's steps
        target, helper = build_opt(self.DEVICE), build_opt(self.DEVICE, num_hidden_layers=1)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                      return_dict_in_generate=True, output_scores=True, assistant_model=helper)
        for _ in range(2):  # a width is recorded at its second sighting: the second call replays every round
            with stock():
                want = target.generate(ids, attention_mask=mask, **kwargs)
            got = target.generate(ids, attention_mask=mask, async_stopping_criteria=True, **kwargs)
            assert_same(self, want, got)
        path = tas.last_path()
        self.assertRegex(path.verify, r"^graphed \(3 pieces\): \d+ rounds$")
        self.assertTrue(path.forward.startswith("draft graphed (2 pieces)"), path.forward)

    def test_a_stop_at_the_position_tables_last_row_equals_stock(self):
        # `embed_positions` has `max_position_embeddings` rows (ids offset by 2): stock stops on an EOS made at the
        # last row's position, where a forward one further would index past the table; the flag reads that verdict
        # before it (`undo/position_table.py`), and the steps before it replay
        table, length = 16, 6
        model = build_opt(self.DEVICE, max_position_embeddings=table)
        for seed in range(1, 40):
            ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed)).to(self.DEVICE)
            with stock():
                free = model.generate(ids, attention_mask=torch.ones_like(ids), max_length=table + 1,
                                      do_sample=False, pad_token_id=PAD, eos_token_id=None)
            eos = int(free[0, -1])
            if eos not in free[0, :-1].tolist():
                break
        else:
            self.skipTest("no prompt makes a fresh token at the table's last position")
        out = _check_against_stock(self, model, ids, torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                   eos_token_id=eos)
        self.assertEqual(out.sequences.shape[1], table + 1)
        self.assertIn("position table holds 16 positions", tas.last_path().describe())
        self.assertTrue(tas.last_path().forward.startswith("graphed (3 pieces)"), tas.last_path().forward)

    def test_a_step_without_position_ids_stays_eager_named_and_equals_stock(self):
        # the baked length would reach the positions if a replay ran a step that finds them itself: such a step runs
        # the eager forward, and the replays before and after it are stock's
        from transformers import DynamicCache

        model = build_opt(self.DEVICE)
        ids, mask = prompt(batch=2, device=self.DEVICE)
        name = cache_kwarg.name()
        with torch.no_grad():
            ours = DynamicCache(config=model.config)
            model(ids, attention_mask=mask, use_cache=True, **{name: ours})
            theirs = copy.deepcopy(ours)
            report = types.SimpleNamespace(forward=None, verify=None)
            step = forward.PiecewiseForward(model, model.__call__, report)
            token = torch.tensor([[5], [9]], device=self.DEVICE)
            for index, given in enumerate((True, True, False, True)):
                length = ids.shape[1] + index
                inputs = {"input_ids": token, "attention_mask": torch.ones(2, length + 1, dtype=mask.dtype,
                                                                           device=self.DEVICE),
                          "use_cache": True, "return_dict": True}
                if given:
                    inputs["position_ids"] = torch.full((2, 1), length, device=self.DEVICE)
                got = step(**{**inputs, name: ours})
                with stock():
                    want = model(**{**inputs, name: theirs})
                self.assertTrue(torch.equal(got.logits, want.logits), index)
                for a, b in zip(ours.layers, theirs.layers):
                    self.assertTrue(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), index)
                if not given:
                    self.assertEqual(report.forward, "graphed (3 pieces): 2 decode steps; 1 eager: a forward without "
                                                     "position_ids (the model finds the positions itself)")
                token = want.logits[:, -1:].argmax(-1)
        self.assertEqual((step.replayed, step.eager_steps), (3, 1))  # the first step recorded (counted graphed)
        self.assertEqual(report.forward, "graphed (3 pieces): 3 decode steps; 1 eager: a forward without "
                                         "position_ids (the model finds the positions itself)")


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.18-5.24")
@mock.patch.dict(os.environ, ON)
class OptOnCuda(_OptCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(READ, "the OPT row's releases (5.18-5.24)")
@mock.patch.dict(os.environ, ON)
class OptEmulatedOnCpu(_OptCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@mock.patch.dict(os.environ, ON)
class OptFamily(unittest.TestCase):
    """Where OPT is read, and what it is refused for elsewhere (on the CPU every reason but the device's is told)."""

    @unittest.skipUnless(READ, "the OPT row's releases (5.18-5.24)")
    def test_opt_is_a_read_family_refused_on_the_cpu_only_for_the_device(self):
        model = build_opt()
        family, why = proof.family.find(model)
        self.assertIsNone(why)
        self.assertEqual((family.name, family.auto), ("opt", False))
        self.assertEqual(len(family.attentions(model.model, model.config)), 2)
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__), "not CUDA (cpu)")

    @unittest.skipUnless(READ, "the OPT row's releases (5.18-5.24)")
    def test_another_activation_is_proven_per_recording_and_equals_stock(self):
        # `ACT2FN["gelu"]` is transformers' GELUActivation, not read with OPT: the family is proven per recording. Its
        # decoder's host read of the cache's length is read code (OPT's own row says why it reaches no output), and so
        # is the length's method itself since T5's row reads it (`Cache.get_seq_length`, 2026-11-29): the first
        # recording is kept once a second, at the next position, ran the same ops (before, the rules refused the
        # method's body, "reads 'get_seq_length' on the host")
        model = build_opt(activation_function="gelu")
        family, _ = proof.family.find(model)
        self.assertTrue(family.auto)
        ids, mask = prompt(batch=1)
        with emulated():
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        self.assertRegex(tas.last_path().forward, r"^graphed \(3 pieces\): 4 decode steps; 1 eager: recorded once, "
                                                  r"to be confirmed at the next position \(\d+ functions checked\)$")

    @unittest.skipUnless(TRANSFORMERS_VERSION[:2] == (5, 17), "5.17, whose OPT row is not listed")
    def test_on_5_17_opt_stays_eager_named(self):
        model = build_opt()
        ids, mask = prompt(batch=1)
        with emulated():
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        self.assertIn("reads 'get_seq_length' on the host", tas.last_path().forward)


if __name__ == "__main__":
    unittest.main()
