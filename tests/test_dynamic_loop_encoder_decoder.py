"""Encoder-decoder models (BART and its copies, T5, Whisper) on the dynamic-cache loop (5.17+): each decode step's
inputs are made from the previous step's (`dynamic_loop/inputs.py`, `ENCODER_DECODER`), the stop is read one step
late and the extra step undone in the self-attention cache alone. Every output equals unpatched stock transformers:
sequences, scores, logits, the returned cache and a second call continuing from it, the streamer's tokens, and the
RNG state afterwards. Tiny random-weight models built from configs (no hub access).
"""

from __future__ import annotations

import contextlib
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    BlenderbotSmallConfig,
    BlenderbotSmallForConditionalGeneration,
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    StoppingCriteriaList,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

import transformers_async_stop as tas
from loop_callbacks import Collect, StopAfterRepeat
from models import TRANSFORMERS_VERSION, VOCAB, assert_same, prompt, stock
from transformers_async_stop.loops import dynamic_loop
from transformers_async_stop.loops.dynamic_loop import inputs
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches

TAKEN = TRANSFORMERS_VERSION >= (5, 17) and matches("dynamic decode loop")
PAD = 0

_BART_SIZES = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=PAD,
                   bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                   init_std=0.5, max_position_embeddings=64)
_BART_SHAPED = {"bart": (BartConfig, BartForConditionalGeneration),
                "mbart": (MBartConfig, MBartForConditionalGeneration), "marian": (MarianConfig, MarianMTModel),
                "pegasus": (PegasusConfig, PegasusForConditionalGeneration),
                "blenderbot": (BlenderbotConfig, BlenderbotForConditionalGeneration),
                "blenderbot_small": (BlenderbotSmallConfig, BlenderbotSmallForConditionalGeneration)}

# Whisper's special tokens in a vocabulary of 80: text below 40, then these, then timestamps from 50
EOT, SOT, EN, FR, TRANSLATE, TRANSCRIBE, PREV_SOT, NO_TIMESTAMPS = 40, 41, 42, 43, 44, 45, 47, 49


def build(family: str):
    torch.manual_seed(0)
    if family in ("t5", "mt5"):  # mT5: T5's code under its own names, a gated-gelu feed-forward by default
        config_class, model_class = (T5Config, T5ForConditionalGeneration) if family == "t5" else (
            MT5Config, MT5ForConditionalGeneration)
        config = config_class(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                              decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=1, initializer_factor=4.0)
        return model_class(config).eval()
    if family == "whisper":
        return build_whisper()
    config_class, model_class = _BART_SHAPED[family]
    if family == "marian":
        config = config_class(**{**_BART_SIZES, "decoder_start_token_id": PAD})  # Marian starts from the pad token
    else:
        config = config_class(**_BART_SIZES)
    return model_class(config).eval()


def build_whisper():
    """A tiny multilingual Whisper whose generation config has what language, task and timestamps need."""
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=80, num_mel_bins=8, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16,
                           max_source_positions=10, max_target_positions=40, pad_token_id=EOT, bos_token_id=EOT,
                           eos_token_id=EOT, decoder_start_token_id=SOT, init_std=0.5, begin_suppress_tokens=None,
                           suppress_tokens=None)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT, max_length=40,
        lang_to_id={"<|en|>": EN, "<|fr|>": FR}, task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        no_timestamps_token_id=NO_TIMESTAMPS, is_multilingual=True, prev_sot_token_id=PREV_SOT,
        begin_suppress_tokens=[EOT], suppress_tokens=[], max_initial_timestamp_index=5)
    return model


def features(batch: int):
    """Log-mel features of `batch` clips (2 x `max_source_positions` frames: what the tiny encoder takes)."""
    return torch.randn(batch, 8, 20, generator=torch.Generator().manual_seed(5))


def stops_early(first_tokens: list, step: int) -> list:
    """EOS ids that stop each row of a stock run's new tokens near new token `step`, and before its last: per row,
    the token first made nearest that step (the later one of two as near), the pad token only where a row makes
    nothing else."""
    chosen = []
    for row in first_tokens:
        firsts = [(k, t) for k, t in enumerate(row[:-1]) if t not in row[:k]]
        firsts = [(k, t) for k, t in firsts if t != PAD] or firsts
        if firsts:
            chosen.append(min(firsts, key=lambda kt: (abs(kt[0] - step), -kt[0]))[1])
    return list(dict.fromkeys(chosen))


def text_eos(model, ids, mask, step=3):
    with stock():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD)
    return stops_early(out[:, 1:].tolist(), step)


class Spy:
    """Counts the loop's runs and whether each made its decode inputs from the previous step's (lean)."""

    def __init__(self):
        self.runs, self.lean = 0, []
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        real_run, real_build = dynamic_loop.run, inputs.DecodeInputs.build.__func__

        def run(*args, **kwargs):
            self.runs += 1
            return real_run(*args, **kwargs)

        def build_(cls, *args, **kwargs):
            made = real_build(cls, *args, **kwargs)
            self.lean.append(made[1] is not None)
            return made

        self._stack.enter_context(mock.patch.object(dynamic_loop, "run", run))
        self._stack.enter_context(mock.patch.object(inputs.DecodeInputs, "build", classmethod(build_)))
        return self

    def __exit__(self, *exc):
        self._stack.close()


