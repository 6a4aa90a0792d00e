"""The `async_stopping_criteria` field: defaults, validation, round trips, and every way a user can set it."""

from __future__ import annotations

import tempfile
import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig, PreTrainedTokenizerFast, pipeline

from models import PAD, VOCAB, CountForwards, build, eos_ids_finishing_at, prompt, stock


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def forwards_of(model, **kwargs):
    ids, mask = prompt()
    counter = CountForwards(model)
    try:
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
    finally:
        counter.close()
    return out, counter.count


class FlagField(unittest.TestCase):
    def test_unset_like_every_5x_field_and_resolved_to_false(self):
        config = GenerationConfig()
        self.assertIsNone(config.async_stopping_criteria)
        self.assertIn("async_stopping_criteria", config.to_dict())
        if hasattr(GenerationConfig, "_get_default_generation_params"):  # 5.x resolves unset fields from it
            self.assertIs(GenerationConfig._get_default_generation_params()["async_stopping_criteria"], False)

    def test_unset_flag_runs_the_stock_loop(self):
        model = build("llama")
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [1, 2, 2])
        with stock():
            ref, ref_forwards = forwards_of(model, max_new_tokens=10, eos_token_id=eos)
        out, forwards = forwards_of(model, max_new_tokens=10, eos_token_id=eos)
        self.assertListEqual(ref.tolist(), out.tolist())
        self.assertEqual(forwards, ref_forwards)

    @parameterized.expand([("int_one", 1), ("int_zero", 0), ("string", "yes"), ("none_string", "None"),
                           ("tensor", torch.tensor(True))])
    def test_non_bool_value_is_refused_with_its_name_and_value(self, _, value):
        for make in (lambda: GenerationConfig(async_stopping_criteria=value),
                     lambda: build("llama").generate(prompt()[0], max_new_tokens=2, pad_token_id=PAD,
                                                     async_stopping_criteria=value)):
            with self.assertRaises(ValueError) as ctx:
                make()
            message = str(ctx.exception)
            self.assertIn("async_stopping_criteria", message)
            self.assertIn(repr(value), message)
            self.assertIn("bool", message)

    def test_bad_value_on_model_generation_config_is_refused_at_generate(self):
        model = build("llama")
        model.generation_config.async_stopping_criteria = "on"
        with self.assertRaisesRegex(ValueError, "async_stopping_criteria.*'on'"):
            model.generate(prompt()[0], max_new_tokens=2, pad_token_id=PAD)

    def test_save_and_load_round_trip(self):
        config = GenerationConfig(async_stopping_criteria=True, max_new_tokens=5)
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            loaded = GenerationConfig.from_pretrained(tmp)
        self.assertIs(loaded.async_stopping_criteria, True)
        self.assertIs(GenerationConfig.from_dict(config.to_dict()).async_stopping_criteria, True)


class EveryWayToSetTheFlag(unittest.TestCase):
    """Each way of asking for the flag reaches the deferred loop (one extra forward on an early stop, undone)."""

    def setUp(self):
        self.model = build("llama")
        ids, mask = prompt()
        self.eos = eos_ids_finishing_at(self.model, ids, mask, [1, 2, 2])
        with stock():
            self.ref, self.ref_forwards = forwards_of(self.model, max_new_tokens=10, eos_token_id=self.eos)
        self.assertLess(self.ref.shape[1], ids.shape[1] + 10, "the reference run must stop early")

    def check(self, out, forwards):
        self.assertListEqual(self.ref.tolist(), out.tolist())
        self.assertEqual(forwards, self.ref_forwards + 1)

    def test_generate_keyword(self):
        self.check(*forwards_of(self.model, max_new_tokens=10, eos_token_id=self.eos, async_stopping_criteria=True))

    def test_generation_config_argument(self):
        config = GenerationConfig(async_stopping_criteria=True, max_new_tokens=10, eos_token_id=self.eos,
                                  pad_token_id=PAD)
        self.check(*forwards_of(self.model, generation_config=config))

    def test_model_generation_config(self):
        self.model.generation_config.async_stopping_criteria = True
        self.check(*forwards_of(self.model, max_new_tokens=10, eos_token_id=self.eos))

    def test_keyword_false_overrides_model_generation_config(self):
        self.model.generation_config.async_stopping_criteria = True
        out, forwards = forwards_of(self.model, max_new_tokens=10, eos_token_id=self.eos,
                                    async_stopping_criteria=False)
        self.assertListEqual(self.ref.tolist(), out.tolist())
        self.assertEqual(forwards, self.ref_forwards)


class Pipeline(unittest.TestCase):
    def test_text_generation_pipeline_matches_stock(self):
        model = build("llama")
        tokenizer = tiny_tokenizer()
        text = "w5 w9 w17 w33 w4"
        ids = tokenizer(text, return_tensors="pt").input_ids
        eos = eos_ids_finishing_at(model, ids, torch.ones_like(ids), [2])
        kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos)

        def run(**extra):
            counter = CountForwards(model)
            try:
                return pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")(
                    text, **kw, **extra), counter.count
            finally:
                counter.close()

        with stock():
            ref, ref_forwards = run()
        on, forwards = run(async_stopping_criteria=True)
        self.assertEqual(ref, on)
        self.assertEqual(forwards, ref_forwards + 1)  # the deferred loop ran, and its extra step was undone


if __name__ == "__main__":
    unittest.main()
