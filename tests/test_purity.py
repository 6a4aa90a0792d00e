"""`static_loop.purity`: which undeclared user logits processors the captured tail may replay, and the guard that says
when a capture still holds. CPU: unit tests of `guard_for` / `Guard.observe` / `Guard.unchanged` for every kind of
processor (pure ones accepted; stateful, host-reading, input_ids-reading, input-mutating, raising, impure-call ones
rejected; every change to what a proven one read flips `unchanged()`), and `observe` returning exactly what the
processor returns, inside a stock generate() too. CUDA: device-only rejections, the default generator's draws in a
replayed graph equal to eager, and static-cache generate() with each kind equal to unpatched stock.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import random
import time
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TopKLogitsWarper

from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.loops.static_loop import eligibility
from transformers_async_stop.loops.static_loop.purity import guard_for

CUDA = torch.cuda.is_available()


# --- processors of every kind ---------------------------------------------------------------------------------------
class ExtraSoftmax(LogitsProcessor):  # transformers #43089's processor, undeclared
    def __call__(self, input_ids, scores):
        return scores.softmax(-1)


class Scale(LogitsProcessor):
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, input_ids, scores):
        return scores * self.factor


class Threshold(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return torch.where(scores > 0.1, scores, torch.full_like(scores, -float("inf")))


class ClassConstant(LogitsProcessor):
    bias = 0.5

    def __call__(self, input_ids, scores):
        return self._shift(scores) + math.sqrt(4.0)

    def _shift(self, scores):
        return scores - self.bias


class BatchAware(LogitsProcessor):
    def __call__(self, input_ids, scores):
        keep = [row for row in range(input_ids.shape[0])]  # a comprehension: nested code
        return scores * (len(keep) / input_ids.size(0)) + torch.finfo(scores.dtype).tiny


class ConstantTensor(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * torch.tensor(0.5)


class Noise(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 0.1 * torch.rand(scores.shape, device=scores.device)


class Half(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.half().float().log_softmax(-1)


class WrapsTopK(LogitsProcessor):
    def __init__(self):
        self.inner = TopKLogitsWarper(top_k=5)

    def __call__(self, input_ids, scores):
        return self.inner(input_ids, scores)


class Learned(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, vocab))

    def forward(self, input_ids, scores):
        return scores * self.weight


TEMPERATURE = 0.7
_CONFIG = type("Config", (), {})()
_CONFIG.scale = 1.0


def _helper(scores):
    return scores / TEMPERATURE


class UsesHelper(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return _helper(scores)


class ReadsConfig(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * _CONFIG.scale


def scaled(input_ids, scores, factor=2.0):
    return scores * factor


def closure_processor(factor):
    def call(input_ids, scores):
        return scores * factor
    return call


# impure ones
class Counter(LogitsProcessor):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores / self.calls


class Previous(LogitsProcessor):
    def __init__(self):
        self.previous = None

    def __call__(self, input_ids, scores):
        out = scores if self.previous is None else (scores + self.previous) / 2
        self.previous = scores.clone()
        return out


class History(LogitsProcessor):
    def __init__(self):
        self.history = []

    def __call__(self, input_ids, scores):
        self.history.append(1)
        return scores * len(self.history)


_CALLS = 0


def _reset():
    """Module state the impure processors change: the same at the start of each compared run."""
    global _CALLS
    _CALLS = 0
    torch.manual_seed(0)
    random.seed(0)


class GlobalCounter(LogitsProcessor):
    def __call__(self, input_ids, scores):
        global _CALLS
        _CALLS += 1
        return scores + _CALLS


def _host(kind):
    class Host(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if kind == "item":
                return scores - scores.max().item()
            if kind == "tolist":
                return scores * len([v for v in scores[0, :2].tolist() if v > 0])
            if kind == "bool":
                return scores * 2 if (scores > 0).any() else scores
            if kind == "cpu":
                return (scores.cpu() * 2).to(scores.device)
            if kind == "nonzero":
                return scores + (scores > 0).nonzero().shape[0]
            if kind == "mask":
                out = scores.clone()
                # boolean-mask indexing, its shape set by the values: read here, as a write alone (`out[m] = -inf`)
                # dispatches `index_put_` on torch 2.13 but `masked_fill_` (no read) on torch 2.15: the write alone is
                # judged by the op torch dispatches in test_purity_mask_write.py
                out[scores < 0] = scores[scores < 0] * 2
                return out
            raise ValueError(kind)
    Host.__name__ = f"Host_{kind}"
    return Host()


def _reads_ids(kind):
    class ReadsIds(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if kind == "length":
                return scores / input_ids.shape[-1]
            if kind == "unpack":
                batch, length = input_ids.shape
                return scores / length
            if kind == "size":
                return scores / input_ids.size(1)
            if kind == "last":
                return scores.scatter(1, input_ids[:, -1:], -float("inf"))
            if kind == "gather":
                return scores - 0.1 * torch.gather(scores, 1, input_ids).sum(-1, keepdim=True)
            raise ValueError(kind)
    ReadsIds.__name__ = f"ReadsIds_{kind}"
    return ReadsIds()


class MutatesScores(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 0] = -float("inf")
        return scores


class MutatesScoresInPlaceOp(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.mul_(2)


class MutatesIds(LogitsProcessor):
    def __call__(self, input_ids, scores):
        input_ids[:, -1] = 3
        return scores


class Raises(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("refused")


class Prints(LogitsProcessor):
    def __call__(self, input_ids, scores):
        print(end="")
        return scores


class Clock(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * (1 + 0 * time.time())


class PyRandom(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * (1 + 0 * random.random())


class OwnGenerator(LogitsProcessor):
    def __init__(self):
        self.generator = None

    def __call__(self, input_ids, scores):
        gen = torch.Generator(device=scores.device).manual_seed(0)
        return scores + torch.rand(scores.shape, generator=gen, device=scores.device)


class TriesHostRead(LogitsProcessor):
    def __call__(self, input_ids, scores):
        try:
            return scores - scores.max().item()
        except RuntimeError:
            return scores


_LOG = logging.getLogger("test_purity")


class Logs(LogitsProcessor):
    def __call__(self, input_ids, scores):
        _LOG.debug("a step")  # runs the logging module's Python (a lock, handlers): not provable
        return scores


_Settings = collections.namedtuple("_Settings", "scale")


class NamedTupleSettings(LogitsProcessor):
    def __init__(self):
        self.settings = _Settings(0.5)

    def __call__(self, input_ids, scores):
        return scores * self.settings.scale


class HoldsDeque(LogitsProcessor):
    def __init__(self):
        self.window = collections.deque([0.5])  # a C container: its contents are invisible to a fingerprint

    def __call__(self, input_ids, scores):
        return scores * self.window[0]


class CachedMethod(LogitsProcessor):
    @functools.lru_cache(maxsize=None)
    def factor(self):
        return 0.5

    def __call__(self, input_ids, scores):
        return scores * self.factor()


class SetsData(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores.data = scores.data * 2  # rebinds the caller's tensor: no replay would
        return scores


class HoldsTheModel(LogitsProcessor):
    def __init__(self):
        self.model = build("llama")  # a big object graph: checking it at every step would cost what capture saves

    def __call__(self, input_ids, scores):
        return scores


class HoldsRng(LogitsProcessor):
    def __init__(self):
        self.rng = random.Random(0)

    def __call__(self, input_ids, scores):
        return scores


class StateTensor(LogitsProcessor):
    def __init__(self, vocab, device="cpu"):
        self.seen = torch.zeros(vocab, device=device)

    def __call__(self, input_ids, scores):
        self.seen = self.seen.to(scores.device)  # (a no-op after the first call)
        self.seen.add_(1)
        return scores - self.seen


class _Sub(torch.Tensor):
    pass


VOCAB = 48
PURE = {
    "extra_softmax": ExtraSoftmax, "scale": lambda: Scale(0.5), "threshold": Threshold,
    "class_constant_and_method": ClassConstant, "batch_size_and_nested_code": BatchAware,
    "constant_tensor": ConstantTensor, "dtype_round_trip": Half,
    "wraps_a_builtin": WrapsTopK, "nn_module": lambda: Learned(VOCAB), "global_helper": UsesHelper,
    "reads_another_object": ReadsConfig, "namedtuple_settings": NamedTupleSettings,
    "partial": lambda: functools.partial(scaled, factor=0.5),
    "function": lambda: scaled, "closure": lambda: closure_processor(0.25), "lambda": lambda: (lambda i, s: s * 3),
}
# pure only where its draws come from the device's default generator, which a CUDA graph advances: on CUDA (on CPU
# `torch.rand` draws from the CPU generator, whose draws a capture would bake in)
CUDA_PURE = {"noise_default_generator": Noise}
IMPURE = {
    "counter": Counter, "previous_scores": Previous, "appends_to_a_list": History, "global_counter": GlobalCounter,
    **{f"host_{k}": functools.partial(_host, k) for k in ("item", "tolist", "bool", "cpu", "nonzero", "mask")},
    **{f"input_ids_{k}": functools.partial(_reads_ids, k) for k in ("length", "unpack", "size", "last", "gather")},
    "mutates_scores": MutatesScores, "mutates_scores_in_place_op": MutatesScoresInPlaceOp, "mutates_ids": MutatesIds,
    "prints": Prints, "clock": Clock, "python_random": PyRandom, "explicit_generator": OwnGenerator,
    "writes_state_tensor": lambda: StateTensor(VOCAB), "tries_a_host_read": TriesHostRead, "logs": Logs,
    "sets_tensor_data": SetsData,
}


def _inputs(device="cpu", batch=2, length=7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g).to(device)
    return ids, torch.randn(batch, VOCAB, generator=g).to(device)


def _observed(processor, device="cpu"):
    guard = guard_for(processor)
    ids, scores = _inputs(device)
    if guard is not None:
        guard.observe(ids.clone(), scores.clone())
    return guard


class GuardFor(unittest.TestCase):
    @parameterized.expand(sorted(PURE.items()))
    def test_a_pure_processor_is_capturable_and_observe_returns_what_it_returns(self, _, make):
        ids, scores = _inputs()
        torch.manual_seed(0)
        want = make()(ids.clone(), scores.clone())
        guard = guard_for(make())
        self.assertIsNotNone(guard)
        torch.manual_seed(0)
        got = guard.observe(ids.clone(), scores.clone())
        self.assertTrue(guard.capturable, guard.reason)
        self.assertTrue(torch.equal(want, got))
        self.assertTrue(guard.unchanged())

    @parameterized.expand(sorted(IMPURE.items()))
    def test_an_impure_processor_is_rejected_and_observe_still_returns_what_stock_gets(self, _, make):
        ids, scores = _inputs()
        reference = make()
        want_ids, want_scores = ids.clone(), scores.clone()
        _reset()
        want = reference(want_ids, want_scores)
        guard = guard_for(make())
        if guard is None:
            return
        got_ids, got_scores = ids.clone(), scores.clone()
        _reset()
        got = guard.observe(got_ids, got_scores)
        self.assertIs(guard.capturable, False)
        self.assertFalse(guard.unchanged())
        for a, b in ((want, got), (want_ids, got_ids), (want_scores, got_scores)):  # same result, same side effects
            self.assertTrue(torch.equal(a, b))

    @parameterized.expand([("random_state", HoldsRng), ("deque", HoldsDeque), ("lru_cache", CachedMethod),
                           ("the_model", HoldsTheModel), ("tensor_subclass", lambda: Scale(torch.ones(2).as_subclass(_Sub)))])
    def test_state_that_no_fingerprint_sees_gives_no_guard(self, _, make):
        self.assertIsNone(guard_for(make()))

    def test_a_raising_processor_raises_as_in_stock_and_is_rejected(self):
        guard = guard_for(Raises())
        with self.assertRaisesRegex(RuntimeError, "refused"):
            guard.observe(*_inputs())
        self.assertIs(guard.capturable, False)
        self.assertFalse(guard.unchanged())

    def test_an_unobserved_guard_is_not_unchanged(self):
        self.assertFalse(guard_for(ExtraSoftmax()).unchanged())

    def test_observed_once_then_plain_calls(self):
        processor = Scale(0.5)
        guard = _observed(processor)
        ids, scores = _inputs()
        self.assertTrue(torch.equal(guard.observe(ids, scores), scores * 0.5))  # a second observe just calls it
        self.assertTrue(guard.capturable)

    def test_a_set_profiler_means_no_proof(self):
        import sys
        sys.setprofile(lambda *a: None)
        try:
            self.assertIsNone(guard_for(ExtraSoftmax()))
        finally:
            sys.setprofile(None)


class Unchanged(unittest.TestCase):
    """`unchanged()` turns False when anything the observed call read changes (and True again once restored)."""

    def assert_flips(self, processor, change, restore=None):
        guard = _observed(processor)
        self.assertTrue(guard.capturable, guard.reason)
        self.assertTrue(guard.unchanged())
        change()
        try:
            self.assertFalse(guard.unchanged())
        finally:
            if restore is not None:
                restore()
        if restore is not None:
            self.assertTrue(guard.unchanged())

    def test_an_attribute(self):
        processor = Scale(0.5)
        old = processor.factor
        self.assertFlips = self.assert_flips(processor, lambda: setattr(processor, "factor", 0.25),
                                             lambda: setattr(processor, "factor", old))

    def test_a_new_attribute(self):
        processor = ExtraSoftmax()
        self.assert_flips(processor, lambda: setattr(processor, "other", 1), lambda: delattr(processor, "other"))

    def test_a_global(self):
        global TEMPERATURE
        old = TEMPERATURE

        def change():
            global TEMPERATURE
            TEMPERATURE = 0.9

        def restore():
            global TEMPERATURE
            TEMPERATURE = old
        self.assert_flips(UsesHelper(), change, restore)

    def test_a_helper_function_replaced(self):
        global _helper
        old = _helper

        def change():
            global _helper
            _helper = lambda scores: scores  # noqa: E731

        def restore():
            global _helper
            _helper = old
        self.assert_flips(UsesHelper(), change, restore)

    def test_another_objects_attribute(self):
        old = _CONFIG.scale
        self.assert_flips(ReadsConfig(), lambda: setattr(_CONFIG, "scale", 3.0),
                          lambda: setattr(_CONFIG, "scale", old))

    def test_a_class_attribute_and_a_method(self):
        old_bias, old_shift = ClassConstant.bias, ClassConstant._shift
        self.assert_flips(ClassConstant(), lambda: setattr(ClassConstant, "bias", 0.25),
                          lambda: setattr(ClassConstant, "bias", old_bias))
        self.assert_flips(ClassConstant(), lambda: setattr(ClassConstant, "_shift", lambda self, s: s),
                          lambda: setattr(ClassConstant, "_shift", old_shift))

    def test_the_call_code_itself(self):
        class Local(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores * 2

        code = Local.__call__.__code__
        other = (lambda self, input_ids, scores: scores * 3).__code__
        self.assert_flips(Local(), lambda: setattr(Local.__call__, "__code__", other),
                          lambda: setattr(Local.__call__, "__code__", code))

    def test_a_closure_cell(self):
        factor = 0.5

        def call(input_ids, scores):
            return scores * factor

        def change():
            nonlocal factor
            factor = 0.75
        self.assert_flips(call, change)

    def test_a_partials_keywords(self):
        processor = functools.partial(scaled, factor=0.5)
        self.assert_flips(processor, lambda: processor.keywords.update(factor=0.25),
                          lambda: processor.keywords.update(factor=0.5))

    def test_a_parameter_replaced_or_a_cpu_tensor_written(self):
        module = Learned(VOCAB)
        old = module.weight
        self.assert_flips(module, lambda: setattr(module, "weight", torch.nn.Parameter(old.detach().clone())),
                          lambda: setattr(module, "weight", old))
        # a CPU tensor's value is baked into the launches at capture: an in-place write must count as a change
        self.assert_flips(module, lambda: module.weight.data.mul_(2))

    def test_default_dtype(self):
        old = torch.get_default_dtype()
        self.assert_flips(ConstantTensor(), lambda: torch.set_default_dtype(torch.float64),
                          lambda: torch.set_default_dtype(old))


class ObserveInsideStockGenerate(unittest.TestCase):
    """The first call observed inside a real (stock) generate(): the output is exactly stock's."""

    @parameterized.expand([("extra_softmax", ExtraSoftmax), ("counter", Counter),
                           ("reads_ids_last", functools.partial(_reads_ids, "last"))])
    def test_observe_changes_nothing(self, _, make):
        model = build("llama")
        ids, mask = prompt(batch=2)

        class ObserveFirst(LogitsProcessor):
            def __init__(self, processor):
                self.processor, self.guard = processor, guard_for(processor)

            def __call__(self, input_ids, scores):
                if self.guard is not None and self.guard.capturable is None:
                    return self.guard.observe(input_ids, scores)
                return self.processor(input_ids, scores)

        def run(wrap):
            torch.manual_seed(0)
            processor = make()
            with stock():
                return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=PAD,
                                      logits_processor=LogitsProcessorList([ObserveFirst(processor) if wrap
                                                                            else processor]),
                                      return_dict_in_generate=True, output_scores=True)

        assert_same(self, run(False), run(True))


