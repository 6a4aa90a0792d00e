"""`static_loop.purity` sees every kind of hidden state a user processor can keep or read, or refuses to prove it.

A processor proven pure on its first call is captured into a CUDA graph and replayed without its Python; state the
proof does not see is baked into the graph (issue 25, class 4). CPU: the proof's verdict (`guard_for` / `observe` /
`unchanged`) for state kept as Python attributes on tensors (inputs, output, held and global tensors), draws from the
CPU generator (the CUDA default generator is the only one a graph advances), a held tensor's `.grad`, and the sibling
kinds the proof already refused (seeding and RNG-state calls, Python and NumPy random state, closures, globals,
class attributes, mutable defaults, referenced objects, host reads, time and environment reads), under no autograd
context, `no_grad` and `inference_mode`. CUDA: static-cache generate() with such processors equals unpatched stock.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import math
import os
import random
import time
import unittest

import numpy as np
import torch
from parameterized import parameterized
from transformers import LogitsProcessor, StoppingCriteria

from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from test_purity import CUDA_PURE, IMPURE, PURE, Learned, Noise, _CountCaptures, _inputs, _reset, _static_generate
from transformers_async_stop.loops.static_loop.purity import guard_for

CUDA = torch.cuda.is_available()
VOCAB = 48
CONTEXTS = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


# --- state kept as Python attributes on tensors --------------------------------------------------------------------
class TagsScores(LogitsProcessor):
    """Counts its calls on the scores it gets: in stock a fresh tensor each step, so always the first call."""

    def __call__(self, input_ids, scores):
        seen = getattr(scores, "_mark", 0)
        scores._mark = seen + 1
        return scores / (1 + seen)


class ReadsScoresTag(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * getattr(scores, "_scale", 1.0)


class TagsInputIds(LogitsProcessor):
    def __call__(self, input_ids, scores):
        input_ids._seen = True
        return scores * 2


class TagsItsOutput(LogitsProcessor):
    def __call__(self, input_ids, scores):
        out = scores * 2
        out._made_by = "TagsItsOutput"
        return out


class TagsThroughDict(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores.__dict__["_mark"] = 1
        return scores * 2


class _Marked(torch.Tensor):
    pass


class RetypesScores(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores.__class__ = _Marked  # a later processor's torch functions would see the subclass
        return scores * 2


class TensorCounter(LogitsProcessor):
    """The issue's counter on a held tensor: `self.t.count += 1`."""

    def __init__(self, device="cpu"):
        self.t = torch.zeros((), device=device)
        self.t.count = 0

    def __call__(self, input_ids, scores):
        self.t.count += 1
        return scores / self.t.count


class TensorHistory(LogitsProcessor):
    def __init__(self):
        self.t = torch.zeros(())
        self.t.history = []

    def __call__(self, input_ids, scores):
        self.t.history.append(1)
        return scores / len(self.t.history)


class TensorSetting(LogitsProcessor):
    """Reads a Python setting kept on a held tensor: pure, but a later change must be seen."""

    def __init__(self, device="cpu"):
        self.t = torch.ones((), device=device)
        self.t.scale = 0.5

    def __call__(self, input_ids, scores):
        return scores * self.t.scale


_GLOBAL_T = torch.zeros(())
_GLOBAL_T.count = 0


class GlobalTensorCounter(LogitsProcessor):
    def __call__(self, input_ids, scores):
        _GLOBAL_T.count += 1
        return scores / _GLOBAL_T.count


class ReadsGrad(LogitsProcessor):
    """Reads a held tensor's `.grad`, a C field that user code may rebind between steps."""

    def __init__(self, device="cpu"):
        self.w = torch.ones(VOCAB, device=device, requires_grad=True)
        self.w.grad = torch.ones(VOCAB, device=device)

    def __call__(self, input_ids, scores):
        return scores * self.w.grad


# --- writes to torch's and the standard library's modules and classes, through an alias ------------------------------
_ALIASED = ((torch.Tensor, "_purity_calls"), (torch.nn.functional, "_purity_calls"), (math, "_purity_calls"),
            (builtins, "_purity_calls"))


