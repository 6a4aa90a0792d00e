"""Issue 25, the static-cache loop: usage that real callers have and that must give unpatched stock's output.

Each test runs one call (or a few) on unpatched transformers and with `async_stopping_criteria=True` on a static
cache, and compares everything observable bit for bit (sequences, scores, logits and their aliasing, what callbacks
received, exceptions, the RNG draw after the call). On CPU the loop's eager tail runs (forced deferred path); the
CUDA case (`StaticLoopUsageCuda`) runs the same tests on the captured tail.

- autograd contexts: `torch.inference_mode()` around generate() (the blog's experiment shape), a prompt made inside
  it, `no_grad`, none; in-place edits of the ids by a criterion or a processor under each (the loop must not read
  private tensor state such as `_version`, which raises for inference tensors);
- a criterion answering with shape (batch, 1): stock broadcasts `unfinished & ~is_done`;
- a processor that narrows or widens the scores ahead of the sequence-reading built-ins;
- things user code changes mid-call: a forward hook, the attention implementation, `cache.reset()`, a class-level
  wrapper installed between two calls;
- `out.scores[i]` / `out.logits[i]` aliasing as stock's.
"""

from __future__ import annotations

import contextlib
import functools
import unittest

import torch
from parameterized import parameterized
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from loop_callbacks import ChangeAtStep
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop import last_path

LOOP_RELEASES = TRANSFORMERS_VERSION >= (5, 17)
CUDA = torch.cuda.is_available()


def _norm(x):
    """What a callback saw, copied (a later in-place change must not rewrite the record)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items() if k != "past_key_values"}
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    return x


class EditLastToken(StoppingCriteria):
    """Writes `token` into the last column of the ids it is handed at its call number `at`; never stops."""

    def __init__(self, at, token=7):
        self.at, self.token, self.calls, self.seen = at, token, 0, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        self.seen.append(input_ids.clone())
        if self.calls == self.at:
            input_ids[:, -1] = self.token
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class EditIdsProcessor(LogitsProcessor):
    """Edits the ids it is handed in place (its first column) at its call number `at`, and reads them."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            input_ids[:, 0].add_(1)
        return scores - 0.01 * input_ids[:, -1:].float()


