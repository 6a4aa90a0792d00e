"""Things stock decides at every step that a callback may change mid-call (issue 25, item 7), on the dynamic-cache loop.

For a padded batch the loop hands the model a 4D mask it grows by a column per step (`dynamic_loop/wide_mask.py`),
decided at the first decode step from what was true then: no hook on the model, SDPA, the model's forwards the ones
read. Stock rebuilds the 4D mask inside every forward from the 2D one, so whatever changes mid-call, it honours at the
next step. Each test changes one thing (from a criterion, or between two calls) and compares with unpatched stock:
the sequences, scores and logits, the RNG state, the exception, and what a hook or wrapper saw (values, shape,
dtype, strides of every tensor keyword).
"""

from __future__ import annotations

import functools
import unittest

import pytest
import torch
from parameterized import parameterized
from transformers import DynamicCache, LlamaForCausalLM, LlamaModel, StoppingCriteriaList

from loop_callbacks import ChangeAtStep
from models import PAD, assert_same, build, prompt, stock
from test_dynamic_loop import TAKEN

needs_loop = unittest.skipUnless(TAKEN, "the dynamic-cache loop is taken on transformers 5.17-5.23")


def _seen(kwargs):
    return {key: (value.detach().clone(), value.dtype, tuple(value.shape), value.stride())
            for key, value in sorted(kwargs.items()) if isinstance(value, torch.Tensor)}


class Seen:
    """What a hook or wrapper saw, call by call."""

    def __init__(self):
        self.calls = []

    def pre_hook(self, module, args, kwargs):
        self.calls.append(_seen(kwargs))

    def wrap(self, forward):
        @functools.wraps(forward)
        def wrapper(module, *args, **kwargs):
            self.calls.append(_seen(kwargs))
            return forward(module, *args, **kwargs)
        return wrapper


def _generate(model, ids, mask, flag, criteria=(), cache=None):
    torch.manual_seed(0)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=9, pad_token_id=PAD, eos_token_id=None,
                             do_sample=True, top_k=10, stopping_criteria=StoppingCriteriaList(list(criteria)),
                             return_dict_in_generate=True, output_scores=True, output_logits=True,
                             **({} if cache is None else dict(past_key_values=cache)),
                             **({} if flag is None else dict(async_stopping_criteria=flag)))
        result = (out.sequences, out.scores, out.logits)
    except Exception as error:
        result = (type(error).__name__, str(error))
    return result, torch.rand(3)


@needs_loop
class MidCallChangesEqualStock(unittest.TestCase):
    def _both(self, run):
        with stock():
            ref = run(None)
        on = run(True)
        assert_same(self, ref, on)
        return ref

    @parameterized.expand([("model", False), ("base_model", False), ("model_with_global_hook", True)])
    @pytest.mark.core
    def test_a_hook_registered_mid_call_sees_stocks_inputs(self, where, global_hook):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)

        def run(flag):
            seen, handles = Seen(), []
            target = model if where != "base_model" else model.model

            def register():
                if global_hook:
                    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(
                        lambda module, args: None))
                handles.append(target.register_forward_pre_hook(seen.pre_hook, with_kwargs=True))

            try:
                out = _generate(model, ids, mask, flag, [ChangeAtStep(3, register)])
            finally:
                for handle in handles:
                    handle.remove()
            return out, seen.calls

        ref = self._both(run)
        self.assertTrue(ref[1], "the hook ran")

    @parameterized.expand([("eager",), ("sdpa_then_eager",)])
    def test_the_attention_implementation_changed_mid_call_is_honoured(self, _):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)

        def run(flag):
            model.set_attn_implementation("sdpa")
            try:
                return _generate(model, ids, mask, flag, [ChangeAtStep(3, lambda: model.set_attn_implementation(
                    "eager"))])
            finally:
                model.set_attn_implementation("sdpa")

        self._both(run)

    @parameterized.expand([("causal_lm", LlamaForCausalLM), ("base_model", LlamaModel)])
    @pytest.mark.core
    def test_a_class_level_forward_wrapper_installed_after_a_first_call_sees_stocks_inputs(self, _, cls):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        _generate(model, ids, mask, True)  # a first flag-on call: the model's sources read and found as read
        original = cls.__dict__["forward"]
        seen = Seen()

        def run(flag):
            seen.calls.clear()
            cls.forward = seen.wrap(original)
            try:
                out = _generate(model, ids, mask, flag)
            finally:
                cls.forward = original
            return out, list(seen.calls)  # (no EOS: the flag's run stops at max_new_tokens, as stock, no extra step)

        self._both(run)

    @parameterized.expand([("causal_lm", LlamaForCausalLM), ("base_model", LlamaModel)])
    def test_a_class_level_forward_wrapper_installed_mid_call_sees_stocks_inputs(self, _, cls):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        original = cls.__dict__["forward"]
        seen = Seen()

        def run(flag):
            seen.calls.clear()
            try:
                out = _generate(model, ids, mask, flag,
                                [ChangeAtStep(3, lambda: setattr(cls, "forward", seen.wrap(original)))])
            finally:
                cls.forward = original
            return out, list(seen.calls)

        self._both(run)

    @parameterized.expand([(name, padded) for name in ("reset", "crop") for padded in (True, False)])
    def test_a_cache_changed_mid_call_gives_stocks_output(self, name, padded):
        change = {"reset": lambda cache: cache.reset(), "crop": lambda cache: cache.crop(-2)}[name]
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=padded)

        def run(flag):
            cache = DynamicCache(config=model.config)
            return _generate(model, ids, mask, flag, [ChangeAtStep(3, lambda: change(cache))], cache=cache)

        self._both(run)


if __name__ == "__main__":
    unittest.main()