def _clear_aliased():
    global _M
    _M = 0
    for owner, name in _ALIASED:
        if name in vars(owner):
            delattr(owner, name)


class CountsOnTensorClass(LogitsProcessor):
    """State on the class of the scores (torch.Tensor, a class the proof trusts): `type(scores).calls += 1`."""

    def __call__(self, input_ids, scores):
        cls = type(scores)
        cls._purity_calls = getattr(cls, "_purity_calls", 0) + 1
        return scores / cls._purity_calls


def _counts_on_module(which):
    def call(input_ids, scores):
        module = torch.nn.functional if which == "torch" else math
        module._purity_calls = getattr(module, "_purity_calls", 0) + 1
        return scores / module._purity_calls
    call.__name__ = f"counts_on_{which}"
    return call


_M = 0


def _through_globals(input_ids, scores):
    namespace = _through_globals.__globals__
    namespace["_M"] += 1
    return scores / namespace["_M"]


def _through_a_traceback(input_ids, scores):
    try:
        raise ValueError
    except ValueError as error:
        namespace = error.__traceback__.tb_frame.f_globals
    namespace["_M"] += 1
    return scores / namespace["_M"]


def _through_a_computed_name(input_ids, scores):
    namespace = getattr(_through_a_computed_name, "__glob" + "als__")  # no scan sees the name
    namespace["_M"] += 1
    return scores / namespace["_M"]


def _through_builtins(input_ids, scores):
    namespace = len.__self__.__dict__
    namespace["_purity_calls"] = namespace.get("_purity_calls", 0) + 1
    return scores / namespace["_purity_calls"]


# --- draws from the CPU generator ------------------------------------------------------------------------------------
class CpuJitter(LogitsProcessor):
    """The issue's temperature jitter: a 0-dim CPU draw, whose value a capture bakes into the launch."""

    def __call__(self, input_ids, scores):
        return scores / (0.7 + 0.1 * torch.rand(()))


def _cpu_draw(kind):
    def call(input_ids, scores):
        if kind == "uniform_":
            return scores + torch.empty(()).uniform_()
        if kind == "bernoulli":
            return scores * torch.bernoulli(torch.full((), 0.5))
        if kind == "randint":
            return scores + torch.randint(0, 3, ())
        if kind == "normal":
            return scores + torch.normal(0.0, 1.0, ())
        if kind == "randperm":
            return scores + torch.randperm(3)[0]
        if kind == "multinomial":
            return scores + torch.multinomial(torch.ones(3), 1)
        if kind == "exponential_":
            return scores + torch.empty(()).exponential_()
        if kind == "dropout":
            return torch.nn.functional.dropout(torch.ones(()), 0.5, training=True) * scores
        raise ValueError(kind)
    call.__name__ = f"cpu_{kind}"
    return call


CPU_DRAWS = ("uniform_", "bernoulli", "randint", "normal", "randperm", "multinomial", "exponential_", "dropout")

# --- the sibling kinds (already refused before this fix; pinned so they stay refused) --------------------------------
_COUNT = [0]


def _closure_counter():
    n = 0

    def call(input_ids, scores):
        nonlocal n
        n += 1
        return scores / n
    return call


def _mutable_default(input_ids, scores, _calls=[0]):  # noqa: B006 - the hidden state under test
    _calls[0] += 1
    return scores / _calls[0]


class _ClassCounter(LogitsProcessor):
    calls = 0

    def __call__(self, input_ids, scores):
        type(self).calls += 1
        return scores / type(self).calls


class _Inner:
    calls = 0


class _ReferencedCounter(LogitsProcessor):
    def __init__(self):
        self.inner = _Inner()

    def __call__(self, input_ids, scores):
        self.inner.calls += 1
        return scores / self.inner.calls


def _global_container(input_ids, scores):
    _COUNT[0] += 1
    return scores / _COUNT[0]


def _forks_rng(input_ids, scores):
    with torch.random.fork_rng(devices=[]):
        return scores * 2


def _with(body):
    def call(input_ids, scores):
        return body(scores)
    return call


