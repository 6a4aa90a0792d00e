"""The benchmark's assisted-decoding and prompt-lookup cases (bench/assisted.py) work end to end on CPU, on a small
Llama built from the same code as the Llama-1B-shaped cases. No assertion here is about time."""

from __future__ import annotations

import unittest
import warnings

import torch
from transformers import LlamaConfig

from test_bench import run_bench
from transformers_async_stop import StockPathWarning
from transformers_async_stop.loops.assisted.loop import installed_port
from transformers_async_stop.bench import assisted, catalog


def small_cases() -> dict:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256)
    return assisted.cases_with_prefix("small", config, new_tokens=12, prompt_len=24, dtype="fp32")


class AssistedCases(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        own = small_cases()
        cls.names = list(own)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls.code, cls.result, cls.markdown, cls.stdout = run_bench(
                ["--cases", ",".join(own), "--reps", "1", "--variants", "stock,async"],
                dict(catalog.builtin_cases(), **own))
        cls.stock_paths = [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]

    def test_every_case_runs_eager_and_equals_stock(self):
        self.assertEqual(self.code, 0)
        labels = [r["label"] for r in self.result["runs"] if r["case"] in self.names]
        self.assertEqual(labels, ["small-draft eager b1", "small-draft eager b1 sample", "small-copy eager b1",
                                  "small-lookup eager b1"])
        for run in self.result["runs"]:
            self.assertIsNone(run["error"], run["label"])
            self.assertIs(run["variants"]["async"]["exact"], True, run["label"])
        if installed_port() is not None:
            self.assertEqual(self.stock_paths, [], "the async rows took the deferred path")

    def test_acceptance_figures_are_reported(self):
        for run in self.result["runs"]:
            if run["case"] not in self.names:
                continue
            for v, m in run["variants"].items():
                self.assertGreater(m["rounds"], 0, run["label"])
                self.assertGreaterEqual(m["tokens_per_round"], 1.0)
                self.assertIsNone(m["syncs_per_round"])  # no CUDA
                if run["case"] == "small-copy" and run["decode"] == "greedy":
                    self.assertEqual(m["accept_rate"], 1.0, "a copy of the target accepts every greedy draft")
        for text in (self.stdout, self.markdown):
            self.assertIn("accept rate", text)
            self.assertIn("small-lookup eager b1", text)

    def test_lookup_target_echoes_its_last_token_so_lookup_has_ngrams_to_find(self):
        # an untouched random target rarely repeats an n-gram (none in 200 greedy tokens of the 1B one)
        target = small_cases()["small-lookup"].build(torch.device("cpu"), torch.float32)
        prompt = assisted.repetitive_prompt(target, 24)
        self.assertEqual(prompt[0, 8:].tolist(), [prompt[0, 7].item()] * 16)

    def test_drafts_share_the_targets_weights(self):
        own = small_cases()
        target = own["small-draft"].build(torch.device("cpu"), torch.float32)
        draft = assisted.make_draft(target, "shared")
        self.assertIs(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
        self.assertIs(draft.model.layers[assisted.DRAFT_LAYERS - 1], target.model.layers[assisted.DRAFT_LAYERS - 1])
        self.assertEqual(len(draft.model.layers), assisted.DRAFT_LAYERS)
        self.assertIs(draft.lm_head.weight, target.lm_head.weight)
        copy = assisted.make_draft(target, "copy")
        self.assertIs(copy.model, target.model)
        self.assertIsNot(copy.generation_config, target.generation_config)

    def test_drafts_are_in_eval_mode_like_their_target(self):
        # a new ModuleList starts in training mode: the shared draft's forward then stayed eager in every bench run
        # ("draft forward eager: training mode"), which stock's draft does not care about
        target = small_cases()["small-draft"].build(torch.device("cpu"), torch.float32).eval()
        for kind in ("shared", "copy"):
            draft = assisted.make_draft(target, kind)
            self.assertEqual([name for name, m in draft.named_modules() if m.training], [], kind)
        self.assertFalse(any(m.training for m in target.modules()))

    def test_the_cases_are_opt_in(self):
        builtin = catalog.builtin_cases()
        for name in ("llama-1b-draft", "llama-1b-copy", "llama-1b-lookup"):
            self.assertTrue(builtin[name].opt_in, name)
            self.assertFalse(builtin[name].tiny, name)


if __name__ == "__main__":
    unittest.main()
