"""Red team of "a model recorded and unchanged is proven once, not per call" (5869d88, issue 38) and of the auto proof
fixes (0707278, 257e92b): docs/red-team/2026-11-28-proof-once.md.

`forward_for` now skips `proof.why_not_model` for a model with recordings whose snapshot is unchanged
(`ModelGraphs.changed()` False) and asks only `proof.why_not_again`; the per-step watch lists are the previous
call's. Each case: a tiny model on the CPU with the graphs emulated, recorded by two calls, then changed between calls,
then the flag against unpatched stock (`models.stock()`). The tests marked `# HOLE n` failed before their fix (the flag
replayed what stock no longer computes, where the full proof refuses the model); the others are attempts that held.
"""

from __future__ import annotations

import gc
import os
import tempfile
import unittest
import weakref
from unittest import mock

import torch
from transformers import LogitsProcessorList

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate
from test_redteam_found_families import _AtStep  # on the target: between two assisted rounds

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
ON = {proof.PIECEWISE_ENV: "1"}
_KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)


def _full_proof(model):
    with torch.no_grad():
        return proof.why_not_model(model, model.__call__)


class _Base(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.enterContext(mock.patch.dict(os.environ, ON))
        self.ids, self.mask = prompt(batch=1)

    def _same(self, ref, out):
        self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
        for a, b in zip(ref.logits, out.logits):
            self.assertTrue(torch.equal(a, b), "logits differ from stock")

    def _against_stock(self, model, **kwargs):
        with stock():
            ref, _ = _generate(model, self.ids, self.mask, None, **_KW, **kwargs)
        out, _ = _generate(model, self.ids, self.mask, True, **_KW, **kwargs)
        self._same(ref, out)
        return out

    def _warm(self, model):
        for _ in range(2):
            self._against_stock(model)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class RedTeamProofOnce(_Base):
    # HOLE 1: an attribute newly set on a module's class between calls. `why_not_model` refuses it
    # (`proven._why_class`: `_NOT_TRANSFORMERS` on a transformers class, or any class attribute that is not transformers'
    # code, red team R5b), but the per-step rebound list (`proof.names.watched`) holds only the (class, name) pairs that
    # existed when the lists were made (forward, __call__, the class's own transformers methods), the snapshot compares
    # only `torch.nn.Module`'s internals: `LlamaMLP._call_impl = f` (run by every stock call of the module through
    # `Module._wrapped_call_impl`) or a property shadowing an instance attribute is unseen; the previous call's
    # recordings replay.
    def test_call_impl_set_on_a_transformers_class_between_calls(self):
        from transformers.models.llama.modeling_llama import LlamaMLP

        model = build("llama")
        self._warm(model)

        def doubled(module, *args, **kwargs):
            return torch.nn.Module._call_impl(module, *args, **kwargs) * 2

        LlamaMLP._call_impl = doubled
        self.addCleanup(delattr, LlamaMLP, "_call_impl")
        self.assertIn("_call_impl", _full_proof(model))  # the full proof refuses it
        self._against_stock(model)

    # HOLE 1 (a property on the class, a data descriptor: it wins over the instance's `scaling`)
    def test_property_shadowing_an_instance_attribute_set_on_the_class_between_calls(self):
        from transformers.models.llama.modeling_llama import LlamaAttention

        model = build("llama")
        self._warm(model)
        LlamaAttention.scaling = property(lambda self: self.__dict__["scaling"] * 3)
        self.addCleanup(delattr, LlamaAttention, "scaling")
        self.assertIsNotNone(_full_proof(model))
        self._against_stock(model)

    # HOLE 2: a module's `__dict__` edited without changing its size (one private attribute deleted, one added).
    # `changed()` compares each module `__dict__`'s length and its public attributes' identities; `why_not_model`'s
    # `proven.why_unread` refuses an unregistered module in `__dict__` or an instance-level `_call_impl`, but is no
    # longer asked between calls, and `watching.why_eager` looks for "forward" only.
    def test_unregistered_module_with_dict_size_kept_between_calls(self):
        model = build("llama")
        self._warm(model)
        layer = model.model.layers[0]

        class Wrap(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x) * 2

        del layer._is_full_backward_hook  # read only by `register_full_backward_hook`
        object.__setattr__(layer, "mlp", Wrap(layer.mlp))
        self.assertIn("unregistered module", _full_proof(model))
        self._against_stock(model)

    # HOLE 2 (an instance-level `_call_impl`, the size kept)
    def test_instance_call_impl_with_dict_size_kept_between_calls(self):
        model = build("llama")
        self._warm(model)
        norm = model.model.norm
        del norm._is_full_backward_hook
        norm._call_impl = lambda *a, **k: torch.nn.Module._call_impl(norm, *a, **k) + 1
        self.assertIn("instance-level _call_impl", _full_proof(model))
        self._against_stock(model)

    # --- what held --------------------------------------------------------------------------------------------------
    def test_proven_once_when_unchanged(self):
        model = build("llama")
        self._warm(model)
        with mock.patch.object(piecewise, "why_not_model", wraps=piecewise.why_not_model) as full:
            self._against_stock(model)
        self.assertEqual(full.call_count, 0)

    def test_instance_call_impl_added_between_calls_is_seen(self):
        model = build("llama")
        self._warm(model)
        norm = model.model.norm
        norm._call_impl = lambda *a, **k: torch.nn.Module._call_impl(norm, *a, **k) + 1
        self.addCleanup(delattr, norm, "_call_impl")
        self._against_stock(model)
        self.assertIn("_call_impl", tas.last_path().forward)

    def test_class_forward_rebound_between_calls_is_seen(self):
        from transformers.models.llama.modeling_llama import LlamaMLP

        model = build("llama")
        self._warm(model)
        own = LlamaMLP.forward
        LlamaMLP.forward = lambda self, x: own(self, x) * 2
        self.addCleanup(setattr, LlamaMLP, "forward", own)
        self._against_stock(model)
        self.assertIn("replaced", tas.last_path().forward)

    def test_module_compile_between_calls_is_seen(self):
        model = build("llama")
        self._warm(model)
        mlp = model.model.layers[0].mlp
        mlp.compile()
        self.addCleanup(setattr, mlp, "_compiled_call_impl", None)
        self.assertTrue(forward.graphs_of(model).changed())  # the call is proven in full, which refuses it
        self.assertIn("compiled", _full_proof(model))

    def test_moved_to_another_dtype_between_calls(self):
        model = build("llama")
        self._warm(model)
        model.to(torch.float64)
        self._against_stock(model)

    def test_parameter_swapped_for_meta_between_calls(self):
        model = build("llama")
        self._warm(model)
        up = model.model.layers[0].mlp.up_proj
        up.weight = torch.nn.Parameter(torch.empty_like(up.weight, device="meta"), requires_grad=False)
        self.assertTrue(forward.graphs_of(model).changed())
        self.assertIn("meta", _full_proof(model))

    def test_parameter_class_swapped_in_place_between_calls(self):
        model = build("llama")
        self._warm(model)

        class Doubling(torch.nn.Parameter):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                out = super().__torch_function__(func, types, args, kwargs or {})
                return out * 2 if func is torch.nn.functional.linear else out

        weight = model.model.layers[0].mlp.down_proj.weight
        weight.__class__ = Doubling
        self.assertTrue(forward.graphs_of(model).changed())
        self._against_stock(model)

    def test_peft_adapter_injected_into_the_same_model_between_calls(self):
        from peft import LoraConfig, inject_adapter_in_model

        model = build("llama")
        self._warm(model)
        torch.manual_seed(3)
        inject_adapter_in_model(LoraConfig(target_modules=["q_proj"], init_lora_weights=False), model)
        self._against_stock(model)
        self.assertFalse(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_torch_function_rebound_between_calls(self):
        model = build("llama")
        self._warm(model)
        own = torch.nn.functional.silu
        torch.nn.functional.silu = lambda x, inplace=False: own(x) * 2
        self.addCleanup(setattr, torch.nn.functional, "silu", own)
        self.assertTrue(forward.graphs_of(model).changed())
        self._against_stock(model)

    def test_config_field_set_between_calls(self):
        model = build("llama")
        self._warm(model)
        model.config.sliding_window = 3
        self._against_stock(model)

    def test_rope_type_set_between_calls(self):
        model = build("llama")
        self._warm(model)
        model.model.rotary_emb.rope_type = "dynamic"
        self.assertTrue(forward.graphs_of(model).changed())

    def test_attn_implementation_set_between_calls(self):
        model = build("llama")
        self._warm(model)
        model.set_attn_implementation("eager")
        self._against_stock(model)
        # proven again and recorded under it (the recording key holds the implementation; `graphs/piecewise/
        # attention.py`): eager attention is graphed too
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_process_group_initialized_between_calls(self):
        import torch.distributed as dist

        model = build("llama")
        self._warm(model)
        with tempfile.TemporaryDirectory() as folder:
            dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{folder}/pg")
            try:
                self._against_stock(model)
                path = tas.last_path()  # the package steps aside under a process group (None), or the forward does
                self.assertTrue(path is None or not str(path.forward).startswith("graphed"), path)
            finally:
                dist.destroy_process_group()

    def test_a_model_recorded_twice_is_freed(self):
        model = build("llama")
        self._warm(model)
        self.assertIsNotNone(forward.graphs_of(model).watched)
        ref = weakref.ref(model)
        del model
        gc.collect()
        self.assertIsNone(ref())


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class RedTeamProofOnceDraft(_Base):
    def _assisted(self, target, helper, action=None, undo=lambda: None):
        ids = prompt(batch=1)[0]
        outs = []
        for flag in (None, True):
            extra = {"logits_processor": LogitsProcessorList([_AtStep(action, at=2)])} if action else {}
            if flag is None:
                with stock():
                    outs.append(_generate(target, ids, torch.ones_like(ids), None, assistant_model=helper,
                                          max_new_tokens=10, do_sample=True, eos_token_id=None, **extra))
            else:
                outs.append(_generate(target, ids, torch.ones_like(ids), True, assistant_model=helper,
                                      max_new_tokens=10, do_sample=True, eos_token_id=None, **extra))
            undo()
        (ref, ref_after), (out, after) = outs
        assert_same(self, ref, out)
        return out

    def test_draft_config_changed_between_rounds_by_a_target_processor(self):
        target, helper = build("llama", seed=0), build("llama", seed=1)
        self._assisted(target, helper)
        self._assisted(target, helper)
        layer = helper.model.layers[0].self_attn
        scaling = layer.scaling

        def change():
            layer.scaling = scaling * 2

        self._assisted(target, helper, change, lambda: setattr(layer, "scaling", scaling))

    # HOLE 1 on the draft: a class attribute set between two rounds by a processor on the target
    def test_draft_class_call_impl_set_between_rounds(self):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

        target, helper = build("llama", seed=0), build("qwen2", seed=1)
        self._assisted(target, helper)
        self._assisted(target, helper)
        self.assertTrue(tas.last_path().forward.startswith("draft graphed"), tas.last_path().forward)

        def change():
            Qwen2MLP._call_impl = lambda module, *a, **k: torch.nn.Module._call_impl(module, *a, **k) * 2

        def undo():
            if "_call_impl" in vars(Qwen2MLP):
                del Qwen2MLP._call_impl

        self.addCleanup(undo)
        self._assisted(target, helper, change, undo)
        # the class changed under the draft's recordings: proven again, and refused, named
        self.assertIn("Qwen2MLP._call_impl", tas.last_path().forward)


if __name__ == "__main__":
    unittest.main()
