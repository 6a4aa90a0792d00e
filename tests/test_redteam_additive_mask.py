"""Red team of the replay's additive masks (cb87ace, `graphs/piecewise/additive_mask.py`) and of the padded batch's
first decode step handed the loop's grown 4D mask (731270e, `loops/dynamic_loop/inputs.py`). The report:
docs/red-team/2026-11-29-additive-mask.md.

Every case runs on the CPU with the CUDA graphs emulated (`testing/emulation.py`) and the piecewise forward on, and
compares the flag-on call with unpatched transformers (sequences, scores, logits, the returned cache, the RNG state
after the call; and, where the point is what a user's code receives, what it received).

The holes it found, each fixed, its test unmarked:
- R1/R2 (additive masks): a user's `torch.nn.functional.scaled_dot_product_attention` (a wrapper or a replacement
  kernel installed the way SageAttention's README says) receives the float additive mask at replays where stock hands
  it the bool mask, is called twice per layer at a recording, and one that refuses float masks makes generate() raise
  where stock does not.
- R3 (predates both changes, the grown 4D mask of `wide_mask.py`): a Mistral whose `config.sliding_window` a callback
  sets mid-call keeps getting the grown full-attention mask; stock's forward switches to a sliding-window mask.
"""

from __future__ import annotations

import copy
import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from test_piecewise import _check_against_stock, _generate, build_any
from test_piecewise_sliding import _build as build_sliding, _check as check_sliding
from transformers_async_stop.graphs.piecewise import additive_mask, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24)
GREEDY = dict(do_sample=False, eos_token_id=None)


class _AtCall(LogitsProcessor):
    """Passes the scores through; at its `at`-th call runs `action` (a mid-call change a user's processor makes).
    Call 1 is the prefill's logits: before the first decode step's inputs are made."""

    def __init__(self, at, action):
        self.at, self.action, self.calls = at, action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return scores


class _CriterionAt(StoppingCriteria):
    def __init__(self, at, action):
        self.at, self.action, self.calls = at, action, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _PatchedTorchSdpa:
    """`torch.nn.functional.scaled_dot_product_attention` replaced by a user's function (a logging wrapper, or a
    kernel installed as `F.scaled_dot_product_attention = kernel`): it records the dtype of every mask it gets."""

    def __init__(self, refuse_float=False):
        self.real = torch.nn.functional.scaled_dot_product_attention
        self.refuse_float = refuse_float
        self.seen = []

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.seen.append(None if attn_mask is None else attn_mask.dtype)
        if self.refuse_float and attn_mask is not None and attn_mask.dtype != torch.bool:
            raise TypeError("this kernel takes a bool mask only")
        return self.real(query, key, value, attn_mask, *args, **kwargs)

    def __enter__(self):
        torch.nn.functional.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self.real


def _counting_conversions():
    return mock.patch.object(additive_mask, "of", wraps=additive_mask.of)


