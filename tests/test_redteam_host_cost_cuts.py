"""Red team of issue 38's three cuts (2026-11-28): each attempt compares `async_stopping_criteria=True` with unpatched
transformers (`models.stock()`), or asserts the verdict the package must reach. Report:
docs/red-team/2026-11-28-host-cost-cuts.md.

1. `ModelGraphs.same_instances()` in place of the per-call walk of every module's `__dict__`
   (graphs/piecewise/staleness.py, proof.why_not_again);
2. `verified.matches` comparing the lookups that resolved a shortcut's sources (release_checks/verified.py);
3. the greedy acceptance of an assisted round replayed from one CUDA graph per width
   (loops/assisted/acceptance_graph.py).

Tests marked `# HOLE n` fail on the tree they were written against; the others held and pin the behaviour.
The CUDA graphs are emulated on the CPU (`testing/emulation.py`)."""

from __future__ import annotations

import collections
import functools
import importlib
import os
import threading
import unittest
from unittest import mock

import torch

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import verified
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)


class Doubler(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


class PlainDict(dict):
    """A children/parameter/buffer table of a type other than torch's own (iterates with its own code)."""


def _differs_from_stock(test, model, ids, mask, **kwargs):
    """(stock output, flag output) of one call each."""
    with stock():
        ref, ref_after = _generate(model, ids, mask, None, **kwargs)
    out, after = _generate(model, ids, mask, True, **kwargs)
    return ref, out, ref_after, after


def _assert_equal_to_stock(test, model, ids, mask, **kwargs):
    ref, out, ref_after, after = _differs_from_stock(test, model, ids, mask, **kwargs)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. eligibility: a model recorded and unchanged is not walked (same_instances)
# ---------------------------------------------------------------------------------------------------------------


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class SameInstancesCut(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.enterContext(mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"}))
        self.ids, self.mask = prompt(batch=1)

    def _recorded(self, model=None):
        model = build("llama") if model is None else model
        for _ in range(2):
            _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        return model

    # HOLE 1: `_record` proves the model (`why_not_model`) before the recording, then `retake_instances()` after it
    # takes every module table as it is *then* as "proven". An edit that lands between the two (another thread
    # setting an override while this thread records; here simulated by the edit landing as `record` returns) is
    # adopted as proven without ever being walked: at every later call `same_instances()` is True, `why_instances`
    # never runs, and the stale graphs replay without the override stock runs. Before this commit `why_not_again`
    # walked `why_instances` at every call and refused ("an unregistered module in its 'mlp'").
    def test_an_override_set_while_a_recording_runs_is_refused_at_the_next_call(self):
        model = build("llama")
        layer = model.model.layers[0]
        original = forward.record
        done = []

        def record_then_edit(*args, **kwargs):
            made = original(*args, **kwargs)
            if not done:  # another thread's edit, landing while this thread's recording finishes
                done.append(True)
                object.__setattr__(layer, "mlp", Doubler(layer._modules["mlp"]))
            return made

        with mock.patch.object(forward, "record", record_then_edit):
            _generate(model, self.ids, self.mask, True, **_KW)  # the racing call itself: not compared
        self.assertTrue(done)
        # the model is stable from here on: every later call must be stock's
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertIn("unregistered module", tas.last_path().forward)

    def test_a_method_rebound_on_a_module_class_between_calls_equals_stock(self):
        model = self._recorded()
        cls = type(model.model.layers[0].mlp)
        original = cls.forward
        self.addCleanup(setattr, cls, "forward", original)

        def doubled(self, x):
            return original(self, x) * 2

        cls.forward = doubled  # a class table edited to the same size: no instance table moves
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertFalse(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_a_module_class_swapped_between_calls_equals_stock(self):
        model = self._recorded()
        mlp = model.model.layers[0].mlp
        original = type(mlp)
        self.addCleanup(setattr, mlp, "__class__", original)
        mlp.__class__ = type("Doubled", (original,), {"forward": lambda self, x: original.forward(self, x) * 2})
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)

    def test_a_hook_in_a_replaced_hook_table_between_calls_equals_stock(self):
        model = self._recorded()
        mlp = model.model.layers[1].mlp
        mlp._forward_hooks = collections.OrderedDict({0: lambda module, args, output: output * 2})
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertIn("hook", tas.last_path().forward)

    def test_a_global_forward_hook_between_calls_equals_stock(self):
        model = self._recorded()
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: output * 2 if type(module).__name__ == "LlamaMLP" else output)
        self.addCleanup(handle.remove)
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertIn("global module hook", tas.last_path().forward)

    def test_a_child_shadowed_in_a_same_size_dict_between_calls_equals_stock(self):
        # a private field deleted, an unregistered module set over a child: the same size, other keys
        model = self._recorded()
        layer = model.model.layers[0]
        table = layer.__dict__
        size = len(table)
        saved = table.pop("_is_full_backward_hook")
        table["mlp"] = Doubler(layer._modules["mlp"])
        self.addCleanup(table.update, {"_is_full_backward_hook": saved})
        self.addCleanup(table.pop, "mlp")
        self.assertEqual(len(table), size)
        self.assertFalse(forward.graphs_of(model).same_instances())
        _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertIn("unregistered module", tas.last_path().forward)

    def test_a_module_with_a_table_of_its_own_type_is_walked_at_every_call(self):
        model = build("llama")
        norm = model.model.norm
        norm._buffers = PlainDict(norm._buffers)  # not torch's own table: `same_instances` must never vouch
        self._recorded(model)
        self.assertFalse(forward.graphs_of(model).same_instances())
        layer = model.model.layers[1]
        table = layer.__dict__
        saved = table.pop("_is_full_backward_hook")
        table["mlp"] = Doubler(layer._modules["mlp"])
        self.addCleanup(table.update, {"_is_full_backward_hook": saved})
        self.addCleanup(table.pop, "mlp")
        with mock.patch.object(proof.default_deny, "why_instances", wraps=proof.default_deny.why_instances) as walked:
            _assert_equal_to_stock(self, model, self.ids, self.mask, **_KW)
        self.assertGreaterEqual(walked.call_count, 1)

    def test_same_instances_says_no_while_a_table_changes_size_under_it(self):
        model = self._recorded()
        graphs = forward.graphs_of(model)
        table = model.model.layers[0].__dict__
        original = graphs.instance_sizes

        class Resizing(list):
            # the size check passes; the table grows while the keys are compared (another thread)
            def __ne__(self, other):
                table["_racing"] = 1
                return list.__ne__(self, other)

        self.addCleanup(table.pop, "_racing", None)
        graphs.instance_sizes = Resizing(original)
        self.addCleanup(setattr, graphs, "instance_sizes", original)
        self.assertFalse(graphs.same_instances())


# ---------------------------------------------------------------------------------------------------------------
# 2. verified.matches: the lookups that resolved a shortcut's sources, compared by identity
# ---------------------------------------------------------------------------------------------------------------


def _shorter(self, input_ids, scores, **kwargs):
    # `MaxLengthCriteria.__call__`'s signature and no free variable: its code can replace the original's in place
    return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.max_length - 4, device=input_ids.device,
                      dtype=torch.bool)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class ShortcutLookupsCut(unittest.TestCase):
    NAME = "MaxLengthCriteria.__call__"

    def setUp(self):
        from transformers.generation import stopping_criteria

        self.module = stopping_criteria
        self.cls = stopping_criteria.MaxLengthCriteria
        self.model = build("llama")
        self.ids, self.mask = prompt(batch=1)
        _assert_equal_to_stock(self, self.model, self.ids, self.mask, max_new_tokens=12, do_sample=False,
                               eos_token_id=None)
        self.assertTrue(verified.matches(self.NAME))

    def _against_stock(self):
        return _assert_equal_to_stock(self, self.model, self.ids, self.mask, max_new_tokens=12, do_sample=False,
                                      eos_token_id=None)

    # HOLE 2: `__code__` replaced in place on the very function object the verdict was digested from (a hot patch,
    # `jurigged`/`reloading`-style live code reload). Every lookup `_links` recorded still gives the same object, so
    # the cached verdict stands and the package keeps its own port of the criterion (FoldedCriteria / the side-stream
    # criteria) while stock runs the new code: stock stops 4 tokens earlier. The digest taken afresh would not be in
    # the table ('not checked'): only the cache hides it. Not new: HEAD~3's `_objects` compared the same function
    # objects by identity and missed it as well (checked against `git archive HEAD~3`).
    def test_code_replaced_in_place_on_a_source_takes_the_verdict_again(self):
        function = self.cls.__call__
        original = function.__code__
        self.addCleanup(setattr, function, "__code__", original)
        function.__code__ = _shorter.__code__
        fresh = set(verified.installed_digests(self.NAME).values())
        known = {digest for table in verified._BY_NAME[self.NAME].digests.values() for digest in table}
        self.assertFalse(fresh & known, "the new code's digest is not a checked one")
        self.assertFalse(verified.matches(self.NAME), "the verdict on the old code was kept")
        self._against_stock()

    def test_a_wraps_wrapper_set_on_the_class_turns_the_shortcut_off(self):
        original = self.cls.__dict__["__call__"]
        self.addCleanup(setattr, self.cls, "__call__", original)

        @functools.wraps(original)
        def wrapper(self, input_ids, scores, **kwargs):
            return _shorter(self, input_ids, scores, **kwargs)

        self.cls.__call__ = wrapper
        self.assertFalse(verified.matches(self.NAME))
        self._against_stock()

    def test_a_subclass_put_in_the_module_keeps_the_verdict_and_stock(self):
        # an intermediate holder rebound to another object that resolves the same function: taken again, still on
        original = self.cls
        self.addCleanup(setattr, self.module, "MaxLengthCriteria", original)
        self.module.MaxLengthCriteria = type("MaxLengthCriteria", (original,), {})
        self.assertTrue(verified.matches(self.NAME))
        self.assertIsNot(verified._LINKS[self.NAME][2][0], None)
        self._against_stock()

    def test_a_module_reloaded_takes_the_verdict_again(self):
        saved = dict(vars(self.module))

        def restore():
            vars(self.module).clear()
            vars(self.module).update(saved)
            verified.matches(self.NAME)

        self.addCleanup(restore)
        importlib.reload(self.module)
        self.assertIsNot(self.module.MaxLengthCriteria, self.cls)
        self.assertTrue(verified.matches(self.NAME))  # the same source, read from the reloaded class
        self.assertIs(verified._LINKS[self.NAME][4][-1], self.module.MaxLengthCriteria.__call__)

    def test_a_class_attribute_lookup_through_a_metaclass_getattr_is_not_trusted_blindly(self):
        # a metaclass answering the holder's lookups: each answer is compared by identity (a new object per lookup
        # takes the verdict again: slower, never wrong)
        calls = []

        original = self.cls

        class Meta(type(original)):  # StoppingCriteria's own metaclass (ABCMeta), answering through Python code
            def __getattribute__(cls, name):
                if name == "__call__":
                    calls.append(name)
                return super().__getattribute__(name)

        proxy = Meta("MaxLengthCriteria", (original,), {})
        self.addCleanup(setattr, self.module, "MaxLengthCriteria", original)
        self.module.MaxLengthCriteria = proxy
        self.assertTrue(verified.matches(self.NAME))
        self.assertTrue(verified.matches(self.NAME))
        self.assertTrue(calls)
        self._against_stock()


# ---------------------------------------------------------------------------------------------------------------
# 3. the greedy acceptance replayed from one CUDA graph per width
# ---------------------------------------------------------------------------------------------------------------


class EosSwapper:
    """A streamer that, at its `after`-th `put`, changes the EOS ids tensor the call was given: `how` is "data"
    (`eos.data = new`: another storage, as `p.data = x`) or "inplace" (`eos.copy_(new)`: the same storage)."""

    def __init__(self, eos, new_id, after, how):
        self.eos, self.new_id, self.after, self.how = eos, new_id, after, how
        self.puts = 0
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.tolist())
        self.puts += 1
        if self.puts == self.after:
            new = torch.tensor([self.new_id], dtype=self.eos.dtype, device=self.eos.device)
            if self.how == "data":
                self.eos.data = new
            else:
                self.eos.copy_(new)

    def end(self):
        self.tokens.append("end")


