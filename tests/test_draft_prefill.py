"""An assistant's two-token prefill of each assisted round after the first, through the loop's piecewise forward
(`loops/dynamic_loop/prefill.py`: a port of `GenerationMixin._prefill`'s unchunked branch, 5.17-5.24).

- the port against stock's `_prefill` directly, on the installed release's form, over the branches it has (a mask
  as long as the ids, none with and without the config's `_mask_length`, the new tokens alone);
- assisted decoding with the flag on (a separate draft and a `copy.copy(target)` draft, greedy and speculative
  sampling) equal to unpatched stock, with every round's draft prefill after the first taken by the port and handed
  to the loop's piecewise forward as two tokens: CUDA (skipped without it), and the CPU with the graphs emulated;
- what keeps stock's `model._prefill`: the first round (an empty cache), a chunked prefill, a call that is not an
  assistant's, a release whose `_prefill` was not read, a model's own `_prefill`, no piecewise forward;
- the form each release takes (`targets/draft_prefill_rows.py`; the drift test in test_patching.py checks the
  digests of every row on every release).
"""

from __future__ import annotations

import contextlib
import copy
import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.loops.dynamic_loop import prefill
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.targets import SHORTCUTS, present_in
from transformers_async_stop.testing.emulation import emulated
from test_piecewise_draft import _check_against_stock

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases (the draft's loop)
CUDA = torch.cuda.is_available() and RELEASES
# the form of `_prefill` each release has (`prefill.FORMS`; 5.9-5.16 have 5.17's, and no dynamic-cache loop)
EXPECTED_FORM = ("5.17" if (5, 9) <= TRANSFORMERS_VERSION <= (5, 17) else "5.18-5.23" if (5, 18) <= TRANSFORMERS_VERSION <= (5, 23)
                 else "5.24" if TRANSFORMERS_VERSION == (5, 24) else None)


class Spied:
    """Each `prefill.run` of the call ("stock" or "port"), and what the port handed its forward."""

    def __init__(self):
        self.runs, self.forwards = [], []

    @contextlib.contextmanager
    def on(self):
        run, port = prefill.run, prefill.prefill

        def spied_run(*args, **kwargs):
            self.runs.append("stock")
            return run(*args, **kwargs)

        def spied_port(model, input_ids, generation_config, model_kwargs, is_first_iteration, graphed, form):
            self.runs[-1] = "port"

            def seen(**inputs):
                self.forwards.append((graphed, tuple(inputs["input_ids"].shape)))
                return graphed(**inputs)

            return port(model, input_ids, generation_config, model_kwargs, is_first_iteration, seen, form)

        with mock.patch.object(prefill, "run", spied_run), mock.patch.object(prefill, "prefill", spied_port):
            yield self


def _models(draft, device="cpu", dtype=torch.float32):
    target = build("llama", seed=0, device=device, dtype=dtype)
    helper = copy.copy(target) if draft == "copy" else build("llama", seed=1, device=device, dtype=dtype)
    return target, helper, prompt(batch=1, device=device)[0]


class _PortedPrefillCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated (`testing/emulation.py`)."""

    DEVICE = "cuda"

    @parameterized.expand([
        (f"{draft}_{dtype_name}_{'sample' if sample else 'greedy'}", draft, dtype, sample)
        for draft in ("separate", "copy")
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for sample in (False, True)
    ])
    def test_assisted_decoding_with_the_drafts_prefill_ported_equals_stock(self, _, draft, dtype, sample):
        target, helper, ids = _models(draft, self.DEVICE, dtype)
        with Spied().on() as spied:
            _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=sample, eos_token_id=None)
        # the first round prefills the prompt on an empty cache (stock's); every later one takes the port
        self.assertGreaterEqual(len(spied.runs), 3)
        self.assertEqual(spied.runs, ["stock"] + ["port"] * (len(spied.runs) - 1))

    @pytest.mark.core
    def test_each_later_round_hands_the_loops_forward_the_two_token_prefill(self):
        target, helper, ids = _models("separate", self.DEVICE)
        with Spied().on() as spied:
            _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        self.assertEqual(len(spied.forwards), spied.runs.count("port"))
        for graphed, shape in spied.forwards:
            self.assertIsInstance(graphed, forward.PiecewiseForward)
            self.assertTrue(graphed.draft)
            self.assertIs(graphed.model, helper)
            self.assertEqual(shape, (1, 2))
        self.assertTrue(tas.last_path().forward.startswith("draft graphed"), tas.last_path().forward)

    def test_a_draft_stopping_on_eos_equals_stock(self):
        # the draft's extra step undone in its cache: the next round's prefill starts from stock's cache
        target, helper, ids = _models("separate", self.DEVICE)
        for eos in range(3, 12):
            with Spied().on() as spied:
                _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)
            self.assertEqual(spied.runs[1:], ["port"] * (len(spied.runs) - 1))

    def test_a_chunked_prefill_keeps_stocks_prefill(self):
        # the call's `prefill_chunk_size` reaches the assistant's generation config: its chunked prefill is stock's
        target, helper, ids = _models("separate", self.DEVICE)
        with Spied().on() as spied:
            _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 prefill_chunk_size=3)
        self.assertGreaterEqual(len(spied.runs), 3)
        self.assertEqual(set(spied.runs), {"stock"})

    def test_a_release_whose_prefill_was_not_read_keeps_stocks_prefill(self):
        target, helper, ids = _models("separate", self.DEVICE)
        with Spied().on() as spied, mock.patch.object(prefill, "matches", lambda name: False):
            _check_against_stock(self, target, helper, ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        self.assertGreaterEqual(len(spied.runs), 3)
        self.assertEqual(set(spied.runs), {"stock"})

    def test_a_call_that_is_not_an_assistants_keeps_stocks_prefill(self):
        # a plain call continuing a filled cache: its prefill (the new tokens on that cache) is stock's
        model, ids = build("llama", seed=0, device=self.DEVICE), prompt(batch=1, device=self.DEVICE)[0]
        with stock():
            first = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=4,
                                   do_sample=False, eos_token_id=None, return_dict_in_generate=True)
        more = torch.cat([first.sequences, ids[:, :2]], dim=-1)
        runs = {}
        for flag in (None, True):
            cache = copy.deepcopy(cache_kwarg.of_output(first))
            extra = {} if flag is None else {"async_stopping_criteria": True}
            with (stock() if flag is None else Spied().on()) as spied:
                runs[flag] = model.generate(more, attention_mask=torch.ones_like(more), pad_token_id=0,
                                            max_new_tokens=6, do_sample=False, eos_token_id=None,
                                            return_dict_in_generate=True, output_logits=True,
                                            **{cache_kwarg.name(): cache}, **extra)
        assert_same(self, runs[None], runs[True])
        self.assertEqual(tas.last_path().loop, "dynamic")
        self.assertEqual(spied.runs, ["stock"])


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class PortedPrefillOnCuda(_PortedPrefillCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class PortedPrefillEmulatedOnCpu(_PortedPrefillCases, unittest.TestCase):
    """The same cases on the CPU, the draft's graphs emulated (recorded ATen ops replayed without Python)."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


def _filled_cache(model, ids, length):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if length:
        with torch.no_grad():
            model(ids[:, :length], use_cache=True, **{cache_kwarg.name(): cache})
    return cache


def _assistant_config(model, **changes):
    config = copy.deepcopy(model.generation_config)
    config.is_assistant = True
    for name, value in changes.items():
        setattr(config, name, value)
    return config


@unittest.skipUnless(RELEASES, "the port is taken on transformers 5.17-5.24")
class ThePortAgainstStocksPrefill(unittest.TestCase):
    """`prefill.prefill` with the model's own forward against `model._prefill`, on the installed form."""

    def setUp(self):
        self.model = build("llama", seed=1)
        self.ids = torch.cat([prompt(batch=1)[0], torch.tensor([[5, 9]])], dim=-1)  # the prompt, then two new tokens
        self.form = prefill.installed_form()
        self.assertIsNotNone(self.form)

    @parameterized.expand([
        ("a_mask_as_long_as_the_ids", "full", None),
        ("no_mask_and_a_mask_length_as_long_as_the_ids", None, "ids"),
        ("no_mask_and_another_mask_length", None, 3),
        ("no_mask_and_no_mask_length", None, None),
        ("the_new_tokens_alone_with_the_whole_mask", "new", None),
    ])
    def test_the_port_computes_stocks_prefill(self, _, mask, mask_length):
        ids, model = self.ids, self.model
        filled = ids.shape[1] - 2
        outputs = []
        for ported in (False, True):
            cache = _filled_cache(model, ids, filled)
            kwargs = {cache_kwarg.name(): cache, "use_cache": True}
            step_ids = ids[:, filled:] if mask == "new" else ids
            if mask is not None:
                kwargs["attention_mask"] = torch.ones_like(ids)
            config = _assistant_config(model)
            if mask_length is not None:
                config._mask_length = ids.shape[1] if mask_length == "ids" else mask_length
            with torch.no_grad():
                if ported:
                    out = prefill.prefill(model, step_ids, config, kwargs, False, model.__call__, self.form)
                else:
                    out = model._prefill(step_ids, config, kwargs, is_first_iteration=False)
            outputs.append((out.logits, cache))
        (ref_logits, ref_cache), (logits, cache) = outputs
        assert_same(self, ref_logits, logits)
        assert_same(self, ref_cache, cache)

    def _run(self, model, config, graphed, filled=None):
        """`prefill.run` on a cache holding all but the last two tokens (or `filled` of them)."""
        ids = self.ids
        cache = _filled_cache(model, ids, ids.shape[1] - 2 if filled is None else filled)
        kwargs = {cache_kwarg.name(): cache, "use_cache": True, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            return prefill.run(model, ids, config, kwargs, graphed)

    def test_an_assistants_prefill_on_a_filled_cache_goes_to_the_forward_it_is_handed(self):
        seen = []

        def graphed(**inputs):
            seen.append(inputs["input_ids"])
            return "the forward's outputs"

        self.assertEqual(self._run(self.model, _assistant_config(self.model), graphed), "the forward's outputs")
        self.assertEqual(len(seen), 1)
        self.assertTrue(torch.equal(seen[0], self.ids[:, -2:]))

    def test_what_keeps_stocks_prefill(self):
        model = self.model

        class OwnPrefill(type(model)):
            def _prefill(self, *args, **kwargs):
                return super()._prefill(*args, **kwargs)

        own = copy.copy(model)
        own.__class__ = OwnPrefill
        rebound = copy.copy(model)
        rebound._prefill = model._prefill
        cases = {
            "an empty cache": (model, _assistant_config(model), dict(filled=0)),
            "a chunked prefill": (model, _assistant_config(model, prefill_chunk_size=4), {}),
            "not an assistant's call": (model, _assistant_config(model, is_assistant=False), {}),
            "a model's own _prefill": (own, _assistant_config(model), {}),
            "a _prefill rebound on the instance": (rebound, _assistant_config(model), {}),
        }
        for why, (which, config, extra) in cases.items():
            with self.subTest(why):
                called = []
                out = self._run(which, config, lambda **inputs: called.append(inputs), **extra)
                self.assertEqual(called, [])
                self.assertEqual(out.logits.shape[-1], model.config.vocab_size)
        with mock.patch.object(prefill, "matches", lambda name: False):
            called = []
            self._run(model, _assistant_config(model), lambda **inputs: called.append(inputs))
            self.assertEqual(called, [], "a release whose _prefill was not read")
        # no piecewise forward: stock's
        self.assertEqual(self._run(model, _assistant_config(model), None).logits.shape[:2], (1, 2))


class Forms(unittest.TestCase):
    @pytest.mark.core
    def test_the_installed_release_takes_its_form_of_prefill(self):
        form = prefill.installed_form()
        self.assertEqual(form and form.name, EXPECTED_FORM)

    def test_every_form_has_its_release_checks_row(self):
        rows = {shortcut.name: shortcut for shortcut in SHORTCUTS}
        for form in prefill.FORMS:
            self.assertIn(form.shortcut, rows)
            self.assertEqual(rows[form.shortcut].sources, ("transformers.generation.utils:GenerationMixin._prefill",))
        # no two forms claim a release
        for minor in range(17, 26):
            claimed = [form.name for form in prefill.FORMS if present_in(rows[form.shortcut], (5, minor))]
            self.assertLessEqual(len(claimed), 1, claimed)


if __name__ == "__main__":
    unittest.main()
