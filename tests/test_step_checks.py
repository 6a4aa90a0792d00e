"""Issue 32: the graphed forward's per-step checks, made cheaper, still catch what they caught.

`ModelGraphs.changed` maps each namespace kind's own `get` over the watched torch names (a module's dict, a class's
mappingproxy); `PiecewiseForward.watching.why_eager` tests torch's hook tables by their truth, and a table of another
type by its length; the recording key reads the dtype of the embedding module watched at `_watch` (not
`get_input_embeddings()` at every step), and a recording made after the module was replaced is keyed by the new one.
"""

from __future__ import annotations

import collections
import copy
import unittest
from unittest import mock

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof, staleness
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)


class WatchedNamesStale(unittest.TestCase):
    """A torch name the replayed Python looks up, rebound after the recording, is stale: in a module's dict and in a
    class's dict (a mappingproxy: `dict.get` does not apply to it)."""

    def setUp(self):
        self.model = build("llama").eval()
        self.graphs = staleness.ModelGraphs()
        proof.hand_over(self.graphs, self.model)

    def _kinds(self):
        return {type(table) for table, _, _ in self.graphs.functions}

    def test_an_unchanged_model_is_not_stale(self):
        self.assertEqual(self._kinds(), {dict, type(type.__dict__)})
        self.assertFalse(self.graphs.changed())

    def test_a_rebound_name_in_each_kind_of_namespace_is_stale(self):
        classes = {cls for module in self.model.modules() for cls in type(module).__mro__}
        for kind in self._kinds():
            for table, name, value in self.graphs.functions:
                if type(table) is not kind:
                    continue
                # a class's dict: the Python class it belongs to (a mappingproxy is made at each `vars()`)
                owner = table if kind is dict else next(
                    (cls for cls in classes if cls.__module__ != "builtins" and vars(cls) == table), None)
                if owner is not None:
                    break
            replacement = lambda *args, **kwargs: value(*args, **kwargs)  # noqa: E731
            with self.subTest(kind=kind.__name__, name=name):
                patch = mock.patch.dict(owner, {name: replacement}) if kind is dict else mock.patch.object(
                    owner, name, replacement)
                with patch:
                    self.assertTrue(self.graphs.changed())
                self.assertFalse(self.graphs.changed())


class GeometryOnTheSameStorage(unittest.TestCase):
    """Red team hole R2: a tensor given another shape, stride or dtype on the same storage (`.data =` keeps the
    address) is stale; with torch's tensor guard and with the maps that stand in for it."""

    def _graphs(self):
        model = build("llama").eval()
        # `.data =` of an integer view needs a tensor without gradients (and the guard compares requires_grad too)
        model.model.layers[0].self_attn.o_proj.weight.requires_grad_(False)
        graphs = staleness.ModelGraphs()
        proof.hand_over(graphs, model)
        return model, graphs

    def _each_way(self, check):
        for guard in (True, False):
            with self.subTest(guard=guard), mock.patch.object(
                    staleness, "_TensorGuards", staleness._TensorGuards if guard else None):
                model, graphs = self._graphs()
                self.assertIs(graphs.guards is not None, guard and staleness._TensorGuards is not None)
                check(model, graphs)

    def test_a_weight_trimmed_transposed_or_viewed_as_another_dtype_is_stale(self):
        def check(model, graphs):
            self.assertFalse(graphs.changed())
            for name, edit in (("trimmed", lambda w: w[:-1]), ("transposed", lambda w: w.t()),
                               ("reinterpreted", lambda w: w.view(torch.int32))):
                weight = model.model.layers[0].self_attn.o_proj.weight  # square (hidden x hidden)
                self.assertEqual(weight.shape[0], weight.shape[1])
                before = weight.data
                weight.data = edit(before)
                self.assertEqual(weight.data_ptr(), before.data_ptr())
                self.assertTrue(graphs.changed(), name)
                weight.data = before
                self.assertFalse(graphs.changed(), name)

        self._each_way(check)

    @unittest.skipIf(staleness._TensorGuards is None, "a torch without its C++ tensor guard")
    def test_tied_weights_keep_the_guard(self):
        # the embedding's weight is the LM head's: listed once (the guard refuses a tensor given twice, and the maps
        # would then stand in for it, at three times its cost)
        model = build("llama").eval()
        model.lm_head.weight = model.model.embed_tokens.weight
        graphs = staleness.ModelGraphs()
        proof.hand_over(graphs, model)
        self.assertIsNotNone(graphs.guards)
        self.assertFalse(graphs.changed())
        weight = model.lm_head.weight
        before = weight.data
        weight.data = before[:-1]
        self.assertTrue(graphs.changed())
        weight.data = before
        self.assertFalse(graphs.changed())

    def test_inference_mode_alone_is_not_a_change(self):
        def check(model, graphs):
            with torch.inference_mode():
                self.assertFalse(graphs.changed())
            with torch.no_grad():
                self.assertFalse(graphs.changed())

        self._each_way(check)