def stock_then_flag(test, run, lean=True, taken=True, runs=1):
    """`run(None)` on unpatched stock, `run(True)` with the flag: equal outputs and RNG draws afterwards; the flagged
    `generate()` calls (`runs` of them) took the dynamic loop (their inputs made from the previous step's where
    `lean`)."""
    with stock():
        torch.manual_seed(7)
        ref, ref_after = run(None), torch.rand(4)
    with Spy() as spy:
        torch.manual_seed(7)
        out, after = run(True), torch.rand(4)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    path = tas.last_path()
    if taken:
        test.assertEqual((path.path, path.loop), ("deferred", "dynamic"), path)
        test.assertEqual(spy.runs, runs)
        test.assertEqual(spy.lean, [lean] * runs)
    else:
        test.assertIsNone(path.loop, path)
        test.assertEqual(spy.runs, 0)
    return ref


def _flag(flag):
    return {} if flag is None else dict(async_stopping_criteria=flag)


def _sampling(sample):
    return dict(do_sample=True, top_k=10, temperature=0.9) if sample else {}


@unittest.skipUnless(TAKEN, "the dynamic-cache loop runs on transformers 5.17-5.24 (older: test_encoder_decoder)")
class TextEncoderDecodersEqualStock(unittest.TestCase):
    @parameterized.expand([(f"{family}_{'padded' if padded else 'b1'}_{'sample' if sample else 'greedy'}",
                            family, padded, sample)
                           for family in ("bart", "t5", "mt5") for padded in (False, True)
                           for sample in (False, True)])
    def test_sequences_scores_logits_cache_and_rng_equal_stock(self, _, family, padded, sample):
        model = build(family)
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded)
        eos = text_eos(model, ids, mask)

        def run(flag):
            return model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD,
                                  return_dict_in_generate=True, output_scores=True, output_logits=True,
                                  **_sampling(sample), **_flag(flag))

        ref = stock_then_flag(self, run)
        self.assertEqual(type(ref).__name__, "GenerateEncoderDecoderOutput")
        if not sample:
            self.assertLess(ref.sequences.shape[1], 1 + 10, "the reference run must stop early")

    @parameterized.expand([("mbart",), ("marian",), ("pegasus",), ("blenderbot",), ("blenderbot_small",)])
    def test_bart_shaped_copies_take_the_loop_and_equal_stock(self, family):
        model = build(family)
        ids, mask = prompt(batch=2, left_pad=True)
        eos = text_eos(model, ids, mask)

        def run(flag):
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD,
                                  return_dict_in_generate=True, output_scores=True, **_flag(flag))

        stock_then_flag(self, run)

    @parameterized.expand([("bart",), ("t5",)])
    def test_a_padded_decoder_prompt_grows_its_mask_as_stock(self, family):
        # generate() given a decoder prompt and its mask: stock's update grows `decoder_attention_mask` each step
        model = build(family)
        ids, mask = prompt(batch=2)
        start = model.generation_config.decoder_start_token_id
        decoder_ids = torch.tensor([[start, 5, 9], [PAD, start, 7]])
        decoder_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])

        def run(flag):
            return model.generate(ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                                  decoder_attention_mask=decoder_mask, max_new_tokens=8, eos_token_id=None,
                                  pad_token_id=PAD, return_dict_in_generate=True, output_logits=True, **_flag(flag))

        stock_then_flag(self, run)

    @parameterized.expand([("bart",), ("t5",)])
    def test_a_returned_cache_continues_in_a_second_call_as_stock(self, family):
        model = build(family)
        ids, mask = prompt(batch=2, left_pad=True)
        eos = text_eos(model, ids, mask, step=1)

        def run(flag):
            first = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=PAD,
                                   return_dict_in_generate=True, **_flag(flag))
            cache = cache_kwarg.of_output(first)
            # the second call feeds the whole decoder sequence with its mask: the prefill slices the token the cache
            # lacks (its length is stock's, the extra step undone)
            second = model.generate(ids, attention_mask=mask, decoder_input_ids=first.sequences,
                                    decoder_attention_mask=torch.ones_like(first.sequences), max_new_tokens=4,
                                    eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True,
                                    output_scores=True, **{cache_kwarg.name(): cache}, **_flag(flag))
            return first.sequences, second, int(cache.self_attention_cache.get_seq_length())

        ref = stock_then_flag(self, run, runs=2)
        self.assertLess(ref[0].shape[1], 1 + 8, "the first reference run must stop early")

    def test_a_streamer_gets_stocks_tokens(self):
        model = build("bart")
        ids, mask = prompt(batch=1)
        eos = text_eos(model, ids, mask)

        def run(flag):
            streamer = Collect()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD,
                                 streamer=streamer, **_flag(flag))
            return out, streamer.chunks, streamer.ended

        ref = stock_then_flag(self, run)
        self.assertLess(ref[0].shape[1], 1 + 10, "the reference run must stop early")

    def test_attentions_asked_for_keep_the_deferred_path(self):
        # stock returns each step's cross-attentions and the encoder's attentions then: the loop returns neither
        model = build("bart")
        ids, mask = prompt(batch=2, left_pad=True)

        def run(flag):
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=text_eos(model, ids, mask),
                                  pad_token_id=PAD, return_dict_in_generate=True, output_attentions=True,
                                  output_hidden_states=True, **_flag(flag))

        stock_then_flag(self, run, taken=False)

    def test_a_subclass_of_a_family_keeps_the_deferred_path(self):
        # a class the loop did not read (its forward may be another): the deferred path, as stock
        class MyBart(BartForConditionalGeneration):
            pass

        model = MyBart(build("bart").config).eval()
        ids, mask = prompt(batch=1)

        def run(flag):
            return model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, **_flag(flag))

        stock_then_flag(self, run, taken=False)