class LastTokenIs(StoppingCriteria):
    """A common slip: `input_ids[:, -1:] == token` answers with shape (batch, 1)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1:] == self.token


class Width(LogitsProcessor):
    """Narrows the scores to their first `width` columns, or widens them with -inf columns."""

    def __init__(self, width):
        self.width = width

    def __call__(self, input_ids, scores):
        if self.width <= scores.shape[-1]:
            return scores[:, : self.width]
        pad = scores.new_full((scores.shape[0], self.width - scores.shape[-1]), -float("inf"))
        return torch.cat([scores, pad], dim=-1)


class StaticLoopUsage(unittest.TestCase):
    device = "cpu"

    def setUp(self):
        if not LOOP_RELEASES:
            self.skipTest("the static-cache loop is taken on transformers 5.17+")

    def model(self, **overrides):
        return build("llama", device=self.device, **overrides)

    def ids(self, batch=3, left_pad=True):
        return prompt(batch=batch, left_pad=left_pad, device=self.device)

    def kwargs(self, mask, **extra):
        kw = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None,
                  cache_implementation="static")
        if self.device != "cpu":
            kw["disable_compile"] = True
        kw.update(extra)
        return kw

    def both(self, run, static_loop=True):
        """`run(flag_kwargs)` on stock and with the flag: (stock's result, the flag's); each an (exception) tuple
        where it raised; the RNG draw after the call appended."""
        results = []
        for flag in (False, True):
            with stock() if not flag else contextlib.nullcontext():
                torch.manual_seed(0)
                try:
                    result = run(dict(async_stopping_criteria=True) if flag else {})
                except Exception as error:  # noqa: BLE001 - an exception is an observable: type and message
                    result = ("raised", type(error).__name__, str(error))
                results.append((result, torch.rand(4, device=self.device)))
        if static_loop:
            self.assertEqual(last_path().path, "static loop", last_path())
        return results

    def assert_as_stock(self, run, static_loop=True, may_raise=False):
        ref, on = self.both(run, static_loop)
        assert_same(self, ref, on)
        if not may_raise:
            self.assertNotEqual(ref[0][0] if isinstance(ref[0], tuple) else None, "raised", ref[0])
        return ref, on

    # --- 1: autograd contexts ------------------------------------------------------------------------------------
    @parameterized.expand([(f"{s}_{m}", s, m) for s in ("greedy", "sampling") for m in ("min_new", "plain")])
    def test_inference_mode_decorated_generate_on_a_static_cache(self, _, decoding, minimum):
        # the blog's experiment: a static-cache generate() inside `@torch.inference_mode()`
        model = self.model()
        ids, mask = self.ids(batch=1, left_pad=False)
        extra = dict(do_sample=decoding == "sampling", eos_token_id=[5, 9])
        if minimum == "min_new":
            extra["min_new_tokens"] = 4

        @torch.inference_mode()
        def run(flag):
            return model.generate(ids, **self.kwargs(mask, max_new_tokens=12, **extra, **flag))

        self.assert_as_stock(run)

    @parameterized.expand([("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad),
                           ("none", contextlib.nullcontext)])
    def test_callbacks_editing_the_ids_in_place_under_each_autograd_context(self, _, context):
        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            criterion, processor = EditLastToken(at=2), EditIdsProcessor(at=3)
            with context():
                out = model.generate(ids, **self.kwargs(
                    mask, stopping_criteria=StoppingCriteriaList([criterion]),
                    logits_processor=LogitsProcessorList([processor]), return_dict_in_generate=True,
                    output_scores=True, repetition_penalty=1.5, no_repeat_ngram_size=2, **flag))
            return out, criterion.seen

        self.assert_as_stock(run)

    def test_a_prompt_made_in_inference_mode_then_generate_outside_it(self):
        model = self.model()
        with torch.inference_mode():
            ids, mask = self.ids()

        def run(flag):
            criterion = EditLastToken(at=2)
            out = model.generate(ids, **self.kwargs(mask, stopping_criteria=StoppingCriteriaList([criterion]),
                                                    repetition_penalty=1.3, **flag))
            return out, criterion.seen

        self.assert_as_stock(run)

    def test_sequence_bias_and_bad_words_under_inference_mode(self):
        model = self.model()
        ids, mask = self.ids()

        @torch.inference_mode()
        def run(flag):
            return model.generate(ids, **self.kwargs(mask, sequence_bias={(17,): -3.0, (4, 9): 2.0},
                                                     bad_words_ids=[[11], [3, 8]], **flag))

        self.assert_as_stock(run)

    def test_a_captured_builtins_tensor_edited_in_place_mid_call(self):
        # the guards compare tensors by identity and layout only: a replay reads the tensor's memory, as stock does
        from transformers import EncoderRepetitionPenaltyLogitsProcessor

        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            processor = EncoderRepetitionPenaltyLogitsProcessor(3.0, encoder_input_ids=ids.clone())
            criterion = ChangeAtStep(3, lambda: processor.encoder_input_ids[:, :4].fill_(int(ids[0, -1]) + 1))
            with torch.inference_mode():
                return model.generate(ids, **self.kwargs(
                    mask, logits_processor=LogitsProcessorList([processor]),
                    stopping_criteria=StoppingCriteriaList([criterion]), return_dict_in_generate=True,
                    output_scores=True, **flag))

        self.assert_as_stock(run)

    # --- 3: a criterion answering (batch, 1) ---------------------------------------------------------------------
    @parameterized.expand([("no_eos", None), ("eos", [2])])
    def test_a_criterion_answering_batch_by_one_is_broadcast_as_in_stock(self, _, eos):
        # stock: `unfinished & ~is_done` broadcasts to (batch, batch); with an EOS criterion stock then raises at the
        # next step's `torch.cat` (the padded tokens have two dims)
        model = self.model()
        ids, mask = self.ids()
        with stock():
            first = model.generate(ids, **self.kwargs(mask, max_new_tokens=3))[0, -2].item()

        def run(flag):
            return model.generate(ids, **self.kwargs(mask, eos_token_id=eos, stopping_criteria=StoppingCriteriaList(
                [LastTokenIs(first)]), **flag))

        self.assert_as_stock(run, may_raise=eos is not None)
        if eos is None:  # the rest of the call ran eagerly on stock's broadcast `unfinished_sequences`
            self.assertIn("unfinished_sequences", last_path().reason or "", last_path())

    # --- 5: processors that change the scores' width -------------------------------------------------------------
    @parameterized.expand([(f"{kind}_{w}", kind, w) for kind in ("repetition", "ngram") for w in (40, 52)])
    def test_a_processor_changing_the_width_ahead_of_a_sequence_reading_builtin(self, _, kind, width):
        model = self.model()
        ids, mask = self.ids()
        builtin = (RepetitionPenaltyLogitsProcessor(1.5) if kind == "repetition"
                   else NoRepeatNGramLogitsProcessor(2))

        def run(flag):
            return model.generate(ids, **self.kwargs(mask, return_dict_in_generate=True, output_scores=True,
                                                     logits_processor=LogitsProcessorList([Width(width), builtin]),
                                                     **flag))

        self.assert_as_stock(run, may_raise=True)

    # --- 7: changes stock sees at the next step ------------------------------------------------------------------
    @parameterized.expand([("before_the_call", 0), ("at_the_first_step", 1), ("at_the_second_step", 2)])
    def test_a_forward_hook_registered_by_a_criterion_mid_call(self, _, at):
        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            seen, handles = [], []

            def hook(module, args, kwargs):
                seen.append(_norm(kwargs))
                seen.append(kwargs.get("attention_mask"))  # kept by reference, as a hook may
                seen.append(kwargs.get("position_ids"))

            def register():
                handles.append(model.model.layers[-1].register_forward_pre_hook(hook, with_kwargs=True))

            if at == 0:
                register()
            criterion = ChangeAtStep(at, register)
            try:
                out = model.generate(ids, **self.kwargs(mask, stopping_criteria=StoppingCriteriaList([criterion]),
                                                        **flag))
            finally:
                for handle in handles:
                    handle.remove()
            return out, seen

        self.assert_as_stock(run)
        # last_path() says the call left its plan of in-place inputs
        self.assertIn("hook", last_path().reason or "", last_path())
        self.assertIn("left its plan", last_path().describe())

    def test_the_attention_implementation_changed_by_a_criterion_mid_call(self):
        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            seen = []
            model.set_attn_implementation("sdpa")
            handle = model.model.layers[0].self_attn.register_forward_pre_hook(
                lambda module, args, kwargs: seen.append(_norm(kwargs.get("attention_mask"))), with_kwargs=True)
            criterion = ChangeAtStep(2, lambda: model.set_attn_implementation("eager"))
            try:
                out = model.generate(ids, **self.kwargs(mask, stopping_criteria=StoppingCriteriaList([criterion]),
                                                        **flag))
            finally:
                handle.remove()
                model.set_attn_implementation("sdpa")
            return out, seen

        self.assert_as_stock(run)

    def test_a_static_cache_reset_by_a_criterion_mid_call(self):
        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            cache = StaticCache(config=model.config, max_cache_len=40)
            criterion = ChangeAtStep(3, cache.reset)
            out = model.generate(ids, **self.kwargs(mask, past_key_values=cache, cache_implementation=None,
                                                    stopping_criteria=StoppingCriteriaList([criterion]), **flag))
            return out, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

        self.assert_as_stock(run)

    def test_a_class_level_processor_wrapper_installed_after_a_first_flag_on_call(self):
        # the verdicts on the installed sources are kept per process: a wrapper installed later must be noticed
        from transformers.generation import logits_process as lp

        model = self.model()
        ids, mask = self.ids()
        original = lp.TopKLogitsWarper.__call__
        calls = []

        def counting(self_, input_ids, scores):  # not a pure function of its inputs: stock calls it every step
            calls.append(1)
            return original(self_, input_ids, scores) - 0.01 * len(calls)

        def run(flag):
            calls.clear()
            return model.generate(ids, **self.kwargs(mask, do_sample=True, top_k=10, **flag))

        self.assert_as_stock(run)  # first calls: the verdicts are taken on the original source
        lp.TopKLogitsWarper.__call__ = counting
        try:
            self.assert_as_stock(run, static_loop=False)
        finally:
            lp.TopKLogitsWarper.__call__ = original
        self.assert_as_stock(run)  # the original back: the loop again

    @parameterized.expand([("plain", False), ("functools_wraps", True)])
    def test_a_source_rebound_after_its_verdict_turns_its_shortcut_off(self, _, wraps):
        from transformers.generation import logits_process as lp

        from transformers_async_stop.release_checks.verified import matches

        original = lp.TopKLogitsWarper.__call__
        self.assertTrue(matches("static decode loop"))  # the verdict, taken on the original and kept

        def counting(self_, input_ids, scores):
            return original(self_, input_ids, scores)

        lp.TopKLogitsWarper.__call__ = functools.wraps(original)(counting) if wraps else counting
        try:
            self.assertFalse(matches("static decode loop"))
        finally:
            lp.TopKLogitsWarper.__call__ = original
        self.assertTrue(matches("static decode loop"))

    # --- 8: aliasing --------------------------------------------------------------------------------------------
    @parameterized.expand([("no_processor", []), ("a_view", [Width(40)]), ("temperature", None)])
    def test_scores_and_logits_share_what_they_share_in_stock(self, _, processors):
        model = self.model()
        ids, mask = self.ids()

        def run(flag):
            extra = dict(do_sample=True, temperature=0.7) if processors is None else {}
            if processors:
                extra["logits_processor"] = LogitsProcessorList(processors)
            out = model.generate(ids, **self.kwargs(mask, return_dict_in_generate=True, output_scores=True,
                                                    output_logits=True, **extra, **flag))
            shared = [(s is l, s.untyped_storage().data_ptr() == l.untyped_storage().data_ptr())
                      for s, l in zip(out.scores, out.logits)]
            out.logits[0].fill_(1.0)  # the caller edits one afterwards: stock's aliasing shows in the other
            return out, shared

        self.assert_as_stock(run)


@unittest.skipUnless(CUDA, "CUDA only")
class StaticLoopUsageCuda(StaticLoopUsage):
    """The same usage on the GPU, where the loop's tail is captured into CUDA graphs and replayed."""

    device = "cuda"

    @parameterized.expand([("greedy", False), ("sampling", True)])
    def test_the_blog_experiment_with_the_compiled_forward(self, _, sampling):
        # as the blog ran it: `@torch.inference_mode()`, a static cache, the forward compiled by generate() itself
        model = self.model()
        ids, mask = self.ids(batch=1, left_pad=False)

        @torch.inference_mode()
        def run(flag):
            return model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=4, pad_token_id=PAD,
                                  eos_token_id=[5, 9], do_sample=sampling, cache_implementation="static", **flag)

        self.assert_as_stock(run)
        self.assertEqual(last_path().tail, "captured", last_path())
        self.assertIsNone(last_path().reason, "the call kept its plan (in-place inputs, captured tail) throughout")


if __name__ == "__main__":
    unittest.main()
