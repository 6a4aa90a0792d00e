"""T5's graphed decoder forward (T5ForConditionalGeneration), read by hand (`graphs/piecewise/proof/family.py`
FAMILIES, the digests of "piecewise forward (t5)" in `targets/piecewise_t5_rows.py`, 5.17.0-5.24.0).

A decode step of T5's decoder runs two attention sites per block, as Whisper's: the self-attention after the update
of the `EncoderDecoderCache`'s self-attention cache, and the cross-attention over the cross-attention cache (no
update). It has no positions: layer 0's self-attention makes a relative position bias after its update from host
lengths (`compute_bias(1, key_length, past_seen_tokens=...)`), which every later layer gets as `position_bias`. A
recording runs it eagerly and checks its arguments and the data flow by identity; each replay calls the class's
`compute_bias` again with the step's lengths (`attention.Cut.bias`). The cross-attention's bias (zeros of the
encoder's length) is made inside a piece: the encoder's length is part of the recording key.

Each case against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after the call),
two calls each (the second replays the first's recording): greedy, seeded sampling, batch 1 and 2 (and mT5's copy,
"piecewise forward (mt5)"); then what keeps
the forward eager, named (a user module or a hook in the decoder, `compute_bias` replaced on the class before the call
or mid-call or set on an instance, the encoder's attention mask, another attention implementation); on CUDA (skipped
without it) and on the CPU with the graphs emulated.
"""

from __future__ import annotations

import os
import re
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, T5Config, T5ForConditionalGeneration

import transformers_async_stop as tas
from encoder_decoder_steps import assert_steps_equal_stock
from models import TRANSFORMERS_VERSION, VOCAB, assert_same, stock
from test_dynamic_loop_encoder_decoder import PAD, build
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
READ = (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24) and matches("piecewise forward (t5)")
TAKEN = READ and matches("dynamic decode loop")
MT5_TAKEN = TAKEN and matches("piecewise forward (mt5)") and matches("dynamic decode loop (mt5 encoder-decoder)")
CUDA = torch.cuda.is_available() and TAKEN
NEW = 8  # new tokens per call
PIECES = "graphed (5 pieces)"  # two decoder blocks, two attention sites each
BIAS_CHANGED = r"T5Attention\.compute_bias (was replaced|is not transformers' own)"


def t5(device="cpu", dtype=torch.float32, gated=False):
    if not gated:
        model = build("t5")
    else:  # T5 v1.1 / Flan-T5's feed-forward: gated, `gelu_new` (transformers' NewGELUActivation)
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu",
            decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=1, initializer_factor=4.0)).eval()
    return model.to(device=device, dtype=dtype)


def ids_of(batch: int, length: int = 5, device="cpu"):
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, VOCAB, (batch, length), generator=g).to(device)


def _generate(model, ids, flag, seed, new=NEW, **kwargs):
    torch.manual_seed(seed)
    flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
    out = model.generate(ids, max_new_tokens=new, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, **kwargs, **flag_kwargs)
    return out, torch.rand(4, device=ids.device)


def check_against_stock(test, model, ids, seed=7, **kwargs):
    with stock():
        ref, ref_after = _generate(model, ids, None, seed, **kwargs)
    out, after = _generate(model, ids, True, seed, **kwargs)
    assert_same(test, ref, out)
    test.assertIsNotNone(cache_kwarg.of_output(out))
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


def _attention_class():
    from transformers.models.t5 import modeling_t5

    return modeling_t5.T5Attention


CASES = [
    ("b1_greedy", 1, {}),
    ("b2_greedy", 2, {}),
    ("b1_sample", 1, dict(do_sample=True, top_k=10)),
    ("b2_sample", 2, dict(do_sample=True, top_k=10, temperature=0.9)),
]