@unittest.skipUnless(TAKEN, "the dynamic-cache loop runs on transformers 5.17-5.24")
class WhisperEqualsStock(unittest.TestCase):
    @parameterized.expand([
        ("b1_greedy", 1, {}),
        ("b2_sample", 2, dict(do_sample=True, top_k=10)),
        ("language_task", 2, dict(language="fr", task="transcribe")),
        # the timestamp processor takes one EOS id: a user criterion stops the rows early instead
        ("timestamps", 2, dict(return_timestamps=True)),
        ("timestamps_translate_sample", 2, dict(language="en", task="translate", return_timestamps=True,
                                                do_sample=True)),
    ])
    def test_whisper_from_input_features_equals_stock(self, _, batch, extra):
        model = build_whisper()
        feats = features(batch)
        stop = {}
        if not extra.get("return_timestamps"):
            with stock():
                tokens = model.generate(feats, max_new_tokens=10, **extra).tolist()
            stop = dict(eos_token_id=[EOT, *stops_early(tokens, 3)])  # rows stop at different steps

        def run(flag):
            criteria = {} if stop else dict(stopping_criteria=StoppingCriteriaList([StopAfterRepeat()]))
            return model.generate(feats, max_new_tokens=10, return_dict_in_generate=True, output_scores=True,
                                  output_logits=True, **stop, **criteria, **extra, **_flag(flag))

        ref = stock_then_flag(self, run)
        # short-form Whisper returns the new tokens alone
        self.assertLess(ref["sequences"].shape[1], 10, "the reference run must stop early")

    def test_whispers_returned_cache_continues_with_its_own_input_preparation(self):
        # the second call gives a decoder mask: Whisper's own preparation makes the positions from it at every step,
        # which the loop then calls (its inputs are not advanced by the loop)
        model = build_whisper()
        feats = features(2)

        def run(flag):
            first = model.generate(feats, max_new_tokens=5, return_dict_in_generate=True, **_flag(flag))
            cache = cache_kwarg.of_output(first)
            sequences = first["sequences"]
            second = model.generate(feats, decoder_input_ids=sequences, decoder_attention_mask=torch.ones_like(
                sequences), max_new_tokens=4, return_dict_in_generate=True, output_scores=True,
                **{cache_kwarg.name(): cache}, **_flag(flag))
            return sequences, second, int(cache.self_attention_cache.get_seq_length())

        with stock():
            torch.manual_seed(7)
            ref = run(None)
        with Spy() as spy:
            torch.manual_seed(7)
            out = run(True)
        assert_same(self, ref, out)
        self.assertEqual((spy.runs, spy.lean), (2, [True, False]))


class WhisperBenchCase(unittest.TestCase):
    def test_the_whisper_case_is_opt_in_whisper_small_shaped_and_runs_tiny_on_cpu_equal_to_stock(self):
        from test_bench import run_bench
        from transformers_async_stop.bench import catalog
        from transformers_async_stop.bench.encoder_decoder_cases import whisper_config

        builtin = catalog.builtin_cases()
        self.assertTrue(builtin["whisper-small"].opt_in)
        small = whisper_config()  # what CUDA builds (not built here: 242M parameters)
        self.assertEqual((small.d_model, small.encoder_layers, small.decoder_layers, small.num_mel_bins,
                          small.max_source_positions, small.vocab_size), (768, 12, 12, 80, 1500, 51865))
        code, result, _, _ = run_bench(["--cases", "whisper-small", "--variants", "stock,async", "--reps", "1",
                                        "--new-tokens", "6"], builtin)
        self.assertEqual(code, 0)
        (run,) = [r for r in result["runs"] if r["case"] == "whisper-small"]
        self.assertEqual(run["label"], "whisper-small eager b1")
        self.assertIsNone(run["error"])
        self.assertIs(run["variants"]["async"]["exact"], True)
        if TAKEN:
            self.assertIn("dynamic loop", run["variants"]["async"]["path"])


if __name__ == "__main__":
    unittest.main()
