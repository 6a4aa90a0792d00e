"""The static-cache loop's logits processors (`static_loop/processors/`, `tail.py`, `eligibility.py`), against
unpatched stock transformers, bit for bit:

- the built-ins that read the sequence (repetition penalty, encoder repetition penalty, sequence bias, bad words,
  minimum length) in their device forms: on CPU (forced) their eager form, on CUDA captured; greedy and sampling;
- processors get what stock gives them: a fresh scores tensor per step where one is not capturable, and the real
  sequence, whose in-place edits land in the output (issue 16 item 5);
- a captured processor's settings changed mid-call are noticed before the next replay (issue 16 item 6), through
  `processors.AttrGuard` or the guard `purity.guard_for` gives.

The loop's eager body is the same Python `_body` a CUDA graph captures, so the CPU tests run the device forms'
code; the CUDA tests (skipped without a device) also check that the tail was captured.
"""

from __future__ import annotations

import copy
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
)

from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, build, eos_ids_finishing_at, prompt, stock
from transformers_async_stop.loops.static_loop import eligibility, processors, tail
from transformers_async_stop.release_checks.verified import matches

LOOP_RELEASES = TRANSFORMERS_VERSION >= (5, 17)
CUDA = torch.cuda.is_available()
needs_loop = unittest.skipUnless(LOOP_RELEASES, "the static-cache loop is taken on transformers 5.17+")
needs_cuda = unittest.skipUnless(CUDA and LOOP_RELEASES, "needs a CUDA device and transformers 5.17+")


class Plans:
    """Records the loop's plans and its tails (what ran, whether the forms ran their device code, captures)."""

    def __init__(self):
        self.plans, self.tails, self.captured = [], [], 0

    def __enter__(self):
        real_plan, real_init, real_capture = eligibility.plan_loop, tail.Tail.__init__, tail.Tail._capture

        def plan_loop(*args, **kwargs):
            plan = real_plan(*args, **kwargs)
            self.plans.append(plan)
            return plan

        def init(this, *args, **kwargs):
            real_init(this, *args, **kwargs)
            self.tails.append(this)

        def capture(this, *args, **kwargs):
            scores = real_capture(this, *args, **kwargs)
            self.captured += scores is not None
            return scores

        from transformers_async_stop import generation

        self._patches = [mock.patch.object(generation.static_loop, "plan_loop", plan_loop),
                         mock.patch.object(tail.Tail, "__init__", init),
                         mock.patch.object(tail.Tail, "_capture", capture)]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self._patches):
            patch.stop()

    def forms(self):
        return [form for plan in self.plans if plan is not None for form in plan.forms]


def run_both(test, model, ids, mask, device="cpu", make=None, **kwargs):
    """generate() on stock, then with the flag (which must take the loop); outputs and the RNG draw after."""
    def run(flag):
        extra = make() if make else {}
        kw = dict(kwargs, **extra)
        if flag:
            kw["async_stopping_criteria"] = True
        torch.manual_seed(7)
        out = model.generate(ids, attention_mask=mask, **kw)
        return out, torch.rand(3, device=device), extra

    with stock():
        ref = run(False)
    with Plans() as plans:
        on = run(True)
    test.assertEqual(len(plans.tails), 1, "the static-cache loop did not run")
    assert_same(test, ref[:2], on[:2])
    return ref, on, plans


