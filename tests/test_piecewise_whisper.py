"""Whisper's graphed decoder forward (WhisperForConditionalGeneration), read by hand (`graphs/piecewise/proof/family.py`
FAMILIES, the digests of "piecewise forward (whisper)" in `targets/piecewise_rows.py`, 5.17.0-5.24.0).

A decode step of Whisper's decoder runs two attention sites per layer: the self-attention, after the update of the
`EncoderDecoderCache`'s self-attention cache, and the cross-attention over the cross-attention cache's keys and values
(written at the prefill, no update). The recording cuts at both; each replay runs both eagerly, the cross-attention on
the step's own cache's tensors. Its decoder reads the cache's length on the host to make the positions: every
recording and replay is handed them (`decoder_position_ids`, stock's own values from that length), so the baked value
reaches no output. The encoder never runs in a decode step (`encoder_outputs` given): its modules (Conv1d...) are left
out of default-deny, a user module in the decoder is not.

Each case against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after the call),
two calls each (the second replays the first's recording): greedy, seeded sampling, batch 1 and 2, a language and a
task, timestamps; on CUDA (skipped without it) and on the CPU with the graphs emulated.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from encoder_decoder_steps import assert_steps_equal_stock
from models import TRANSFORMERS_VERSION, assert_same, stock
from test_dynamic_loop_encoder_decoder import build_whisper
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
READ = (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24) and matches("piecewise forward (whisper)")
TAKEN = READ and matches("dynamic decode loop")
CUDA = torch.cuda.is_available() and TAKEN
NEW = 8  # new tokens per call
PIECES = "graphed (5 pieces)"  # two decoder layers, two attention sites each


def whisper(device="cpu", dtype=torch.float32):
    return build_whisper().to(device=device, dtype=dtype)


def features(batch: int, device="cpu", dtype=torch.float32):
    """Log-mel features of `batch` clips (what the tiny encoder takes)."""
    return torch.randn(batch, 8, 20, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)


def _generate(model, feats, flag, seed, new=NEW, **kwargs):
    torch.manual_seed(seed)
    flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
    out = model.generate(feats, max_new_tokens=new, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, **kwargs, **flag_kwargs)
    return out, torch.rand(4, device=feats.device)


def check_against_stock(test, model, feats, seed=7, **kwargs):
    with stock():
        ref, ref_after = _generate(model, feats, None, seed, **kwargs)
    out, after = _generate(model, feats, True, seed, **kwargs)
    assert_same(test, ref, out)
    if not kwargs.get("return_timestamps"):  # with timestamps: a dict of the sequences and segments
        test.assertIsNotNone(cache_kwarg.of_output(out))
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


CASES = [
    ("b1_greedy", 1, {}),
    ("b2_greedy", 2, {}),
    ("b1_sample", 1, dict(do_sample=True, top_k=10)),
    ("b2_sample", 2, dict(do_sample=True, top_k=10, temperature=0.9)),
    ("language_task", 2, dict(language="fr", task="transcribe")),
    ("timestamps", 2, dict(return_timestamps=True)),
    ("timestamps_translate_sample", 2, dict(language="en", task="translate", return_timestamps=True,
                                            do_sample=True)),
]


class _WhisperCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32),)

    @parameterized.expand(CASES)
    def test_two_calls_equal_stock_and_replay(self, _, batch, extra):
        for dtype_name, dtype in self.DTYPES:
            model = whisper(self.DEVICE, dtype)
            feats = features(batch, self.DEVICE, dtype)
            for call in range(2):  # the second call replays the first call's recording
                check_against_stock(self, model, feats, **extra)
                path = tas.last_path()
                self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward graphed"),
                                (dtype_name, call, path.describe()))
                # every decode step graphed: the first call records at its first decode step
                self.assertTrue(path.forward.startswith(f"{PIECES}: "), (dtype_name, call, path.forward))
                self.assertNotIn("eager", path.forward, (dtype_name, call))

    def test_a_call_up_to_the_position_tables_last_row_equals_stock(self):
        # `embed_positions` holds `max_target_positions` (40) rows: Whisper's generate() refuses a call past them, and
        # the extra step after a stop at the last one runs at the table's last row (the 3 prompt tokens and 37 new
        # tokens fill 40 positions: the last forward stock runs is at position 38)
        model = whisper(self.DEVICE)
        self.assertEqual(model.model.decoder.embed_positions.weight.shape[0], 40)
        for _ in range(2):
            out = check_against_stock(self, model, features(2, self.DEVICE), new=37)
            self.assertEqual(out.sequences.shape[1], 40)
            self.assertEqual(tas.last_path().forward, f"{PIECES}: 36 decode steps")

    def test_a_user_module_in_the_decoder_keeps_it_eager_named(self):
        model = whisper(self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        fc1 = model.model.decoder.layers[1].fc1
        mine = MyLinear(fc1.in_features, fc1.out_features, device=self.DEVICE).eval()
        mine.load_state_dict(fc1.state_dict())
        model.model.decoder.layers[1].fc1 = mine
        check_against_stock(self, model, features(2, self.DEVICE))
        forward_path = tas.last_path().forward
        self.assertTrue(forward_path.startswith("eager: model.decoder.layers.1.fc1 ("), forward_path)
        self.assertIn("MyLinear", forward_path)

    def test_a_hook_in_the_decoder_keeps_it_eager_named(self):
        model = whisper(self.DEVICE)
        calls = []
        handle = model.model.decoder.layers[0].encoder_attn.register_forward_hook(lambda *args: calls.append(1))
        try:
            check_against_stock(self, model, features(1, self.DEVICE))
        finally:
            handle.remove()
        self.assertEqual(tas.last_path().forward, "eager: a hook on WhisperAttention")
        self.assertTrue(calls)

    def test_a_user_module_in_the_encoder_does_not_keep_the_decoder_eager(self):
        # the encoder runs once, before the decode steps (stock's and the flag's runs call it alike); no decode step
        # runs it
        model = whisper(self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        fc1 = model.model.encoder.layers[0].fc1
        mine = MyLinear(fc1.in_features, fc1.out_features, device=self.DEVICE).eval()
        mine.load_state_dict(fc1.state_dict())
        model.model.encoder.layers[0].fc1 = mine
        for _ in range(2):
            check_against_stock(self, model, features(2, self.DEVICE))
            self.assertTrue(tas.last_path().forward.startswith(f"{PIECES}: "), tas.last_path().forward)

    def test_a_step_given_a_decoder_mask_stays_eager_named(self):
        # a returned cache continued with a decoder mask: Whisper's own preparation makes `decoder_position_ids` from
        # it at every step, which the recording does not take
        model = whisper(self.DEVICE)
        feats = features(2, self.DEVICE)

        def run(flag):
            flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
            first = model.generate(feats, max_new_tokens=5, return_dict_in_generate=True, **flag_kwargs)
            cache = cache_kwarg.of_output(first)
            sequences = first["sequences"]
            second = model.generate(feats, decoder_input_ids=sequences, decoder_attention_mask=torch.ones_like(
                sequences), max_new_tokens=4, return_dict_in_generate=True, output_scores=True,
                **{cache_kwarg.name(): cache}, **flag_kwargs)
            return first, second

        with stock():
            torch.manual_seed(7)
            ref = run(None)
        torch.manual_seed(7)
        out = run(True)
        assert_same(self, ref, out)
        self.assertEqual(tas.last_path().forward, "eager: an encoder-decoder step handed its decoder's positions")

    def test_the_forward_carries_the_encoder_outputs_and_equals_stock_step_by_step(self):
        model = whisper(self.DEVICE)
        with torch.no_grad():
            encoder = model.model.encoder(features(2, self.DEVICE))
        prompt = torch.tensor([[41, 43, 45], [41, 42, 45]], device=self.DEVICE)
        assert_steps_equal_stock(self, model, encoder, prompt, PIECES)

@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class WhisperOnCuda(_WhisperCases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16))


@unittest.skipUnless(TAKEN, "the Whisper row's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class WhisperEmulatedOnCpu(_WhisperCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@mock.patch.dict(os.environ, ON)
class WhisperFamily(unittest.TestCase):
    """Where Whisper is read, and what the other encoder-decoders keep (on the CPU every reason but the device's is
    told)."""

    @unittest.skipUnless(READ, "the Whisper row's releases (5.17-5.24)")
    def test_whisper_is_a_read_family_refused_on_the_cpu_only_for_the_device(self):
        model = whisper()
        family, why = proof.family.find(model)
        self.assertIsNone(why)
        self.assertEqual((family.name, family.auto), ("whisper", False))
        decoder = model.model.decoder
        self.assertEqual(family.attentions(model.model, model.config),
                         [decoder.layers[0].self_attn, decoder.layers[0].encoder_attn,
                          decoder.layers[1].self_attn, decoder.layers[1].encoder_attn])
        # the encoder's modules (Conv1d, its layers) are not read, and need not be: no decode step runs them
        self.assertIsInstance(model.model.encoder.conv1, torch.nn.Conv1d)
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__), "not CUDA (cpu)")

    def test_other_encoder_decoders_are_not_graphed_yet(self):
        # BART's family and T5's are read too (tests/test_piecewise_bart.py, tests/test_piecewise_t5.py); M2M-100's
        # position table makes its positions from the ids with the cache's length inside
        from transformers import M2M100Config, M2M100ForConditionalGeneration

        model = M2M100ForConditionalGeneration(M2M100Config(
            vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)).eval()
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__),
                             "the decoder of an encoder-decoder model (not graphed yet)")

    @unittest.skipUnless(READ, "the Whisper row's releases (5.17-5.24)")
    def test_another_activation_keeps_it_eager_named(self):
        # `ACT2FN["relu"]` is torch's ReLU, read; "silu" is transformers' SiLUActivation, not read with Whisper
        model = whisper()
        model.config.activation_function = "silu"
        from transformers.activations import ACT2FN

        for layer in model.model.decoder.layers:
            layer.activation_fn = ACT2FN["silu"]
        with torch.no_grad():
            why = proof.why_not_model(model, model.__call__)
        self.assertIn("model.decoder.layers.0.activation_fn", why)
        self.assertIn("not a source the graphed forward has read", why)

    @unittest.skipUnless(TAKEN, "the Whisper row's releases (5.17-5.24)")
    def test_an_eager_attention_implementation_keeps_it_eager_named_and_equals_stock(self):
        model = whisper()
        model.config._attn_implementation = "eager"
        with emulated():
            check_against_stock(self, model, features(2))
        self.assertEqual(tas.last_path().forward,
                         "eager: an encoder-decoder's attention implementation 'eager' (its masks made in the forward)")


if __name__ == "__main__":
    unittest.main()