@unittest.skipUnless(RELEASES, "the piecewise forward's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class AdditiveMaskRedTeam(unittest.TestCase):

    def setUp(self):
        self.enterContext(emulated())

    def _stock_then_flag(self, model, ids, mask, call):
        """Stock's run, then the flag's, each with the kwargs `call()` makes afresh; outputs and RNG equal."""
        with stock():
            ref, ref_after = _generate(model, ids, mask, None, **call())
        out, after = _generate(model, ids, mask, True, **call())
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
        return ref, out

    def _graphed(self):
        forward = tas.last_path().forward or ""
        self.assertTrue(forward.startswith("graphed"), forward)
        return forward

    # -- change 1: who sees the additive mask ---------------------------------------------------------------------

    # R1 (fixed: `additive_mask.allowed` requires torch's own SDPA): a replay handed the user's torch SDPA the float
    # additive mask (and a recording called it twice per layer); stock hands it the bool mask once per layer
    def test_a_user_replaced_torch_sdpa_receives_what_stock_hands_it(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        kwargs = dict(max_new_tokens=8, **GREEDY)
        for _ in range(2):  # the recording's call, then a replaying one
            with stock(), _PatchedTorchSdpa() as ref:
                _generate(model, ids, mask, None, **kwargs)
            with _PatchedTorchSdpa() as out:
                _generate(model, ids, mask, True, **kwargs)
            self._graphed()
            self.assertEqual(out.seen, ref.seen)

    # R2 (fixed with R1): a user's torch SDPA that takes bool masks only: stock runs, the flag raised its TypeError
    # (raised by the recording's second attention run, `additive_mask.check`)
    def test_a_user_torch_sdpa_refusing_float_masks_raises_only_where_stock_does(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        with _PatchedTorchSdpa(refuse_float=True):
            self._stock_then_flag(model, ids, mask, lambda: dict(max_new_tokens=8, **GREEDY))

    def test_a_user_torch_sdpa_installed_with_the_shortcut_off_receives_the_bool_mask(self):
        # the same wrapper with the shortcut refused (`allowed` False): what it receives equals stock's; the
        # difference above is the shortcut's
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        kwargs = dict(max_new_tokens=8, **GREEDY)
        with mock.patch.object(additive_mask, "allowed", lambda fn: False):
            for _ in range(2):
                with stock(), _PatchedTorchSdpa() as ref:
                    _generate(model, ids, mask, None, **kwargs)
                with _PatchedTorchSdpa() as out:
                    _generate(model, ids, mask, True, **kwargs)
                self._graphed()
                self.assertEqual(out.seen, ref.seen)

    def test_a_torch_function_mode_sees_the_bool_masks_stock_hands_sdpa(self):
        from torch.overrides import TorchFunctionMode

        class Seen(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.nn.functional.scaled_dot_product_attention:
                    m = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                    self.seen.append(None if m is None else m.dtype)
                return func(*args, **kwargs)

        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        kwargs = dict(max_new_tokens=8, **GREEDY)
        _check_against_stock(self, model, ids, mask, **kwargs)  # recordings made outside the mode
        with stock(), Seen() as ref:
            _generate(model, ids, mask, None, **kwargs)
        with Seen() as out:
            _generate(model, ids, mask, True, **kwargs)
        self.assertEqual(out.seen, ref.seen)

    @parameterized.expand([("prefill_call", 1), ("mid_call", 4)])
    def test_a_user_sdpa_registered_by_a_processor_gets_bool_masks(self, _, at):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        _check_against_stock(self, model, ids, mask, max_new_tokens=10, **GREEDY)  # recordings made
        original = ALL_ATTENTION_FUNCTIONS["sdpa"]
        seen = []

        def user_sdpa(module, query, key, value, attention_mask, **kw):
            seen.append(None if attention_mask is None else attention_mask.dtype)
            return original(module, query, key, value, attention_mask, **kw)

        def swap():
            ALL_ATTENTION_FUNCTIONS["sdpa"] = user_sdpa

        try:
            runs = []
            for flag in (None, True):
                ALL_ATTENTION_FUNCTIONS["sdpa"] = original
                seen.clear()
                kwargs = dict(max_new_tokens=10, logits_processor=LogitsProcessorList([_AtCall(at, swap)]), **GREEDY)
                if flag is None:
                    with stock():
                        runs.append(_generate(model, ids, mask, None, **kwargs))
                else:
                    runs.append(_generate(model, ids, mask, True, **kwargs))
                runs[-1] = (runs[-1], list(seen))
        finally:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        (ref, ref_seen), (out, out_seen) = runs
        assert_same(self, ref[0], out[0])
        self.assertTrue(out_seen)
        self.assertEqual(out_seen, ref_seen)

    @parameterized.expand([(f"{name}_{dtype_name}", name, dtype)
                           for name in ("mistral_slides", "gemma3", "ministral")
                           for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))])
    def test_sliding_masks_that_turn_none_mid_call_equal_stock(self, _, name, dtype):
        # a window of 4-5 over a left-padded prompt of 6: early steps' sliding masks hold padding (bool), later ones
        # none (stock's `sdpa_mask` returns None); the full layers keep a bool mask. Recorded at either kind
        model = build_sliding(name, dtype=dtype)
        with _counting_conversions() as of:
            for batch in (3, 2):
                ids, mask = prompt(batch=batch, left_pad=True)
                if batch == 2:
                    ids[1, :4], mask[1, :4] = PAD, 0
                for sample in (False, True):
                    check_sliding(self, model, ids, mask, max_new_tokens=16, do_sample=sample, eos_token_id=None)
        if name != "ministral":  # its first recordings may wait for the automatic proof's confirmation
            self.assertGreater(of.call_count, 0)  # replays handed converted masks

    def test_eager_attention_gets_its_float_masks_unconverted(self):
        model = build("llama", attn="eager")
        ids, mask = prompt(batch=3, left_pad=True)
        with _counting_conversions() as of:
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=True, eos_token_id=None)
        self.assertEqual(of.call_count, 0)

    def test_train_mode_attention_dropout_equals_stock(self):
        model = build("llama", attention_dropout=0.3)
        model.train()
        ids, mask = prompt(batch=3, left_pad=True)
        with _counting_conversions() as of:
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=None)
        self.assertEqual(of.call_count, 0)

    def test_output_attentions_with_sdpa_padded_equals_stock(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, output_attentions=True, **GREEDY)

    @parameterized.expand([("greedy", False), ("sample", True)])
    def test_prompt_lookup_with_a_padded_prompt_equals_stock(self, _, sample):
        model = build("llama")
        ids = torch.tensor([[PAD, PAD, 3, 4, 5, 6, 3, 4, 5, 7, 3, 4]])
        mask = (ids != PAD).long()
        with _counting_conversions() as of:
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, prompt_lookup_num_tokens=3, max_new_tokens=24,
                                     do_sample=sample, eos_token_id=None)
        self.assertTrue((tas.last_path().verify or "").startswith("graphed"), tas.last_path().verify)
        self.assertGreater(of.call_count, 0)  # the verify's K-token bool masks converted

    def test_assisted_decoding_with_a_padded_prompt_equals_stock(self):
        target, helper = build("llama"), build("llama", seed=1)
        ids, mask = prompt(batch=1)
        ids[0, :2], mask[0, :2] = PAD, 0
        for _ in range(2):
            with stock():
                ref, ref_after = _generate(target, ids, mask, None, assistant_model=copy.deepcopy(helper),
                                           max_new_tokens=20, **GREEDY)
            out, after = _generate(target, ids, mask, True, assistant_model=copy.deepcopy(helper), max_new_tokens=20,
                                   **GREEDY)
            assert_same(self, ref, out)
            self.assertTrue(torch.equal(ref_after, after))

    def test_peft_lora_padded_equals_stock(self):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(build("llama"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0, init_lora_weights=False)).eval()
        ids, mask = prompt(batch=3, left_pad=True)
        for sample in (False, True, False):
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=sample, eos_token_id=None)

    # -- change 2: the first decode step's grown 4D mask ----------------------------------------------------------

    @parameterized.expand([("llama",), ("mistral",), ("qwen2",)])
    def test_first_step_of_a_padded_batch_of_one_equals_stock(self, family):
        model = build_any(family)
        ids, mask = prompt(batch=1)
        ids[0, :3], mask[0, :3] = PAD, 0
        for sample in (False, True):
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=sample, eos_token_id=None)
            self._graphed()

    def test_first_step_with_a_bool_prompt_mask_equals_stock(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask.bool(), max_new_tokens=10, **GREEDY)

    def test_first_step_with_inputs_embeds_equals_stock(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        embeds = model.get_input_embeddings()(ids).detach()

        def run(flag):
            torch.manual_seed(3)
            return model.generate(inputs_embeds=embeds, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8,
                                  return_dict_in_generate=True, output_scores=True, do_sample=True,
                                  eos_token_id=None, **({} if flag is None else {"async_stopping_criteria": flag}))

        for _ in range(2):
            with stock():
                ref = run(None)
            out = run(True)
            assert_same(self, ref, out)

    def test_a_returned_padded_cache_continued_in_a_second_call_equals_stock(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)

        def turns(flag):
            first, _ = _generate(model, ids, mask, flag, max_new_tokens=5, **GREEDY)
            seq = first.sequences
            more = torch.tensor([[5, 6], [7, 8], [9, 10]])
            ids2 = torch.cat([seq, more], dim=-1)
            mask2 = torch.cat([mask, torch.ones(3, seq.shape[1] - mask.shape[1] + 2, dtype=mask.dtype)], dim=-1)
            second, after = _generate(model, ids2, mask2, flag, max_new_tokens=6, do_sample=True,
                                      eos_token_id=None,
                                      **{cache_kwarg.name(): cache_kwarg.of_output(first)})
            return first, second, after

        for _ in range(2):
            with stock():
                ref = turns(None)
            out = turns(True)
            assert_same(self, ref[0], out[0])
            assert_same(self, ref[1], out[1])
            self.assertTrue(torch.equal(ref[2], out[2]))

    @parameterized.expand([("crop", 1), ("crop_later", 2), ("reset", 1)])
    def test_a_criterion_changing_the_cache_at_the_first_steps_equals_stock(self, kind, at):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        holder = {}

        def act():
            cache = holder["cache"]
            if kind == "reset":
                cache.reset()
            else:
                cache.crop(-1)  # relative: 5.24 refuses a positive length

        def call():
            from transformers import DynamicCache

            holder["cache"] = DynamicCache(config=model.config)
            return dict(max_new_tokens=8, **{cache_kwarg.name(): holder["cache"]},
                        stopping_criteria=StoppingCriteriaList([_CriterionAt(at, act)]), **GREEDY)

        for _ in range(2):
            self._stock_then_flag(model, ids, mask, call)

    @parameterized.expand([("prefill_call", 1), ("first_step", 2)])
    def test_set_attn_implementation_eager_by_a_processor_equals_stock(self, _, at):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)

        def call():
            model.set_attn_implementation("sdpa")
            return dict(max_new_tokens=8, logits_processor=LogitsProcessorList(
                [_AtCall(at, lambda: model.set_attn_implementation("eager"))]), **GREEDY)

        try:
            for _ in range(2):
                self._stock_then_flag(model, ids, mask, call)
        finally:
            model.set_attn_implementation("sdpa")

    @parameterized.expand([("decoder_layer", False), ("attention", True)])
    def test_a_hook_registered_by_a_processor_at_the_prefill_call_sees_stocks_mask(self, _, on_attention):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        target = model.model.layers[1].self_attn if on_attention else model.model.layers[1]
        seen, handles = [], []

        def hook(module, args, kwargs):
            m = kwargs.get("attention_mask")
            seen.append(None if m is None else (tuple(m.shape), m.stride(), m.dtype, m.tolist()))

        def register():
            handles.append(target.register_forward_pre_hook(hook, with_kwargs=True))

        runs = []
        try:
            for flag in (None, True):
                seen.clear()
                kwargs = dict(max_new_tokens=6, logits_processor=LogitsProcessorList([_AtCall(1, register)]),
                              **GREEDY)
                if flag is None:
                    with stock():
                        out = _generate(model, ids, mask, None, **kwargs)
                else:
                    out = _generate(model, ids, mask, True, **kwargs)
                while handles:
                    handles.pop().remove()
                runs.append((out, list(seen)))
        finally:
            while handles:
                handles.pop().remove()
        assert_same(self, runs[0][0][0], runs[1][0][0])
        self.assertTrue(runs[0][1])
        self.assertEqual(runs[1][1], runs[0][1])

    def test_mistral_sliding_window_set_at_the_prefill_call_equals_stock(self):
        model = build("mistral")

        def call():
            model.config.sliding_window = None
            return dict(max_new_tokens=8, logits_processor=LogitsProcessorList(
                [_AtCall(1, lambda: setattr(model.config, "sliding_window", 3))]), **GREEDY)

        ids, mask = prompt(batch=3, left_pad=True)
        try:
            for _ in range(2):
                self._stock_then_flag(model, ids, mask, call)
        finally:
            model.config.sliding_window = None

    # R3 (fixed: `wide_mask.Watch.holds` reads the family's window condition at every step; it predated both
    # changes): a Mistral's forward picks create_sliding_window_causal_mask from its config at every step; the loop
    # kept handing it the grown full-attention 4D mask, which that function returns as it is
    def test_mistral_sliding_window_set_mid_call_equals_stock(self):
        model = build("mistral")

        def call():
            model.config.sliding_window = None
            return dict(max_new_tokens=8, logits_processor=LogitsProcessorList(
                [_AtCall(3, lambda: setattr(model.config, "sliding_window", 3))]), **GREEDY)

        ids, mask = prompt(batch=3, left_pad=True)
        try:
            self._stock_then_flag(model, ids, mask, call)
        finally:
            model.config.sliding_window = None


if __name__ == "__main__":
    unittest.main()