def _kwargs(model, ids, mask, sampling, **extra):
    kw = dict(max_new_tokens=12, pad_token_id=PAD, cache_implementation="static", return_dict_in_generate=True,
              output_scores=True, output_logits=True,
              eos_token_id=eos_ids_finishing_at(model, ids, mask, [3, 6, None]))
    if sampling:
        kw.update(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    kw.update(extra)
    return kw


def _sequence_bias_forms() -> bool:
    return LOOP_RELEASES and matches("static loop sequence bias")


CASES = [
    ("repetition_penalty", dict(repetition_penalty=1.3)),
    ("repetition_reward", dict(repetition_penalty=0.7)),
    ("encoder_repetition_penalty", dict(encoder_repetition_penalty=1.6)),
    ("sequence_bias", dict(sequence_bias=[[[11], 1.5], [[12, 13], -2.0], [[40, 41, 42], 3.0], [[20, 21], 0.5]])),
    ("bad_words", dict(bad_words_ids=[[9], [14, 15], [30, 31, 32]])),
    ("min_new_tokens", dict(min_new_tokens=5, repetition_penalty=1.2)),
    ("no_repeat_ngram_2", dict(no_repeat_ngram_size=2)),
    ("no_repeat_ngram_4", dict(no_repeat_ngram_size=4, repetition_penalty=1.2)),
    ("no_repeat_ngram_past_prompt", dict(no_repeat_ngram_size=8)),
    ("chat", dict(repetition_penalty=1.1, top_k=50)),
]


@needs_loop
class BuiltInsEqualStock(unittest.TestCase):
    @parameterized.expand([(name, extra, sampling) for name, extra in CASES for sampling in (False, True)])
    def test_on_cpu_the_eager_form_equals_stock(self, name, extra, sampling):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)
        _, _, plans = run_both(self, model, ids, mask, **_kwargs(model, ids, mask, sampling, **extra))
        forms = plans.forms()
        if ("repetition_penalty" in extra or "no_repeat_ngram_size" in extra
                or (name in ("sequence_bias", "bad_words") and _sequence_bias_forms())):
            self.assertTrue(forms, "the device form was not used")
        for form in forms:
            self.assertFalse(form.stock, "the form handed the call to the stock processor")

    @parameterized.expand([("int_inside_prompt", 4), ("int_past_prompt", 9), ("zero", 0)])
    def test_a_users_repetition_penalty_with_prompt_ignore_length(self, _, ignore):
        model = build("llama")
        ids, mask = prompt(batch=2)

        def make():
            return dict(logits_processor=LogitsProcessorList(
                [RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=ignore)]))

        _, _, plans = run_both(self, model, ids, mask, make=make, **_kwargs(model, ids, mask, sampling=True))
        self.assertEqual([form.stock for form in plans.forms()], [False])

    def test_a_negative_pad_token_hands_the_penalty_to_stock_which_fails_the_same_way(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        kw = dict(max_new_tokens=8, pad_token_id=-1, cache_implementation="static", repetition_penalty=1.3,
                  eos_token_id=eos_ids_finishing_at(model, ids, mask, [2, None]))
        with stock(), self.assertRaises(Exception) as ref:
            model.generate(ids, **kw)
        with Plans() as plans, self.assertRaises(Exception) as on:
            model.generate(ids, async_stopping_criteria=True, **kw)
        self.assertEqual(type(ref.exception), type(on.exception))
        self.assertEqual([form.stock for form in plans.forms()], [True])


# --- issue 16 item 5: what processors receive ------------------------------------------------------------------------
class KeepsScores(LogitsProcessor):
    """Keeps every scores tensor it is given and subtracts half of the previous one (a reference, not a copy)."""

    def __init__(self):
        self.kept = []

    def __call__(self, input_ids, scores):
        out = scores if not self.kept else scores - 0.5 * self.kept[-1]
        self.kept.append(scores)
        return out


class EditsIds(LogitsProcessor):
    """Overwrites, in place, one column of the sequence it is given at some steps: in stock that is the sequence."""

    def __init__(self, every=3):
        self.every, self.calls = every, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls % self.every == 0:
            input_ids[:, -1] = (input_ids[:, -1] + 5) % VOCAB
        return scores


class EditingCriterion(StoppingCriteria):
    """Overwrites the newest token in place at some steps: in stock the next forward reads the edited token."""

    def __init__(self, every=3):
        self.every, self.calls = every, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            input_ids[:, -1] = (input_ids[:, -1] + 7) % VOCAB
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@needs_loop
class ProcessorsGetWhatStockGives(unittest.TestCase):
    def test_a_processor_keeping_references_gets_a_fresh_scores_tensor_each_step(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        ref, on, _ = run_both(self, model, ids, mask, make=lambda: dict(logits_processor=LogitsProcessorList(
            [KeepsScores()])), **_kwargs(model, ids, mask, sampling=True))
        kept = on[2]["logits_processor"][0].kept
        self.assertEqual(len({t.data_ptr() for t in kept}), len(kept))
        assert_same(self, ref[2]["logits_processor"][0].kept, kept)

    @parameterized.expand([(1,), (3,)])
    def test_a_processor_editing_input_ids_in_place_edits_the_sequence(self, batch):
        model = build("llama")
        ids, mask = prompt(batch=batch)
        # with a repetition penalty after it: its device state is remade from the edited sequence
        ref, on, plans = run_both(self, model, ids, mask, make=lambda: dict(logits_processor=LogitsProcessorList(
            [EditsIds()])), **_kwargs(model, ids, mask, sampling=False, repetition_penalty=1.4))
        self.assertTrue(plans.forms())

    def test_a_criterion_editing_input_ids_in_place_edits_the_sequence_and_the_next_input(self):
        model = build("llama")
        ids, mask = prompt(batch=2)
        ref, on, _ = run_both(self, model, ids, mask, make=lambda: dict(stopping_criteria=StoppingCriteriaList(
            [EditingCriterion()])), **_kwargs(model, ids, mask, sampling=True, repetition_penalty=1.3))

    def test_the_sequence_handed_to_user_code_is_contiguous_and_fresh(self):
        seq = torch.arange(24).reshape(3, 8)
        plan = mock.Mock(forms=[], pure=False, observed=[], processors=[], capture=False, eos=[])
        t = tail.Tail(plan, seq, 5, torch.ones(3, dtype=torch.long), None)
        ids = t.sequence(5)
        self.assertTrue(ids.is_contiguous())
        self.assertIs(t.sequence(5), ids, "the step's criteria and the next step's processors share one tensor")
        ids[1, 2] = 99
        t.settle(5)
        self.assertEqual(int(seq[1, 2]), 99)
        self.assertIsNot(t.sequence(6), ids)


# --- issue 16 item 6: settings changed mid-call ----------------------------------------------------------------------
class AnnealTemperature(StoppingCriteria):
    """A criterion that lowers a temperature warper's temperature at every step (stock reads it every step)."""

    def __init__(self, warper):
        self.warper = warper

    def __call__(self, input_ids, scores, **kwargs):
        self.warper.temperature = max(0.2, self.warper.temperature * 0.7)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class FakeGraph:
    """Stands in for a CUDA graph on CPU: replays the body with the processors as they were at capture (a copy),
    which is what a real graph does with their Python settings."""

    made = 0

    def __init__(self, owner, length, advance):
        self.owner, self.length, self.advance = owner, length, advance
        self.frozen = copy.deepcopy(owner.processors)

    def replay(self):
        owner = self.owner
        live, owner.processors = owner.processors, self.frozen
        try:
            return owner._body(owner.seq[:, :self.length], self.advance)
        finally:
            owner.processors = live


def _fake_capture(this, key, length, advance):
    graph = FakeGraph(this, length, advance)
    FakeGraph.made += 1
    this.graphs[key] = graph
    this.outputs[key] = graph.replay()
    return this.outputs[key]


@needs_loop
class SettingsChangedMidCall(unittest.TestCase):
    def test_attr_guard_notices_every_kind_of_change(self):
        warper = TemperatureLogitsWarper(0.7)
        guard = processors.AttrGuard(warper)
        self.assertTrue(guard.unchanged())
        warper.temperature = float("0.7")  # an equal value: no change
        self.assertTrue(guard.unchanged())
        warper.temperature = 0.5
        self.assertFalse(guard.unchanged())

        class Holder:
            def __call__(self, input_ids, scores):
                return scores

        def holder():
            made = Holder()
            made.ids, made.table, made.nested = [1, 2], torch.zeros(3), [(torch.ones(2), 1)]
            return made

        changes = [
            (lambda h: h.ids.append(3), False),  # a container edited in place
            (lambda h: h.ids.__setitem__(1, 2.0), True),  # containers compare by value, as `==` does
            # a tensor edited in place: the replay reads its memory, as stock's call does (no version counter read)
            (lambda h: h.table.add_(1), True),
            (lambda h: h.table.resize_(4), False),  # a tensor's layout: baked into the graph
            (lambda h: setattr(h, "table", torch.zeros(3)), False),  # another tensor, equal values
            (lambda h: setattr(h, "table", h.table), True),  # the same tensor
            (lambda h: h.nested[0][0].mul_(2), True),  # a tensor inside a container, edited in place
            (lambda h: h.nested[0][0].resize_(3), False),  # ... and resized
            (lambda h: setattr(h, "new", 1), False),  # an attribute added
            (lambda h: setattr(h, "ids", [1, 2]), True),  # an equal list
            (lambda h: setattr(Holder, "__call__", lambda self, i, s: s * 2), False),  # the class's __call__
        ]
        for index, (change, unchanged) in enumerate(changes):
            made = holder()
            guard = processors.AttrGuard(made)
            self.assertTrue(guard.unchanged())
            change(made)
            self.assertEqual(guard.unchanged(), unchanged, f"change {index}")

    def test_a_temperature_annealed_by_a_criterion_is_honoured_after_capture(self):
        model = build("llama")
        ids, mask = prompt(batch=2)

        def make():
            warper = TemperatureLogitsWarper(0.9)
            return dict(logits_processor=LogitsProcessorList([warper]),
                        stopping_criteria=StoppingCriteriaList([AnnealTemperature(warper)]))

        real_init = tail.Tail.__init__

        def capturing_init(this, *args, **kwargs):  # capture on CPU, with the stand-in graph
            real_init(this, *args, **kwargs)
            this.capture = True

        kw = dict(max_new_tokens=12, pad_token_id=PAD, cache_implementation="static", do_sample=True, top_k=0,
                  eos_token_id=None, return_dict_in_generate=True, output_scores=True)
        FakeGraph.made = 0
        with mock.patch.object(tail.Tail, "__init__", capturing_init), \
                mock.patch.object(tail.Tail, "_capture", _fake_capture):
            _, on, plans = run_both(self, model, ids, mask, make=make, **kw)
        self.assertFalse(plans.tails[0].capture, "the changed temperature must send the call eager")
        self.assertGreater(FakeGraph.made, 0, "the stand-in graph was never captured")

    def test_the_purity_hook_observes_the_first_call_and_its_guard_gates_capture(self):
        class Softmax(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores.log_softmax(-1)

        calls = []

        class FakeGuard:
            def __init__(self, processor, verdict):
                self.processor, self.verdict, self.capturable = processor, verdict, None

            def observe(self, input_ids, scores):
                calls.append("observe")
                self.capturable = self.verdict
                return self.processor(input_ids, scores)

            def unchanged(self):
                calls.append("unchanged")
                return True

        model = build("llama")
        ids, mask = prompt(batch=2)
        for verdict in (True, False):
            calls.clear()
            fake = mock.Mock(guard_for=lambda p, v=verdict: FakeGuard(p, v) if isinstance(p, Softmax) else None)
            with mock.patch.dict("sys.modules", {"transformers_async_stop.loops.static_loop.purity": fake}):
                _, _, plans = run_both(self, model, ids, mask, make=lambda: dict(
                    logits_processor=LogitsProcessorList([Softmax()])), **_kwargs(model, ids, mask, sampling=True))
            plan, t = plans.plans[0], plans.tails[0]
            self.assertTrue(plan.pure)
            self.assertEqual(calls.count("observe"), 1)
            self.assertEqual(t.fresh, not verdict, "proven pure: fixed buffers after the observed step")

    def test_an_absent_or_broken_purity_module_captures_nothing_undeclared(self):
        class Mine(LogitsProcessor):
            def __call__(self, input_ids, scores):
                return scores

        with mock.patch.dict("sys.modules", {"transformers_async_stop.loops.static_loop.purity": None}):
            self.assertIsNone(eligibility._purity_guard(Mine()))
        broken = mock.Mock(guard_for=mock.Mock(side_effect=RuntimeError("boom")))
        with mock.patch.dict("sys.modules", {"transformers_async_stop.loops.static_loop.purity": broken}):
            self.assertIsNone(eligibility._purity_guard(Mine()))


# --- on CUDA: captured ------------------------------------------------------------------------------------------------
@needs_cuda
class CudaCapturedProcessors(unittest.TestCase):
    DEVICE = "cuda"  # the CPU under the graph emulation: test_emulated_captures.py

    @parameterized.expand([(name, extra, sampling) for name, extra in CASES for sampling in (False, True)])
    def test_captured_equals_stock(self, name, extra, sampling):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=3, left_pad=True, device=self.DEVICE)
        kw = _kwargs(model, ids, mask, sampling, disable_compile=True, **extra)
        _, _, plans = run_both(self, model, ids, mask, device=self.DEVICE, **kw)
        if name not in ("sequence_bias", "bad_words") or _sequence_bias_forms():
            self.assertTrue(plans.plans[0].capture)
            self.assertGreater(plans.captured, 0, "the tail was never captured")

    def test_the_chat_config_is_captured(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        kw = dict(max_new_tokens=16, pad_token_id=PAD, cache_implementation="static", do_sample=True,
                  temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1, disable_compile=True)
        _, _, plans = run_both(self, model, ids, mask, device=self.DEVICE, **kw)
        self.assertTrue(plans.plans[0].capture)
        self.assertGreater(plans.captured, 0)

    def test_a_temperature_annealed_mid_call_is_honoured(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=2, device=self.DEVICE)

        def make():
            warper = TemperatureLogitsWarper(0.9)
            return dict(logits_processor=LogitsProcessorList([warper]),
                        stopping_criteria=StoppingCriteriaList([AnnealTemperature(warper)]))

        kw = dict(max_new_tokens=12, pad_token_id=PAD, cache_implementation="static", do_sample=True, top_k=0,
                  eos_token_id=None, disable_compile=True, return_dict_in_generate=True, output_scores=True)
        _, _, plans = run_both(self, model, ids, mask, device=self.DEVICE, make=make, **kw)
        self.assertGreater(plans.captured, 0)
        self.assertFalse(plans.tails[0].capture)

    def test_a_processor_keeping_references_is_not_captured_and_equals_stock(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=2, device=self.DEVICE)
        with mock.patch.object(eligibility, "_purity_guard", return_value=None):
            run_both(self, model, ids, mask, device=self.DEVICE, make=lambda: dict(
                logits_processor=LogitsProcessorList([KeepsScores()])),
                **_kwargs(model, ids, mask, sampling=True, disable_compile=True))


if __name__ == "__main__":
    unittest.main()