class _T5Cases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32),)

    def _assert_graphed(self, context=None):
        path = tas.last_path()
        self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward graphed"),
                        (context, path.describe()))
        # every decode step graphed: the first call records at its first decode step
        self.assertTrue(path.forward.startswith(f"{PIECES}: "), (context, path.forward))
        self.assertNotIn("eager", path.forward, context)

    @parameterized.expand(CASES)
    def test_two_calls_equal_stock_and_replay(self, _, batch, extra):
        for dtype_name, dtype in self.DTYPES:
            model = t5(self.DEVICE, dtype)
            for call in range(2):  # the second call replays the first call's recording
                check_against_stock(self, model, ids_of(batch, device=self.DEVICE), **extra)
                self._assert_graphed((dtype_name, call))

    @parameterized.expand(CASES)
    def test_mt5_two_calls_equal_stock_and_replay(self, _, batch, extra):
        if not MT5_TAKEN:
            self.skipTest("the mT5 rows' releases (5.17-5.24)")
        model = build("mt5").to(self.DEVICE)
        for call in range(2):
            check_against_stock(self, model, ids_of(batch, device=self.DEVICE), **extra)
            self._assert_graphed(call)

    def test_gated_gelu_feed_forward_equals_stock(self):
        model = t5(self.DEVICE, gated=True)
        for call in range(2):
            check_against_stock(self, model, ids_of(2, device=self.DEVICE))
            self._assert_graphed(call)

    def test_fp16_with_the_feed_forward_output_in_fp32_equals_stock(self):
        # the fp16 clamps of each block run inside the pieces (device ops); `from_pretrained(dtype=torch.float16)`
        # keeps every `wo` in fp32 (`_keep_in_fp32_modules`), whose input the feed-forward casts
        model = t5(self.DEVICE, torch.float16)
        for block in (*model.encoder.block, *model.decoder.block):
            block.layer[-1].DenseReluDense.wo.float()
        for call in range(2):
            check_against_stock(self, model, ids_of(2, device=self.DEVICE))
            self._assert_graphed(call)

    def test_another_encoder_length_records_again_and_equals_stock(self):
        # the cross-attention's bias (zeros of the encoder's length) is made in a piece: a call whose encoder output
        # is longer must not replay the recording of a shorter one
        model = t5(self.DEVICE)
        for length in (4, 7, 4):
            check_against_stock(self, model, ids_of(2, length, device=self.DEVICE))
            self._assert_graphed(length)
        self.assertEqual(len(forward.graphs_of(model).recordings), 2)

    def test_a_user_module_in_the_decoder_keeps_it_eager_named(self):
        model = t5(self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        wi = model.decoder.block[1].layer[2].DenseReluDense.wi
        mine = MyLinear(wi.in_features, wi.out_features, bias=False, device=self.DEVICE).eval()
        mine.load_state_dict(wi.state_dict())
        model.decoder.block[1].layer[2].DenseReluDense.wi = mine
        check_against_stock(self, model, ids_of(2, device=self.DEVICE))
        forward_path = tas.last_path().forward
        self.assertTrue(forward_path.startswith("eager: decoder.block.1.layer.2.DenseReluDense.wi ("), forward_path)
        self.assertIn("MyLinear", forward_path)

    def test_a_user_module_in_the_encoder_does_not_keep_the_decoder_eager(self):
        # the encoder runs once, before the decode steps; no decode step runs it
        model = t5(self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        wi = model.encoder.block[0].layer[1].DenseReluDense.wi
        mine = MyLinear(wi.in_features, wi.out_features, bias=False, device=self.DEVICE).eval()
        mine.load_state_dict(wi.state_dict())
        model.encoder.block[0].layer[1].DenseReluDense.wi = mine
        for call in range(2):
            check_against_stock(self, model, ids_of(2, device=self.DEVICE))
            # the call itself runs immediate (user code anywhere in the model), its decode forward graphed
            self.assertTrue(tas.last_path().forward.startswith(f"{PIECES}: "), (call, tas.last_path().forward))

    def test_a_hook_in_the_decoder_keeps_it_eager_named(self):
        model = t5(self.DEVICE)
        calls = []
        handle = model.decoder.block[0].layer[1].EncDecAttention.register_forward_hook(
            lambda *args: calls.append(1))
        try:
            check_against_stock(self, model, ids_of(1, device=self.DEVICE))
        finally:
            handle.remove()
        self.assertEqual(tas.last_path().forward, "eager: a hook on T5Attention")
        self.assertTrue(calls)

    def test_compute_bias_replaced_on_the_class_keeps_the_forward_eager_and_runs(self):
        model = t5(self.DEVICE)
        cls = _attention_class()
        original = cls.compute_bias
        calls = []

        def counted(self, query_length, key_length, device=None, past_seen_tokens=0):
            # a user's wrapper: stock calls it at every step, so must the flag
            calls.append((query_length, key_length, past_seen_tokens))
            return original(self, query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)

        ids = ids_of(2, device=self.DEVICE)
        cls.compute_bias = counted
        try:
            with stock():
                _generate(model, ids, None, 7)
            seen_by_stock, calls[:] = list(calls), []
            check_against_stock(self, model, ids)
        finally:
            cls.compute_bias = original
        # which check names it first depends on whether this process proved the class before (`names.watched`)
        self.assertRegex(tas.last_path().forward, "^eager: .*" + BIAS_CHANGED)
        self.assertEqual(calls, seen_by_stock * 2)  # stock, then the flag: each saw the lengths stock's forwards see

    def test_compute_bias_on_an_instance_keeps_the_forward_eager(self):
        model = t5(self.DEVICE)
        attention = model.decoder.block[0].layer[0].SelfAttention
        attention.compute_bias = _attention_class().compute_bias.__get__(attention)
        check_against_stock(self, model, ids_of(2, device=self.DEVICE))
        self.assertIn("an instance-level compute_bias", tas.last_path().forward)

    def test_compute_bias_replaced_mid_call_is_seen_at_the_next_step(self):
        model = t5(self.DEVICE)
        cls = _attention_class()
        original = cls.compute_bias

        def doubled(self, *args, **kwargs):  # changes the values: a replay that kept the original would differ
            return original(self, *args, **kwargs) * 2

        class SwapAtStep(StoppingCriteria):
            def __init__(self):
                self.steps = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.steps += 1
                if self.steps == 4:
                    cls.compute_bias = doubled
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = ids_of(2, device=self.DEVICE)
        check_against_stock(self, model, ids)  # recorded
        kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                      output_logits=True)
        try:
            with stock():
                ref = model.generate(ids, stopping_criteria=[SwapAtStep()], **kwargs)
            cls.compute_bias = original
            out = model.generate(ids, stopping_criteria=[SwapAtStep()], async_stopping_criteria=True, **kwargs)
        finally:
            cls.compute_bias = original
        assert_same(self, ref.sequences, out.sequences)
        assert_same(self, ref.logits, out.logits)
        # the replays before the swap, then the steps after it eager
        self.assertRegex(tas.last_path().forward, f"^{re.escape(PIECES)}: .*eager: " + BIAS_CHANGED)

    def test_the_encoders_attention_mask_padded_or_of_ones_is_graphed_and_equals_stock(self):
        # the cross-attention mask stock's decoder makes from it at every step is made again at every replay by
        # stock's function (`recorder._Recorder.cross_mask`), its position bias combined with it by the attention
        model = t5(self.DEVICE)
        ids = ids_of(2, device=self.DEVICE)
        padded = torch.ones_like(ids)
        padded[1, :2] = 0
        for mask in (padded, torch.ones_like(ids), padded):
            check_against_stock(self, model, ids, attention_mask=mask, min_new_tokens=NEW)
            self.assertEqual(tas.last_path().forward, f"{PIECES}: {NEW - 1} decode steps")

    def test_the_forward_carries_the_encoder_outputs_and_equals_stock_step_by_step(self):
        model = t5(self.DEVICE)
        with torch.no_grad():
            encoder = model.encoder(input_ids=ids_of(2, device=self.DEVICE))
        prompt = torch.tensor([[PAD, 7, 9], [PAD, 8, 4]], device=self.DEVICE)
        assert_steps_equal_stock(self, model, encoder, prompt, PIECES)

@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class T5OnCuda(_T5Cases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))