SIBLINGS = {
    "manual_seed": _with(lambda s: s * (1 + 0 * torch.manual_seed(0).initial_seed())),
    "get_rng_state": _with(lambda s: s + 0 * torch.get_rng_state()[0]),
    "seed": _with(lambda s: s * (1 + 0 * torch.seed())),
    "fork_rng": _forks_rng,
    "cuda_manual_seed": _with(lambda s: (torch.cuda.manual_seed(0), s)[1]),
    "default_generator": _with(lambda s: s + torch.rand(s.shape, generator=torch.default_generator)),
    "default_generator_seeded": _with(lambda s: (torch.default_generator.manual_seed(1), s)[1]),
    "new_generator": _with(lambda s: s + torch.rand(s.shape, generator=torch.Generator().manual_seed(0))),
    "python_random": _with(lambda s: s * (1 + 0 * random.random())),
    "python_random_instance": _with(lambda s: s * (1 + 0 * _RNG.random())),
    "numpy_random": _with(lambda s: s * float(1 + 0 * np.random.rand())),
    "numpy_generator": _with(lambda s: s * float(1 + 0 * _NP_RNG.random())),
    "closure": _closure_counter(), "mutable_default": _mutable_default, "class_attribute": _ClassCounter(),
    "referenced_object": _ReferencedCounter(), "global_container": _global_container,
    "iterator": _with(lambda s, it=iter(range(1, 100)): s / next(it)),
    "itertools_count": _with(lambda s, it=itertools.count(1): s / next(it)),
    "item": _with(lambda s: s - s.max().item()), "tolist": _with(lambda s: s * len(s[0, :2].tolist())),
    "bool": _with(lambda s: s * 2 if (s > 0).any() else s), "int": _with(lambda s: s * int(s[0, 0] > 0)),
    "index": _with(lambda s: s * [1, 2][s[0, 0].long().clamp(0, 1)]), "contains": _with(lambda s: s * (0.5 in s)),
    "time": _with(lambda s: s * (1 + 0 * time.monotonic())), "perf_counter": _with(lambda s: s * (1 + 0 * _PERF())),
    "environ": _with(lambda s: s * float(os.environ.get("PURITY_TEST_SCALE", "1"))),
    "getenv": _with(lambda s: s * float(os.getenv("PURITY_TEST_SCALE", "1"))),
    "id": _with(lambda s: s * (1 + 0 * id(s))),
}
_RNG = random.Random(0)
_NP_RNG = np.random.default_rng(0)
_PERF = time.perf_counter

HIDDEN = {
    "sets_an_attribute_on_scores": TagsScores, "sets_an_attribute_on_input_ids": TagsInputIds,
    "sets_an_attribute_on_its_output": TagsItsOutput, "sets_an_attribute_through_dict": TagsThroughDict,
    "sets_the_class_of_scores": RetypesScores,
    "counter_on_a_held_tensor": TensorCounter, "list_on_a_held_tensor": TensorHistory,
    "counter_on_a_global_tensor": GlobalTensorCounter, "reads_a_held_tensors_grad": ReadsGrad,
    "counter_on_the_tensor_class": CountsOnTensorClass,
    **{f"counter_on_a_{k}_module": functools.partial(_counts_on_module, k) for k in ("torch", "math")},
    "counter_through_a_functions_globals": lambda: _through_globals,
    "counter_through_a_frames_globals": lambda: _through_a_traceback,
    "counter_through_a_computed_attribute_name": lambda: _through_a_computed_name,
    "counter_in_builtins": lambda: _through_builtins,
    "cpu_generator_jitter": CpuJitter, "cpu_generator_noise": Noise,
    **{f"cpu_generator_{k}": functools.partial(_cpu_draw, k) for k in CPU_DRAWS},
}


def _verdict(processor, context="plain", tag_scores=None):
    """(guard, result): `processor` observed on one call inside `context`; guard None if no proof was possible."""
    guard = guard_for(processor)
    with CONTEXTS[context]():
        ids, scores = (t.clone() for t in _inputs())  # made inside the context, as generate() would make them
        if tag_scores is not None:
            scores._scale = tag_scores
        if guard is None:
            return None, processor(ids, scores)
        return guard, guard.observe(ids, scores)


