"""A failed capture or proof is tried again once what made it fail changed; the speed losses the red team of issue 43
saw either take the graphed forward or name how to get it.

A model whose recording failed used to stay eager for the rest of the process (its store remembered the failure, and
with no recording kept, nothing compared the model with what the failure was made from). Now the snapshot taken
before the first recording stays until it changes, with what the failed run looked up (its names and registries), and
a change clears the failures: the next step records again. Within one call a key that failed is not tried again (a
model whose own eager steps change what it ran would otherwise record at every step).

Each case on the CPU with the graphs emulated, flag against unpatched stock (sequences and logits).
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from family_models import build_family
from models import TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _generate
from transformers_async_stop.graphs.piecewise import forward
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)


class _EachStep(LogitsProcessor):
    def __init__(self, action):
        self.action, self.calls = action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        self.action(self.calls)
        return scores


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class FailedRecordingsTriedAgain(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)

    def _same(self, model, calls=2, **kwargs):
        for _ in range(calls):
            with stock():
                ref, _ = _generate(model, self.ids, self.mask, None, **_KW, **kwargs)
            out, _ = _generate(model, self.ids, self.mask, True, **_KW, **kwargs)
            self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
            for a, b in zip(ref.logits, out.logits):
                self.assertTrue(torch.equal(a, b), "logits differ from stock")
        return tas.last_path().forward

    def test_a_proof_refused_for_a_registered_function_is_tried_again_once_it_is_taken_out(self):
        from transformers.integrations import moe

        model = build_family("mixtral")
        scope = {"grouped": moe.ExpertsInterface._global_mapping["grouped_mm"]}
        exec(compile("def experts(module, *args, **kwargs):\n    return grouped(module, *args, **kwargs)\n",
                     __file__ + ".user_code", "exec"), scope)
        moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = scope["experts"]
        try:
            self.assertIn("code the package has not read ran", self._same(model))
        finally:
            moe.ALL_EXPERTS_FUNCTIONS._local_mapping.pop("grouped_mm", None)
        self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)

    def test_a_failed_capture_is_tried_again_after_the_experts_implementation_changed(self):
        model = build_family("mixtral")
        model.set_experts_implementation("eager")  # its routing reads the device on the host: the capture fails
        self.assertIn("capture failed", self._same(model))
        model.set_experts_implementation("grouped_mm")
        self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)
        model.set_experts_implementation("batched_mm")
        self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)

    def test_a_key_that_failed_is_not_recorded_again_in_the_same_call(self):
        # the model changes at every step (a processor edits a config field) while its capture keeps failing: one
        # recording per call, not one per step
        model = build_family("mixtral")
        model.set_experts_implementation("eager")
        recordings = []
        real = forward.record

        def counted(*args, **kwargs):
            recordings.append(1)
            return real(*args, **kwargs)

        def edit(step):
            model.config.tas_test_step = step

        try:
            with mock.patch.object(forward, "record", counted):
                for call in range(2):
                    processors = LogitsProcessorList([_EachStep(edit)])
                    with stock():
                        ref, _ = _generate(model, self.ids, self.mask, None, logits_processor=processors, **_KW)
                    before = len(recordings)
                    processors = LogitsProcessorList([_EachStep(edit)])
                    out, _ = _generate(model, self.ids, self.mask, True, logits_processor=processors, **_KW)
                    self.assertTrue(torch.equal(ref.sequences, out.sequences))
                    self.assertLessEqual(len(recordings) - before, 1, "a failed key recorded again within the call")
        finally:
            del model.config.tas_test_step


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class SpeedLossesNamedOrGraphed(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)

    def _same(self, model, **kwargs):
        return FailedRecordingsTriedAgain._same(self, model, **kwargs)

    def test_embeddings_resized_in_training_mode_take_the_graphed_forward(self):
        for family in ("llama", "olmo"):
            with self.subTest(family=family):
                model = build_family(family)
                model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
                self.assertTrue(model.get_input_embeddings().training or model.get_output_embeddings().training,
                                "resize_token_embeddings is expected to leave a new module in training mode")
                self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)

    def test_a_dropout_left_in_training_mode_keeps_the_forward_eager(self):
        model = build_family("gpt2")  # its blocks hold Dropout modules, which read their training mode
        model.transformer.drop.train()
        self.assertIn("training mode", self._same(model))

    def test_gradient_checkpointings_hook_is_named_with_how_to_remove_it(self):
        model = build_family("llama")
        model.gradient_checkpointing_enable()
        model.eval()
        why = self._same(model)
        self.assertIn("model.disable_input_require_grads() removes it", why)
        model.disable_input_require_grads()
        self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)

    def test_stop_strings_name_how_to_take_the_graphed_forward(self):
        from transformers import StopStringCriteria, StoppingCriteriaList

        from test_stop_strings import stop_string_tokenizer

        tokenizer = stop_string_tokenizer()
        model = build_family("llama", vocab_size=len(tokenizer))
        why = self._same(model, stop_strings=["abcdef"], tokenizer=tokenizer)
        self.assertIn("StopStringCriteria", why)
        criteria = StoppingCriteriaList([StopStringCriteria(tokenizer=tokenizer, stop_strings=["abcdef"])])
        self.assertTrue(self._same(model, stopping_criteria=criteria).startswith("graphed"), tas.last_path().forward)


if __name__ == "__main__":
    unittest.main()