# --- CUDA ---------------------------------------------------------------------------------------------------------
needs_cuda = unittest.skipUnless(CUDA, "needs a CUDA device")


class CpuHostData(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * torch.tensor([0.5], device=scores.device)


class ToCpu(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.to("cpu").to(scores.device)


class ScalarOnHost(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * torch.tensor(0.5)  # a CPU 0-dim operand: its value is a kernel argument at capture


@needs_cuda
class OnCuda(unittest.TestCase):
    @parameterized.expand([("host_data_to_device", CpuHostData, False), ("copy_to_host", ToCpu, False),
                           ("cpu_scalar_operand", ScalarOnHost, True), ("noise", Noise, True),
                           ("explicit_generator", OwnGenerator, False), ("mask", lambda: _host("mask"), False),
                           ("extra_softmax", ExtraSoftmax, True)])
    def test_device_verdicts(self, _, make, capturable):
        guard = _observed(make(), device="cuda")
        self.assertIs(guard.capturable, capturable, guard.reason)

    def test_the_default_generator_advances_in_a_replayed_graph_as_in_eager(self):
        """What a captured `Noise` relies on: each replay draws what the next eager call would have drawn."""
        scores = torch.zeros(4, 1000, device="cuda")
        torch.manual_seed(5)
        eager = [torch.rand(scores.shape, device="cuda") for _ in range(4)]
        torch.manual_seed(5)
        first = torch.rand(scores.shape, device="cuda")  # the eager first step
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin()
            out = torch.rand(scores.shape, device="cuda")
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        replays = [first]
        for _ in range(3):
            graph.replay()
            replays.append(out.clone())
        for a, b in zip(eager, replays):
            self.assertTrue(torch.equal(a, b))


def _static_generate(model, ids, mask, processor, flag, sampling, criteria=()):
    torch.manual_seed(3)
    kw = dict(max_new_tokens=12, pad_token_id=PAD, cache_implementation="static", disable_compile=True,
              do_sample=sampling, logits_processor=LogitsProcessorList([processor]),
              stopping_criteria=StoppingCriteriaList(list(criteria)), return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    if flag:
        kw["async_stopping_criteria"] = True
    return model.generate(ids, attention_mask=mask, **kw), torch.rand(4, device=ids.device)


class _SetsConfigAfter(StoppingCriteria):
    """A user criterion that changes what `ReadsConfig` reads, mid-generation (at its `n`-th call)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            _CONFIG.scale = 0.25
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
# whether the static loop consults `purity` (the tail/eligibility owner's hook); until then nothing undeclared is
# captured, and only "impure ones are never captured" is checked
_INTEGRATED = "purity" in open(eligibility.__file__).read()


class _CountCaptures:
    """Counts CUDA graph captures made inside the block (the tail's)."""

    def __enter__(self):
        self.count = 0
        real = torch.cuda.CUDAGraph.capture_end

        def capture_end(graph, *args, **kwargs):
            self.count += 1
            return real(graph, *args, **kwargs)
        self._patch = mock.patch.object(torch.cuda.CUDAGraph, "capture_end", capture_end)
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


@unittest.skipUnless(TRANSFORMERS_VERSION >= (5, 17), "the static-cache loop is taken on transformers 5.17+")
class StaticGenerateEqualsStock(unittest.TestCase):
    """Each kind of processor in a static-cache generate() with the flag equals unpatched stock: sequences, scores,
    logits and the RNG state after. Fresh processors per run (stateful ones must start equal). On CPU the loop's
    tail runs eagerly (observe included); on CUDA it is captured where the processor is proven pure."""

    @parameterized.expand([(name, sampling, device) for name in sorted({**PURE, **CUDA_PURE, **IMPURE})
                           for sampling in (False, True) for device in DEVICES if name != "mutates_ids"])
    def test_equals_stock(self, name, sampling, device):
        self._check(name, sampling, device)

    def test_a_processor_writing_input_ids_in_place_equals_stock(self):
        # stock edits generate()'s own prompt tensor at the first step: each run gets a fresh one
        self._check("mutates_ids", False, "cpu", fresh_prompt=True)

    def _check(self, name, sampling, device, fresh_prompt=False):
        make = {**PURE, **CUDA_PURE, **IMPURE}[name]
        model = build("llama", device=device)
        ids, mask = prompt(batch=2, device=device)
        stock_ids = ids.clone() if fresh_prompt else ids

        def processor():
            made = make()
            return made.to(device) if isinstance(made, torch.nn.Module) else made

        _reset()
        with stock():
            ref = _static_generate(model, stock_ids, mask, processor(), False, sampling)
        _reset()
        with _CountCaptures() as captures:
            on = _static_generate(model, ids, mask, processor(), True, sampling)
        assert_same(self, ref, on)
        if device == "cuda" and name in IMPURE:
            self.assertEqual(captures.count, 0, "an impure processor was captured")
        if device == "cuda" and (name in PURE or name in CUDA_PURE) and _INTEGRATED:
            self.assertGreater(captures.count, 0, "a proven-pure processor was not captured")

    @parameterized.expand(DEVICES)
    def test_a_value_changed_mid_generation_is_seen_as_in_stock(self, device):
        model = build("llama", device=device)
        ids, mask = prompt(batch=2, device=device)
        runs = []
        try:
            for flag in (False, True):
                _CONFIG.scale = 1.0
                with (stock() if not flag else contextlib.nullcontext()):
                    runs.append(_static_generate(model, ids, mask, ReadsConfig(), flag, True, [_SetsConfigAfter(6)]))
        finally:
            _CONFIG.scale = 1.0
        assert_same(self, *runs)


def _cost_report(device="cpu"):  # measurement, by hand: python tests/test_purity.py [cuda]
    import timeit
    ids, scores = _inputs(device)
    for name, make in sorted(PURE.items()):
        processor = make().to(device) if isinstance(make(), torch.nn.Module) else make()
        _observed(processor, device)  # warm: first-time imports and dispatch tables

        def prove():
            guard_for(processor).observe(ids, scores)
        once = min(timeit.repeat(prove, number=5, repeat=5)) / 5
        plain = min(timeit.repeat(lambda: processor(ids, scores), number=200, repeat=5)) / 200
        guard = _observed(processor, device)
        assert guard.unchanged()
        per = min(timeit.repeat(guard.unchanged, number=2000, repeat=7)) / 2000
        print(f"{name:28s} guard_for+observe {once * 1e3:6.2f} ms (plain call {plain * 1e6:6.1f} us)   "
              f"unchanged() {per * 1e6:5.2f} us ({len(guard._snapshot.nodes)} nodes)")


if __name__ == "__main__":
    import sys
    _cost_report(*sys.argv[1:2])