class HiddenStateIsSeen(unittest.TestCase):
    @parameterized.expand([(f"{name}_{context}", make, context) for name, make in sorted(HIDDEN.items())
                           for context in CONTEXTS])
    def test_hidden_state_is_not_proven_pure(self, _, make, context):
        _GLOBAL_T.count = 0
        try:
            guard, _ = _verdict(make(), context)
        finally:
            _clear_aliased()
        if guard is not None:
            self.assertIs(guard.capturable, False, guard.reason)
            self.assertFalse(guard.unchanged())

    def test_a_global_module_hook_added_after_the_proof_is_seen(self):
        """`nn.Module.__call__` runs the global module hooks, which a replay would not: adding one is a change."""
        module = Learned(VOCAB)
        guard, _ = _verdict(module)
        self.assertTrue(guard.capturable, guard.reason)
        self.assertTrue(guard.unchanged())
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
        try:
            self.assertFalse(guard.unchanged())
        finally:
            handle.remove()
        self.assertTrue(guard.unchanged())

    @parameterized.expand(sorted(SIBLINGS))
    def test_sibling_hidden_state_is_not_proven_pure(self, name):
        for context in CONTEXTS:
            _COUNT[0] = 0
            guard, _ = _verdict(SIBLINGS[name], context)
            if guard is not None:
                self.assertIs(guard.capturable, False, f"{context}: {guard.reason}")

    @parameterized.expand(list(CONTEXTS))
    def test_an_attribute_already_on_the_scores_is_not_baked_in(self, context):
        guard, out = _verdict(ReadsScoresTag(), context, tag_scores=0.5)
        self.assertIs(guard.capturable, False, guard.reason)

    @parameterized.expand(list(CONTEXTS))
    def test_a_setting_on_a_held_tensor_is_guarded(self, context):
        processor = TensorSetting()
        guard, _ = _verdict(processor, context)
        self.assertTrue(guard.capturable, guard.reason)
        with CONTEXTS[context]():  # checked inside generate(), in the context it runs in
            self.assertTrue(guard.unchanged())
            processor.t.scale = 0.25
            self.assertFalse(guard.unchanged())
            processor.t.scale = 0.5
            self.assertTrue(guard.unchanged())
            processor.t.other = 1
            self.assertFalse(guard.unchanged())

    @parameterized.expand([(f"{name}_{context}", name, context) for name in sorted(PURE) for context in CONTEXTS])
    def test_pure_processors_stay_proven_in_every_autograd_context(self, _, name, context):
        processor = PURE[name]()
        with CONTEXTS[context]():
            ids, scores = (t.clone() for t in _inputs())
            torch.manual_seed(0)
            want = PURE[name]()(ids.clone(), scores.clone())
            guard = guard_for(processor)
            torch.manual_seed(0)
            got = guard.observe(ids, scores)
            self.assertTrue(guard.unchanged())  # checked inside generate(), in the context it runs in
        self.assertTrue(guard.capturable, guard.reason)
        self.assertTrue(torch.equal(want, got))

    @parameterized.expand([(f"{name}_{context}", name, context) for name in sorted(IMPURE) for context in CONTEXTS
                           if name != "mutates_scores" or context != "plain"])
    def test_impure_processors_stay_rejected_in_every_autograd_context(self, _, name, context):
        _reset()
        guard, _ = _verdict(IMPURE[name](), context)
        if guard is not None:
            self.assertIs(guard.capturable, False, guard.reason)


# --- CUDA: static-cache generate() equals unpatched stock -----------------------------------------------------------
class _AtCall(StoppingCriteria):
    """A user criterion that runs `change` at its `n`-th call (mid-generation, after the tail was captured)."""

    def __init__(self, n, change):
        self.n, self.change, self.calls = n, change, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            self.change()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _both(model, ids, mask, make, sampling, criteria=lambda processor: (), context="plain"):
    """(stock, flag) runs with fresh processors, each from the same global state; the flag run counts captures."""
    runs = []
    for flag in (False, True):
        _reset()
        _GLOBAL_T.count = 0
        processor = make()
        try:
            with (contextlib.nullcontext() if flag else stock()), _CountCaptures() as captures, CONTEXTS[context]():
                out = _static_generate(model, ids, mask, processor, flag, sampling, criteria(processor))
        finally:
            _clear_aliased()
            for handle in _HOOKS:
                handle.remove()
            _HOOKS.clear()
        runs.append((out, torch.get_rng_state()))
    return runs, captures.count


