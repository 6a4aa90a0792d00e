"""User code that runs between two decode steps of the graphed forward, from places the call's processors and
criteria do not show, and changes what a replay bakes in: the next step sees it, as stock's next forward does.

Issue 32's red team (2026-11-27) wrote these against a skip of the per-step staleness comparison where "only code the
package has read" runs between steps (`quiet.py`, withdrawn the same day): each found a way user code still runs
there, so the comparison stays on every step. Each case changes something a replay bakes in (the final norm's
epsilon, an attention's `scaling`) at one decode step; the reference is unpatched stock with the same change made at
the same point:
- Q1: a cyclic-gc finalizer of a user object, run by a collection inside a step;
- Q2: a user value held by transformers' own criterion (a float subclass's reflected comparison in `MaxTimeCriteria`);
- Q3: a torch function transformers' own processor looks up, rebound by the user (`torch.topk` of `TopKLogitsWarper`);
- Q4: a user attention function registered for "sdpa", which every replay calls eagerly;
- Q5: `DynamicCache.update` patched on the class, which every replay calls eagerly;
- Q6: that update changing an attribute the same step's attention reads after it: the graphed forward steps aside
  for a cache update or an attention function that is not transformers' own.
"""

from __future__ import annotations

import gc
import unittest
from unittest import mock

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation import stopping_criteria as sc

import transformers_async_stop as tas
from models import PAD, PROMPT_LEN, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
# the change lands after decode step 4 (1 records, 2-4 replay): step 5 must see it
CHANGED_AT = PROMPT_LEN + 5  # the sequence's length when the criteria of decode step 4 run


class Knob(StoppingCriteria):
    """Stock's reference: a user criterion that makes `change` once the sequence is `length` long (a user criterion
    keeps every full check, so the flag-on run sees it as stock does)."""

    def __init__(self, change, length=CHANGED_AT):
        self.change, self.length = change, length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.change()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class Deadline(float):
    """A `max_time` that runs code when `MaxTimeCriteria` compares with it (`elapsed > self.max_time` tries this
    subclass's reflected `__lt__` first): the `calls`-th comparison makes `change`."""

    def __new__(cls, value, change, calls):
        self = super().__new__(cls, value)
        self.change, self.calls, self.seen = change, calls, 0
        return self

    def __lt__(self, other):
        self.seen += 1
        if self.seen == self.calls:
            self.change()
        return float.__lt__(self, other)