# a prompt that repeats: prompt lookup finds candidates of several widths
REPEATS = [[3, 4, 5, 6, 3, 4, 5, 7, 3, 4, 5, 6, 3, 4]]


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class AcceptanceGraphCut(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.enterContext(mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"}))
        self.target = build("llama")
        self.helper = build("llama", seed=1)
        self.ids = prompt(batch=1)[0]

    def _against_stock(self, ids=None, **kwargs):
        ids = self.ids if ids is None else ids
        kwargs = {"max_new_tokens": 30, "do_sample": False, "eos_token_id": None, **kwargs}
        out = _assert_equal_to_stock(self, self.target, ids, torch.ones_like(ids), **kwargs)
        return out, tas.last_path()

    def _eos_swapped(self, how):
        # a token the greedy run reaches late (well after the first widths are captured), never seen before it
        with stock():
            plain, _ = _generate(self.target, self.ids, torch.ones_like(self.ids), None,
                                 assistant_model=self.helper, max_new_tokens=30, do_sample=False, eos_token_id=None)
        generated = plain.sequences[0, self.ids.shape[1]:].tolist()
        late = next(t for k, t in enumerate(generated) if k >= 14 and t not in generated[:k])
        unused = next(t for t in range(47, 2, -1) if t not in generated)
        results = []
        for flag in (None, True):
            eos = torch.tensor([unused])
            streamer = EosSwapper(eos, late, after=3, how=how)
            if flag is None:
                with stock():
                    out, _ = _generate(self.target, self.ids, torch.ones_like(self.ids), None,
                                       assistant_model=self.helper, max_new_tokens=30, do_sample=False,
                                       eos_token_id=eos, streamer=streamer)
            else:
                out, _ = _generate(self.target, self.ids, torch.ones_like(self.ids), True,
                                   assistant_model=self.helper, max_new_tokens=30, do_sample=False,
                                   eos_token_id=eos, streamer=streamer)
            results.append((out, streamer.tokens))
        self.assertTrue(tas.last_path().acceptance.startswith("graphed"), tas.last_path().acceptance)
        return results

    # HOLE 3: the graph of a width bakes the EOS tensors' storage in (`eos_cut` = `generation_config._eos_token_tensor`
    # and the `EosTokenCriteria`'s `eos_token_id`: the very tensor the caller passed as `eos_token_id`). A caller's
    # code that runs mid-call (a streamer, a logits processor) rebinding that tensor's storage (`eos.data = new`,
    # `eos.set_(...)`, or a `resize_`) is seen by stock's `isin` and by the eager acceptance, not by a replay, which
    # keeps reading the old address (on CUDA: memory the caching allocator may already have handed out again).
    # Stock stops at the new EOS id; the flag keeps going to `max_new_tokens`.
    def test_the_eos_tensor_rebound_to_new_storage_mid_call_equals_stock(self):
        (ref, ref_tokens), (out, tokens) = self._eos_swapped("data")
        assert_same(self, ref, out)
        self.assertEqual(ref_tokens, tokens)

    def test_the_eos_tensor_edited_in_place_mid_call_equals_stock(self):
        (ref, ref_tokens), (out, tokens) = self._eos_swapped("inplace")
        assert_same(self, ref, out)
        self.assertEqual(ref_tokens, tokens)

    def test_prompt_lookup_of_many_widths_clipped_by_the_length_equals_stock(self):
        ids = torch.tensor(REPEATS)
        for new, tokens in ((7, 2), (13, 5), (29, 10)):
            _, path = self._against_stock(ids, prompt_lookup_num_tokens=tokens, max_new_tokens=new)
        self.assertIsNotNone(path.acceptance)

    def test_an_eos_among_candidates_at_the_length_budget_equals_stock(self):
        with stock():
            plain, _ = _generate(self.target, self.ids, torch.ones_like(self.ids), None,
                                 assistant_model=self.helper, max_new_tokens=30, do_sample=False, eos_token_id=None)
        generated = plain.sequences[0, self.ids.shape[1]:].tolist()
        for k in (9, 15, 22):
            self._against_stock(assistant_model=self.helper, eos_token_id=[generated[k], 47], max_new_tokens=k + 1)

    def test_inference_mode_equals_stock(self):
        with torch.inference_mode():
            _, path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_a_bf16_target_and_draft_equal_stock(self):
        self.target = build("llama", dtype=torch.bfloat16)
        self.helper = build("llama", seed=1, dtype=torch.bfloat16)
        _, path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_inputs_embeds_equals_stock(self):
        embeds = self.target.get_input_embeddings()(self.ids)
        kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                      return_dict_in_generate=True, output_scores=True, output_logits=True)
        results = []
        for flag in (None, True):
            extra = {} if flag is None else {"async_stopping_criteria": True}
            torch.manual_seed(7)
            try:
                if flag is None:
                    with stock():
                        out = self.target.generate(inputs_embeds=embeds, prompt_lookup_num_tokens=3, **kwargs)
                else:
                    out = self.target.generate(inputs_embeds=embeds, prompt_lookup_num_tokens=3, **extra, **kwargs)
                results.append(out)
            except Exception as error:  # noqa: BLE001 (stock's exception must be the flag's)
                results.append((type(error), str(error)))
        if isinstance(results[0], tuple):
            self.assertEqual(results[0], results[1])
        else:
            assert_same(self, results[0], results[1])

    def test_a_processor_that_keeps_and_rewrites_earlier_scores_equals_stock(self):
        from transformers import LogitsProcessor, LogitsProcessorList

        class Keeper(LogitsProcessor):
            # keeps every row it was given and scales the previous one when called again (aliasing across rounds)
            def __init__(self):
                self.kept = []

            def __call__(self, input_ids, scores):
                if self.kept:
                    self.kept[-1].mul_(1.0)
                scores = scores - 0.01 * (input_ids[:, -1:] % 3)
                self.kept.append(scores)
                return scores

        _, path = self._against_stock(assistant_model=self.helper,
                                      logits_processor=LogitsProcessorList([Keeper()]))
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

    def test_two_threads_each_equal_stock(self):
        other_target, other_helper = build("llama", seed=2), build("llama", seed=3)
        kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
        with stock():
            refs = [_generate(model, self.ids, torch.ones_like(self.ids), None, assistant_model=helper, **kwargs)[0]
                    for model, helper in ((self.target, self.helper), (other_target, other_helper))]
        outs = [None, None]
        errors = []
        barrier = threading.Barrier(2)

        def run(index, model, helper):
            try:
                barrier.wait()
                outs[index] = _generate(model, self.ids, torch.ones_like(self.ids), True, assistant_model=helper,
                                        **kwargs)[0]
            except BaseException as error:  # noqa: BLE001
                errors.append(error)

        threads = [threading.Thread(target=run, args=(0, self.target, self.helper)),
                   threading.Thread(target=run, args=(1, other_target, other_helper))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        self.assertFalse(errors, errors)
        for ref, out in zip(refs, outs):
            self.assertTrue(torch.equal(ref.sequences, out.sequences))
            for a, b in zip(ref.scores, out.scores):
                self.assertTrue(torch.equal(a, b))

    def test_an_interrupt_at_the_end_of_the_capture_leaves_no_capture_mode_behind(self):
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        from transformers_async_stop.graphs import backend as graph_backend
        from transformers_async_stop.testing import emulation

        class Interrupted(emulation.Graph):
            def capture_end(self):
                super().capture_end()
                raise KeyboardInterrupt  # after the capture ended cleanly: nothing to heal, the call must stop

        class Backend(emulation.Backend):
            Graph = Interrupted

        # every capture goes through `graphs.backend.capture`, which asks `backend_for` for the device's backend
        with mock.patch.object(graph_backend, "backend_for", lambda device: Backend):
            with self.assertRaises(KeyboardInterrupt):
                _generate(self.target, self.ids, torch.ones_like(self.ids), True, assistant_model=self.helper,
                          max_new_tokens=30, do_sample=False, eos_token_id=None)
        self.assertIsNone(_get_current_dispatch_mode())
        _, path = self._against_stock(assistant_model=self.helper)
        self.assertTrue(path.acceptance.startswith("graphed"), path.acceptance)

if __name__ == "__main__":
    unittest.main()