_HOOKS = []  # global module hooks a criterion registered: removed after each run


def _halve_learned(module, args, out):
    return out * 0.5 if isinstance(module, Learned) else None


@unittest.skipUnless(CUDA, "needs a CUDA device")
@unittest.skipUnless(TRANSFORMERS_VERSION >= (5, 17), "the static-cache loop is taken on transformers 5.17+")
class CapturedTailEqualsStock(unittest.TestCase):
    def setUp(self):
        self.model = build("llama", device="cuda")
        self.ids, self.mask = prompt(batch=2, device="cuda")

    @parameterized.expand([(f"{name}_{'sample' if s else 'greedy'}", name, s) for name in
                           ("sets_an_attribute_on_scores", "counter_on_a_held_tensor", "list_on_a_held_tensor",
                            "counter_on_a_global_tensor", "counter_on_the_tensor_class", "counter_on_a_torch_module",
                            "cpu_generator_jitter", "cpu_generator_normal",
                            "cpu_generator_bernoulli") for s in (False, True)])
    def test_hidden_state_is_never_captured(self, _, name, sampling):
        ((ref, ref_rng), (on, on_rng)), captures = _both(self.model, self.ids, self.mask, HIDDEN[name], sampling)
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_rng, on_rng), "the CPU generator's state differs")
        self.assertEqual(captures, 0, "a processor with hidden state was captured")

    @parameterized.expand([("tensor_setting", lambda: TensorSetting("cuda"),
                            lambda p: [_AtCall(6, lambda: setattr(p.t, "scale", 0.25))]),
                           ("grad_rebound", lambda: ReadsGrad("cuda"),
                            lambda p: [_AtCall(6, lambda: setattr(p.w, "grad", torch.full_like(p.w, 0.25)))]),
                           ("global_module_hook", lambda: Learned(VOCAB).cuda(),
                            lambda p: [_AtCall(6, lambda: _HOOKS.append(
                                torch.nn.modules.module.register_module_forward_hook(_halve_learned)))])])
    def test_state_changed_mid_call_is_seen_as_in_stock(self, _, make, criteria):
        for sampling in (False, True):
            (ref, ref_rng), (on, on_rng) = _both(self.model, self.ids, self.mask, make, sampling, criteria)[0]
            assert_same(self, ref, on)

    @parameterized.expand([("extra_softmax", "extra_softmax"), ("noise", "noise_default_generator")])
    def test_a_pure_processor_under_inference_mode_is_captured_and_equals_stock(self, _, name):
        make = {**PURE, **CUDA_PURE}[name]
        ((ref, _), (on, _)), captures = _both(self.model, self.ids, self.mask, make, True, context="inference_mode")
        assert_same(self, ref, on)
        self.assertGreater(captures, 0, "a proven-pure processor was not captured under inference_mode")


@unittest.skipUnless(TRANSFORMERS_VERSION >= (5, 17), "the static-cache loop is taken on transformers 5.17+")
class EagerTailEqualsStock(unittest.TestCase):
    """The same processors on CPU (the tail runs eagerly, `observe` included): equal to stock."""

    @parameterized.expand([(name,) for name in ("sets_an_attribute_on_scores", "counter_on_a_held_tensor",
                                                "cpu_generator_jitter")])
    def test_equals_stock(self, name):
        model = build("llama")
        ids, mask = prompt(batch=2)
        (ref, ref_rng), (on, on_rng) = _both(model, ids, mask, HIDDEN[name], True)[0]
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_rng, on_rng))

    @parameterized.expand([("extra_softmax",), ("counter_on_a_held_tensor",)])
    def test_under_inference_mode_equals_stock(self, name):
        model = build("llama")
        ids, mask = prompt(batch=2)
        make = PURE.get(name) or HIDDEN[name]
        (ref, _), (on, _) = _both(model, ids, mask, make, True, context="inference_mode")[0]
        assert_same(self, ref, on)