class ContainersEditedInPlace(unittest.TestCase):
    """Red team hole R10: a config's list or dict edited in place is the same object; its contents are compared."""

    def test_a_config_list_and_a_list_inside_a_config_dict_edited_in_place_are_stale(self):
        model = build("llama").eval()
        model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
        model.config.extra = {"nested": [1, 2]}
        graphs = staleness.ModelGraphs()
        proof.hand_over(graphs, model)
        self.assertFalse(graphs.changed())
        model.config.layer_types[0] = "sliding_attention"
        self.assertTrue(graphs.changed())
        model.config.layer_types[0] = "full_attention"
        self.assertFalse(graphs.changed())
        model.config.extra["nested"].append(3)
        self.assertTrue(graphs.changed())

    def test_a_container_holding_tensors_is_left_to_its_identity(self):
        model = build("llama").eval()
        model.config.held = [torch.ones(2)]  # `==` of tensors is elementwise: not a verdict
        graphs = staleness.ModelGraphs()
        proof.hand_over(graphs, model)
        self.assertFalse(any(value is model.config.held for value in graphs.contents))
        self.assertFalse(graphs.changed())


class _FalsyHooks(collections.OrderedDict):
    """A hook table whose truth is not its length (a user's mapping)."""

    def __bool__(self):
        return False


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
class HookTablesSeen(unittest.TestCase):
    def setUp(self):
        self.model = build("llama").eval()
        self.step = forward.PiecewiseForward(self.model, self.model.__call__, None)

    def test_no_hook_is_observed(self):
        self.assertTrue(self.step.watching.plain_hook_tables)
        self.assertIsNone(self.step.watching.why_eager())

    def test_a_registered_hook_is_seen(self):
        handle = self.model.model.layers[1].mlp.register_forward_pre_hook(lambda *args: None)
        try:
            self.assertEqual(self.step.watching.why_eager(), "a hook was added")
        finally:
            handle.remove()
        self.assertIsNone(self.step.watching.why_eager())

    def test_a_table_of_another_type_is_read_by_its_length(self):
        module = self.model.model.layers[0].self_attn.o_proj
        module._forward_hooks = _FalsyHooks()
        self.step._watch()
        self.assertFalse(self.step.watching.plain_hook_tables)
        self.assertIsNone(self.step.watching.why_eager())
        module._forward_hooks[0] = lambda *args: None
        self.assertEqual(self.step.watching.why_eager(), "a hook was added")


class _SwapEmbeddingsAt(StoppingCriteria):
    """Replaces the input embedding module by a bf16 copy once the sequence reaches `length` tokens; never stops.
    (The decoder layers promote the bf16 hidden states back to fp32: the model runs, mixed, in stock too.)"""

    def __init__(self, model, length):
        self.model, self.length, self.old = model, length, model.get_input_embeddings()

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.model.set_input_embeddings(copy.deepcopy(self.old).to(torch.bfloat16))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def remove(self):
        self.model.set_input_embeddings(self.old)


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict("os.environ", {proof.PIECEWISE_ENV: "1"})
class EmbeddingsReplacedMidCall(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def test_the_recording_after_the_swap_is_keyed_by_the_new_embeddings_dtype(self):
        model = build("llama").eval()
        ids, mask = prompt(batch=1)
        outputs = []
        for flag in (None, True):
            swap = _SwapEmbeddingsAt(model, ids.shape[1] + 3)
            kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True,
                          stopping_criteria=StoppingCriteriaList([swap]))
            try:
                with torch.no_grad():
                    if flag:
                        outputs.append(model.generate(ids, async_stopping_criteria=True, **kwargs))
                    else:
                        with stock():
                            outputs.append(model.generate(ids, **kwargs))
            finally:
                swap.remove()
        assert_same(self, outputs[0], outputs[1])
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        # one recording, made after the swap, under the new module's dtype: a key read from the module watched before
        # the swap would have filed it under fp32, and the next step (bf16) would have recorded again
        keys = list(forward.graphs_of(model).recordings)
        self.assertEqual(len(keys), 1, keys)
        self.assertIs(keys[0][-1], torch.bfloat16)


class OwnCodeVerdicts(unittest.TestCase):
    """`proof.default_deny.transformers_own`, asked per step of the cache's update and the sdpa attention function."""

    def test_transformers_own_functions_pass_and_user_ones_do_not(self):
        from transformers.cache_utils import DynamicCache

        self.assertTrue(proof.default_deny.transformers_own(DynamicCache.update))
        self.assertFalse(proof.default_deny.transformers_own(lambda *args: None))

    def test_a_user_function_asked_about_is_not_kept_alive(self):
        import gc
        import weakref

        def attention(*args, **kwargs):
            return None

        seen = weakref.ref(attention)
        self.assertFalse(proof.default_deny.transformers_own(attention))
        del attention
        gc.collect()
        self.assertIsNone(seen())

    def test_a_function_whose_code_is_replaced_is_asked_again(self):
        from transformers.cache_utils import DynamicCache

        def update(*args, **kwargs):
            return None

        own = DynamicCache.update
        copy_of_own = type(own)(own.__code__, own.__globals__, own.__name__, own.__defaults__, own.__closure__)
        self.assertTrue(proof.default_deny.transformers_own(copy_of_own))
        copy_of_own.__code__ = update.__code__
        self.assertFalse(proof.default_deny.transformers_own(copy_of_own))


if __name__ == "__main__":
    unittest.main()