@unittest.skipUnless(TAKEN, "the T5 row's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class T5EmulatedOnCpu(_T5Cases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@mock.patch.dict(os.environ, ON)
class T5Family(unittest.TestCase):
    """Where T5 is read (on the CPU every reason but the device's is told)."""

    @unittest.skipUnless(READ, "the T5 row's releases (5.17-5.24)")
    def test_t5_is_a_read_family_refused_on_the_cpu_only_for_the_device(self):
        model = t5()
        family, why = proof.family.find(model)
        self.assertIsNone(why)
        self.assertEqual((family.name, family.auto), ("t5", False))
        self.assertIs(proof.base_of(model), model)  # no base model: the stacks are the model's own
        blocks = model.decoder.block
        self.assertEqual(family.attentions(model, model.config),
                         [blocks[0].layer[0].SelfAttention, blocks[0].layer[1].EncDecAttention,
                          blocks[1].layer[0].SelfAttention, blocks[1].layer[1].EncDecAttention])
        cut, why = proof.attention.cut_of(_attention_class())
        self.assertEqual((cut.bias, cut.derive, why), ("compute_bias", None, None))
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__), "not CUDA (cpu)")

    @unittest.skipUnless(READ, "the T5 row's releases (5.17-5.24)")
    def test_mt5_is_a_read_family_of_its_own(self):
        model = build("mt5")
        family, why = proof.family.find(model)
        self.assertIsNone(why)
        self.assertEqual((family.name, family.auto, family.cross_attention), ("mt5", False, "layer.1.EncDecAttention"))
        self.assertIs(proof.base_of(model), model)
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__), "not CUDA (cpu)")

    @unittest.skipUnless(READ, "the T5 row's releases (5.17-5.24)")
    def test_another_activation_keeps_it_eager_named(self):
        # `ACT2FN["relu"]` is torch's ReLU, read; "silu" is transformers' SiLUActivation, not read with T5
        model = t5()
        from transformers.activations import ACT2FN

        for block in model.decoder.block:
            block.layer[2].DenseReluDense.act = ACT2FN["silu"]
        with torch.no_grad():
            why = proof.why_not_model(model, model.__call__)
        self.assertIn("decoder.block.0.layer.2.DenseReluDense.act", why)
        self.assertIn("not a source the graphed forward has read", why)

    @unittest.skipUnless(TAKEN, "the T5 row's releases (5.17-5.24)")
    def test_an_eager_attention_implementation_keeps_it_eager_named_and_equals_stock(self):
        model = t5()
        model.config._attn_implementation = "eager"
        with emulated():
            check_against_stock(self, model, ids_of(2))
        self.assertEqual(tas.last_path().forward,
                         "eager: an encoder-decoder's attention implementation 'eager' (its masks made in the forward)")


if __name__ == "__main__":
    unittest.main()