class Finalized:
    """A user object in a reference cycle whose finalizer makes `change`: only the cyclic collector frees it."""

    def __init__(self, change):
        self.change, self.cycle = change, self

    def __del__(self):
        self.change()


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict("os.environ", {proof.PIECEWISE_ENV: "1"})
class ChangesBetweenStepsAreSeen(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)
        self._use(build("llama").eval())

    def _use(self, model):
        self.model = model
        self.eps = model.model.norm.variance_epsilon
        self.scaling = model.model.layers[0].self_attn.scaling

    def _reset(self):
        self.model.model.norm.variance_epsilon = self.eps
        self.model.model.layers[0].self_attn.scaling = self.scaling

    def _eps(self):
        self.model.model.norm.variance_epsilon = 0.5

    def _run(self, flag, **kwargs):
        torch.manual_seed(3)
        extra = {"async_stopping_criteria": True} if flag else {}
        kwargs.setdefault("do_sample", False)
        with torch.no_grad():
            return self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=10, pad_token_id=PAD,
                                       eos_token_id=None, return_dict_in_generate=True, output_scores=True,
                                       output_logits=True, **extra, **kwargs)

    def _stock_then_flag(self, stock_kwargs, flag_kwargs):
        with stock():
            want = self._run(False, **stock_kwargs)
        self._reset()
        got = self._run(True, **flag_kwargs)
        return want, got, tas.last_path().forward

    def test_a_user_finalizer_run_by_a_collection_inside_a_step_is_seen_by_the_next_step(self):
        # an automatic collection can fire at any allocation; here it fires inside decode step 4, after its checks
        # (or their skip) and before `vouch()`, which then takes the collector's count that already includes it
        own = forward.PiecewiseForward._replayed
        seen = []

        def replayed(piecewise, outputs):
            seen.append(1)
            if len(seen) == 4:  # decode step 4 (step 1's recording returns through `_replayed` too)
                Finalized(self._eps)
                gc.collect()  # stands for the automatic collection an allocation of the step's Python triggers
            return own(piecewise, outputs)

        with mock.patch.object(forward.PiecewiseForward, "_replayed", replayed):
            want, got, path = self._stock_then_flag(
                dict(stopping_criteria=StoppingCriteriaList([Knob(self._eps)])), {})
        assert_same(self, want, got)

    def test_a_user_value_held_by_a_read_criterion_runs_code_that_the_next_step_sees(self):
        # `MaxTimeCriteria` is read code, but `elapsed > self.max_time` runs the reflected `__lt__` of a float
        # subclass first: a user method runs between two steps. Call k of the criterion is at length PROMPT_LEN + k
        calls = CHANGED_AT - PROMPT_LEN
        want, got, path = self._stock_then_flag(
            dict(stopping_criteria=StoppingCriteriaList([sc.MaxTimeCriteria(Deadline(1e9, self._eps, calls))])),
            dict(stopping_criteria=StoppingCriteriaList([sc.MaxTimeCriteria(Deadline(1e9, self._eps, calls))])))
        assert_same(self, want, got)

    def test_a_torch_function_rebound_by_the_user_and_called_by_a_read_processor_is_seen(self):
        # `TopKLogitsWarper.__call__` is read, but it looks up `torch.topk` at each call: a user's wrapper runs
        # between two steps. Call k is at decode step k - 1 (the prefill's logits are call 1)
        own = torch.topk
        seen = []

        def topk(*args, **kwargs):
            seen.append(1)
            if len(seen) == CHANGED_AT - PROMPT_LEN:
                self._eps()
            return own(*args, **kwargs)

        with mock.patch.object(torch, "topk", topk):
            with stock():
                want = self._run(False, do_sample=True, top_k=5)
            self._reset()
            seen.clear()
            got = self._run(True, do_sample=True, top_k=5)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        assert_same(self, want, got)

    def test_a_user_attention_function_registered_for_sdpa_that_changes_a_module_is_seen(self):
        # a replay calls the registry's "sdpa" function eagerly for each layer (`_attention()`): user code runs inside
        # every step, after its checks and before `vouch()`. It halves layer 0's `scaling` (a plain attribute the
        # recording bakes into the attention's kwargs) at decode step 4; stock's step 5 passes the new one
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        attention = self.model.model.layers[0].self_attn

        def sdpa(module, query, key, value, attention_mask, **kwargs):
            if module is attention and key.shape[-2] == CHANGED_AT - 1:  # decode step 4's keys: the cache's length
                module.scaling = module.scaling * 0.5
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        with mock.patch.dict(AttentionInterface._global_mapping, {"sdpa": sdpa}):
            want, got, path = self._stock_then_flag({}, {})
        assert_same(self, want, got)

    def _with_a_class_patched_update(self, at_layer):
        """Stock against the flag with `DynamicCache.update` patched on the class: at decode step 4 (its key not in
        yet), the update of layer `at_layer` halves layer 0's attention `scaling`. Returns (stock, flag, path)."""
        from transformers.cache_utils import DynamicCache

        attention = self.model.model.layers[0].self_attn
        own = DynamicCache.update

        def update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == at_layer and cache.get_seq_length() == CHANGED_AT - 2:
                attention.scaling = attention.scaling * 0.5
            return own(cache, key_states, value_states, layer_idx, *args, **kwargs)

        with mock.patch.object(DynamicCache, "update", update):
            return self._stock_then_flag({}, {})

    def test_a_cache_update_patched_on_transformers_class_that_changes_a_module_is_seen(self):
        # a replay calls `type(cache).update` eagerly for each layer: the change made at layer 1 (after layer 0's
        # attention read its `scaling`) is seen from the next step on
        want, got, path = self._with_a_class_patched_update(at_layer=1)
        assert_same(self, want, got)

    def test_a_module_attribute_changed_by_a_class_patched_cache_update_is_read_by_the_same_step(self):
        # stock's attention reads `scaling=self.scaling` after its `cache.update`: the change made at layer 0's update
        # takes effect in the same step, where a replay would pass the recorded value (the forward stays eager)
        want, got, path = self._with_a_class_patched_update(at_layer=0)
        assert_same(self, want, got)
        self.assertIn("a cache update that is not transformers' own", path)

    def test_a_tensor_subclass_mask_whose_torch_function_changes_the_model_equals_stock(self):
        # holds: `between_steps_read` does not look at the call's tensors, but a mask of a tensor subclass (whose
        # `__torch_function__` runs at every `torch.cat` of the loop) gives subclass positions, which the graphed
        # forward does not take: every step runs eagerly, so nothing is skipped
        change = self._eps

        class Watched(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                result = super().__torch_function__(func, types, args, kwargs or {})
                if func is torch.cat and isinstance(result, torch.Tensor) and result.shape[-1] == CHANGED_AT:
                    change()
                return result

        plain = self.mask
        self.mask = plain.as_subclass(Watched)
        try:
            with stock():
                want = self._run(False)
            self._reset()
            got = self._run(True)
        finally:
            self.mask = plain
        self.assertTrue(tas.last_path().forward.startswith("eager"), tas.last_path().forward)
        assert_same(self, want, got)

    def test_a_processor_list_of_transformers_own_classes_still_equals_stock(self):
        # holds: the skip with generation-config processors and no outside code (and the skip does happen)
        kwargs = dict(do_sample=True, top_k=5, top_p=0.9, temperature=0.8, repetition_penalty=1.3,
                      no_repeat_ngram_size=2, sequence_bias={(5,): -1.0}, max_time=1e9)
        want, got, path = self._stock_then_flag(kwargs, kwargs)
        assert_same(self, want, got)
        self.assertTrue(path.startswith("graphed"), path)

    def test_an_assistant_changed_between_rounds_by_a_hook_of_the_target_is_seen(self):
        # holds: the draft loop's steps skip their checks, but each round's draft call has a new `Quiet`; a forward
        # hook of the target model, run between rounds, changes the assistant's final norm at the second round
        # (sampled: the accepted tokens depend on the draft's probabilities)
        helper = build("llama", seed=1).eval()
        eps = helper.model.norm.variance_epsilon
        calls = []

        def hook(module, args, output):
            calls.append(1)
            if len(calls) == 2:
                helper.model.norm.variance_epsilon = 0.5

        def run(flag):
            calls.clear()
            torch.manual_seed(3)
            extra = {"async_stopping_criteria": True} if flag else {}
            with torch.no_grad():
                return self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=16, pad_token_id=PAD,
                                           eos_token_id=None, do_sample=True, assistant_model=helper,
                                           return_dict_in_generate=True, output_scores=True, output_logits=True,
                                           **extra)

        handle = self.model.register_forward_hook(hook)
        self.addCleanup(handle.remove)
        with stock():
            want = run(False)
        helper.model.norm.variance_epsilon = eps
        got = run(True)
        self.assertIn("draft graphed", tas.last_path().forward)
        assert_same(self, want, got)

    def test_phi3s_own_input_preparation_each_step_still_equals_stock(self):
        # holds: Phi-3 keeps stock's `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation` at
        # every step (read code, `_OWN_INPUTS`); the steps between them skip their checks
        self._use(build("phi3").eval())
        kwargs = dict(do_sample=True, top_k=5)
        want, got, path = self._stock_then_flag(kwargs, kwargs)
        assert_same(self, want, got)
        self.assertTrue(path.startswith("graphed"), path)

    def test_a_change_made_before_a_second_call_is_seen(self):
        # holds: the vouch does not carry across calls (a new `Quiet` per call; its first step records or checks)
        first = self._run(True)
        self._eps()
        with stock():
            want = self._run(False)
        got = self._run(True)
        self.assertFalse(torch.equal(first.sequences, want.sequences) and torch.equal(first.logits[-1],
                                                                                       want.logits[-1]))
        assert_same(self, want, got)


if __name__ == "__main__":
    unittest.main()
