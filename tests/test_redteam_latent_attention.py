"""Red team of the derivation cut (`attention.Cut.derive`): multi-head latent attention's graphed decode forward.

Each case compares the flag's output with unpatched transformers (stock) on a tiny model built from its config (as
`test_piecewise_latent_attention.build_latent` does), the graphs emulated on the CPU: usages (inputs_embeds, a
returned cache continued, MoE layers first, bf16, inference mode, a second model of the class, assisted decoding and
prompt lookup with a latent target, a draft of the target's class, Mistral 4's position-scaled query in the
derivation's piece), user code in and around `expand_kv` (an instance-level one or a class-level partialmethod, a
subclass, another transformers derivation, hooks on `kv_b_proj`, a peft LoRA on `kv_b_proj`/`q_b_proj`, `torch.split`
rebound) and changes a stopping criterion makes mid-call (the router's correction bias replaced or its storage
rebound, `rope_interleave`, the attention's `scaling`, `kv_b_proj`'s weight, Mistral 4's `llama_4_scaling_beta`
mutated inside `rope_parameters`). All held on 5.24, 5.23 and 5.17 when written: each pins stock's output.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import unittest

import torch
import transformers
from transformers import StoppingCriteria

import transformers_async_stop as tas
from transformers_async_stop.release_checks import cache_kwarg
from models import PAD, TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _cache_name, _check_against_stock, _generate
from latent_models import _SIZES, available, build_latent
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
GREEDY = dict(do_sample=False, eos_token_id=None)


def _attn_cls(model):
    return type(model.model.layers[0].self_attn)


class AtStep(StoppingCriteria):
    """Calls `action()` once, at the end of decode step `step` (a user's mid-call change)."""

    def __init__(self, step, action):
        self.step, self.action, self.steps = step, action, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.steps == self.step:
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _same(test, ref, out):
    test.assertTrue(torch.equal(ref.sequences, out.sequences), f"{ref.sequences}\n{out.sequences}")
    for a, b in zip(ref.logits, out.logits):
        test.assertTrue(torch.equal(a, b), "logits differ")


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
class RedTeamLatent(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def _model(self, family="deepseek_v3", **overrides):
        if not available(family):
            self.skipTest(f"{family} not in {transformers.__version__}")
        if not overrides:
            return build_latent(family)
        config = transformers.AutoConfig.for_model(family, **{**_SIZES, **overrides})
        config.initializer_range = 0.5
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

    def _mid_call(self, model, make_action, undo, steps=10, prime=True, **kwargs):
        """stock and the flag, each with a criterion applying `make_action()` at step 4; `undo()` after each."""
        ids, mask = prompt(batch=1)
        if prime:  # a first call records: the one below replays
            _check_against_stock(self, model, ids, mask, max_new_tokens=4, **GREEDY)
        try:
            with stock():
                ref, _ = _generate(model, ids, mask, None, max_new_tokens=steps, stopping_criteria=[
                    AtStep(4, make_action)], **GREEDY, **kwargs)
            undo()
            out, _ = _generate(model, ids, mask, True, max_new_tokens=steps, stopping_criteria=[
                AtStep(4, make_action)], **GREEDY, **kwargs)
        finally:
            undo()
        _same(self, ref, out)
        return out

    # ---- usages

    def test_inputs_embeds_equals_stock(self):
        model = self._model()
        ids, mask = prompt(batch=1)
        embeds = model.get_input_embeddings()(ids)
        for _ in range(2):
            with stock():
                torch.manual_seed(0)
                ref = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD,
                                     **GREEDY)
            torch.manual_seed(0)
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD,
                                 async_stopping_criteria=True, **GREEDY)
            self.assertTrue(torch.equal(ref, out))
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)

    def test_a_returned_cache_continued_equals_stock(self):
        model = self._model()
        ids, mask = prompt(batch=1)
        kwargs = dict(max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, **GREEDY)
        results = []
        for flag in (None, True):
            ctx = stock() if flag is None else contextlib.nullcontext()
            with ctx:
                extra = {} if flag is None else {"async_stopping_criteria": True}
                first = model.generate(ids, attention_mask=mask, **kwargs, **extra)
                ids2 = torch.cat([first.sequences, ids[:, :2]], dim=-1)
                second = model.generate(ids2, attention_mask=torch.ones_like(ids2),
                                        **{_cache_name(): cache_kwarg.of_output(first)}, **kwargs, **extra)
                results.append((first.sequences, second.sequences))
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)
        self.assertTrue(torch.equal(results[0][0], results[1][0]))
        self.assertTrue(torch.equal(results[0][1], results[1][1]))

    def test_moe_layers_first_equals_stock(self):
        model = self._model(first_k_dense_replace=0)
        ids, mask = prompt(batch=3, left_pad=True)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)

    def test_bf16_on_the_cpu_equals_stock(self):
        model = self._model().to(torch.bfloat16)
        ids, mask = prompt(batch=1)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)

    def test_inference_mode_equals_stock(self):
        model = self._model()
        ids, mask = prompt(batch=1)
        with torch.inference_mode():
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=True, eos_token_id=None)
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)

    def test_a_second_model_of_the_class_equals_stock(self):
        first = self._model()
        second = build_latent("deepseek_v3", seed=3)
        ids, mask = prompt(batch=1)
        _check_against_stock(self, first, ids, mask, max_new_tokens=6, **GREEDY)
        _check_against_stock(self, second, ids, mask, max_new_tokens=6, **GREEDY)
        _check_against_stock(self, first, ids, mask, max_new_tokens=6, **GREEDY)
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)

    # ---- mid-call changes

    def test_the_router_bias_replaced_mid_call_is_seen(self):
        model = self._model()
        gate = model.model.layers[1].mlp.gate
        saved = gate.e_score_correction_bias

        def act():
            gate.e_score_correction_bias = torch.linspace(-3, 3, saved.shape[0])

        def undo():
            gate.e_score_correction_bias = saved

        self._mid_call(model, act, undo)

    def test_the_router_bias_data_rebound_mid_call_is_seen(self):
        model = self._model()
        gate = model.model.layers[1].mlp.gate
        saved = gate.e_score_correction_bias.data

        def act():
            gate.e_score_correction_bias.data = torch.linspace(-3, 3, saved.shape[0])

        def undo():
            gate.e_score_correction_bias.data = saved

        self._mid_call(model, act, undo)

    def test_rope_interleave_flipped_mid_call_is_seen(self):
        model = self._model()

        def act():
            model.config.rope_interleave = not model.config.rope_interleave

        was = model.config.rope_interleave

        def undo():
            model.config.rope_interleave = was

        self._mid_call(model, act, undo)

    def test_kv_b_proj_weight_replaced_mid_call_is_seen(self):
        model = self._model()
        proj = model.model.layers[0].self_attn.kv_b_proj
        saved = proj.weight

        def act():
            proj.weight = torch.nn.Parameter(saved * 2)

        def undo():
            proj.weight = saved

        self._mid_call(model, act, undo)

    def test_a_hook_on_kv_b_proj_added_mid_call_is_seen(self):
        model = self._model()
        proj = model.model.layers[0].self_attn.kv_b_proj
        handles = []

        def act():
            handles.append(proj.register_forward_hook(lambda m, i, o: o * 2))

        def undo():
            while handles:
                handles.pop().remove()

        self._mid_call(model, act, undo)

    def test_torch_split_rebound_mid_call_is_seen(self):
        model = self._model()
        original = torch.split

        def doubled(tensor, sizes, dim=0):
            return tuple(part * 2 for part in original(tensor, sizes, dim))

        def act():
            torch.split = doubled

        def undo():
            torch.split = original

        self._mid_call(model, act, undo)


    # ---- batch 2

    def test_assisted_decoding_with_a_latent_target_and_draft_equals_stock(self):
        target = self._model()
        draft = self._model("deepseek_v2")
        ids = prompt(batch=1)[0]
        for sample in (False, True):
            _check_against_stock(self, target, ids, torch.ones_like(ids), assistant_model=draft, max_new_tokens=16, do_sample=sample,
                                 eos_token_id=None)
            self.assertTrue(tas.last_path().verify.startswith("graphed (5 pieces)"), tas.last_path().verify)

    def test_prompt_lookup_with_a_latent_target_equals_stock(self):
        target = self._model()
        ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 7, 3, 4]])
        _check_against_stock(self, target, ids, torch.ones_like(ids), prompt_lookup_num_tokens=3, max_new_tokens=16, do_sample=False,
                             eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed (5 pieces)"), tas.last_path().verify)

    def test_an_instance_level_derivation_set_mid_call_is_seen(self):
        model = self._model()
        attention = model.model.layers[1].self_attn
        original = _attn_cls(model).expand_kv

        def doubled(kv_nope, k_rot):
            keys, values = original(attention, kv_nope, k_rot)
            return keys, values * 2

        def act():
            attention.expand_kv = doubled

        def undo():
            attention.__dict__.pop("expand_kv", None)

        self._mid_call(model, act, undo)

    def test_the_scaling_attribute_changed_mid_call_is_seen(self):
        model = self._model()
        attention = model.model.layers[0].self_attn
        was = attention.scaling

        def act():
            attention.scaling = was * 3

        def undo():
            attention.scaling = was

        self._mid_call(model, act, undo)

    def test_another_transformers_derivation_swapped_between_calls_equals_stock(self):
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
        model = self._model()
        cls = _attn_cls(model)
        original = cls.expand_kv
        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, **GREEDY)
        try:
            cls.expand_kv = DeepseekV2Attention.expand_kv
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        finally:
            cls.expand_kv = original

    def test_a_partialmethod_derivation_equals_stock(self):
        model = self._model()
        cls = _attn_cls(model)
        original = cls.expand_kv

        def scaled(self, kv_nope, k_rot, factor):
            keys, values = original(self, kv_nope, k_rot)
            return keys, values * factor

        ids, mask = prompt(batch=1)
        try:
            cls.expand_kv = functools.partialmethod(scaled, factor=2.0)
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        finally:
            cls.expand_kv = original

    def test_a_subclass_overriding_the_derivation_equals_stock(self):
        model = self._model()
        cls = _attn_cls(model)

        class Sub(cls):
            def expand_kv(self, kv_nope, k_rot):
                keys, values = super().expand_kv(kv_nope, k_rot)
                return keys, values * 2

        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, **GREEDY)  # recorded with the base class
        for layer in model.model.layers:
            layer.self_attn.__class__ = Sub
        _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)

    def test_a_pre_hook_on_kv_b_proj_equals_stock(self):
        model = self._model()
        handle = model.model.layers[1].self_attn.kv_b_proj.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
        ids, mask = prompt(batch=1)
        try:
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        finally:
            handle.remove()

    def test_a_peft_lora_on_kv_b_proj_equals_stock(self):
        import peft
        model = self._model()
        config = peft.LoraConfig(r=4, target_modules=["kv_b_proj", "q_b_proj"], init_lora_weights=False)
        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, **GREEDY)  # recorded without
        peft.inject_adapter_in_model(config, model)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)

    def test_a_peft_lora_injected_mid_call_is_seen(self):
        import peft
        model = self._model()
        config = peft.LoraConfig(r=4, target_modules=["kv_b_proj"], init_lora_weights=False)
        base = copy.deepcopy(model)

        def act():
            torch.manual_seed(5)
            peft.inject_adapter_in_model(config, model)

        def undo():
            model.load_state_dict(base.state_dict(), strict=False)
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.kv_b_proj = copy.deepcopy(base.model.layers[i].self_attn.kv_b_proj)

        self._mid_call(model, act, undo)

    def test_output_attentions_and_hidden_states_equal_stock(self):
        model = self._model()
        ids, mask = prompt(batch=1)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, output_attentions=True,
                                 output_hidden_states=True, **GREEDY)

    def test_mistral4_position_scaled_query_equals_stock(self):
        # Mistral 4 scales the query by a function of `position_ids` between the update and the derivation (the
        # derivation's piece): the scale steps every 4 positions here
        if not available("mistral4"):
            self.skipTest("no mistral4")
        from transformers.models.mistral4 import modeling_mistral4
        config = transformers.AutoConfig.for_model("mistral4", **{**_SIZES, "head_dim": 12})
        config.rope_parameters["original_max_position_embeddings"] = 4
        config.rope_parameters["llama_4_scaling_beta"] = 0.7
        config.initializer_range = 0.5
        torch.manual_seed(0)
        model = modeling_mistral4.Mistral4ForCausalLM._from_config(config, attn_implementation="sdpa").eval()
        ids, mask = prompt(batch=3, left_pad=True)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, **GREEDY)
        self.assertTrue(tas.last_path().forward.startswith("graphed (5 pieces)"), tas.last_path().forward)


    def _mistral4(self):
        if not available("mistral4"):
            self.skipTest("no mistral4")
        from transformers.models.mistral4 import modeling_mistral4
        config = transformers.AutoConfig.for_model("mistral4", **{**_SIZES, "head_dim": 12})
        config.rope_parameters["original_max_position_embeddings"] = 4
        config.rope_parameters["llama_4_scaling_beta"] = 0.7
        config.initializer_range = 0.5
        torch.manual_seed(0)
        return modeling_mistral4.Mistral4ForCausalLM._from_config(config, attn_implementation="sdpa").eval()

    def test_mistral4_scaling_beta_mutated_in_place_mid_call_is_seen(self):
        model = self._mistral4()
        params = model.config.rope_parameters

        def act():
            params["llama_4_scaling_beta"] = 5.0

        def undo():
            params["llama_4_scaling_beta"] = 0.7

        self._mid_call(model, act, undo, steps=12)

    def test_mistral4_scaling_beta_mutated_in_place_between_calls_is_seen(self):
        model = self._mistral4()
        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        try:
            model.config.rope_parameters["llama_4_scaling_beta"] = 5.0
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, **GREEDY)
        finally:
            model.config.rope_parameters["llama_4_scaling_beta"] = 0.7


    def _passive_counts(self, module_of):
        model = self._model()
        counts = []
        handle = module_of(model).register_forward_hook(tas.passive_hook(lambda *a: counts.append(1)))
        ids, mask = prompt(batch=1)
        try:
            with stock():
                model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, **GREEDY)
            seen, counts[:] = len(counts), []
            model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, async_stopping_criteria=True,
                           **GREEDY)
        finally:
            handle.remove()
        # the flag's forward may run one step more than stock's (the passive contract), never fewer
        self.assertIn(len(counts), (seen, seen + 1))

    def test_a_passive_hook_on_kv_b_proj_sees_every_step(self):
        self._passive_counts(lambda model: model.model.layers[1].self_attn.kv_b_proj)

    def test_a_passive_hook_on_o_proj_sees_every_step(self):
        self._passive_counts(lambda model: model.model.layers[1].self_attn.o_proj)

    def test_a_target_and_draft_of_one_latent_class_equal_stock(self):
        target = self._model()
        draft = self._model(num_hidden_layers=1, first_k_dense_replace=1)
        ids = prompt(batch=1)[0]
        _check_against_stock(self, target, ids, torch.ones_like(ids), assistant_model=draft, max_new_tokens=14,
                             do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed (5 pieces)"), tas.last_path().verify)



if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
class ARecordingAfterAMidCallChangeIsConfirmed(unittest.TestCase):
    """Red team observation 1 (2026-11-29): after a change mid-call the model records again from stock's step inputs,
    whose `input_ids` column (`input_ids[:, -1:].clone()`) has the sequence's length as its row stride; the buffer
    kept that stride, so the confirming recording at the next position saw another geometry at the embedding's op
    ("two positions ran different ops") and the rest of the call ran eagerly. The buffers now take their sizes' own
    strides: the change is recorded, confirmed, and replayed."""

    def setUp(self):
        self.enterContext(emulated())

    def test_a_weight_replaced_mid_call_is_recorded_again_and_replayed(self):
        model = build_latent("deepseek_v3")
        proj = model.model.layers[0].self_attn.kv_b_proj
        saved = proj.weight
        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=4, **GREEDY)  # recorded and confirmed

        def act():
            proj.weight = torch.nn.Parameter(saved * 2)

        try:
            with stock():
                ref, _ = _generate(model, ids, mask, None, max_new_tokens=16,
                                   stopping_criteria=[AtStep(4, act)], **GREEDY)
            proj.weight = saved
            out, _ = _generate(model, ids, mask, True, max_new_tokens=16, stopping_criteria=[AtStep(4, act)],
                               **GREEDY)
        finally:
            proj.weight = saved
        _same(self, ref, out)
        forward = tas.last_path().forward
        # 15 decode steps: replays before the change, the recording and its confirmation after it (their kernels run
        # once, eagerly), then replays to the end: more than the 3 before the change
        replayed = int(forward.split(": ")[1].split(" ")[0])
        self.assertGreater(replayed, 6, forward)
        self.assertNotIn("different ops", forward)
