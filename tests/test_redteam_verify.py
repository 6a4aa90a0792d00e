"""Red team of the graphed verify forward (issue 32, a82662d): usage the K-token recordings were not written against.

Each test runs assisted decoding (or the verify forward itself) with the flag under the CPU emulation of CUDA graphs
and compares with unpatched transformers: the sequences, scores and logits, the returned cache, the RNG state after
the call, what the user code saw, exceptions, module state. The note: docs/red-team/2026-11-27-verify-forward.md.
Tests marked `# HOLE n (fixed)` failed on a82662d and pass since the fixes; the rest
pin usage that held.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
import threading
import time
import unittest
import weakref
from unittest import mock

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate
from test_piecewise_verify import _crop, _filled_cache, _verify_inputs

# heavy: run on 5.17.0 and 5.24.0 in CI (noxfile `SLOW_ON`), as the other red-team files
pytestmark = pytest.mark.slow

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the releases of the package's dynamic-cache loop
ON = {proof.PIECEWISE_ENV: "1"}
ROUNDS = dict(max_new_tokens=30, do_sample=False, eos_token_id=None)


class AtRound(LogitsProcessor):
    """A processor of the outer call that runs `action(model)` once, the first time it sees `at` distinct lengths
    (between two verify rounds), and records the lengths it saw."""

    def __init__(self, model, at, action):
        self.model, self.at, self.action, self.lengths, self.done = model, at, action, [], False

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] not in self.lengths:
            self.lengths.append(input_ids.shape[1])
        if not self.done and len(self.lengths) >= self.at:
            self.done = True
            self.action(self.model)
        return scores


def _outcome(model, flag, helper, action, at=6, **kwargs):
    """One assisted call with `action` run between rounds: (output or the exception's type and message, the RNG
    after, the lengths the processor saw)."""
    processor = AtRound(model, at, action)
    try:
        out, after = _generate(model, prompt(batch=1)[0], torch.ones(1, 6, dtype=torch.long), flag,
                               assistant_model=helper, logits_processor=LogitsProcessorList([processor]),
                               **{**ROUNDS, **kwargs})
    except Exception as error:  # noqa: BLE001 (stock's exception is part of what is compared)
        out, after = (type(error).__name__, str(error)), torch.rand(4)
    return out, after, processor.lengths


def _against_stock(test, action, at=6, **kwargs):
    """`action` mid-call on a fresh target in each run (the stock one unpatched, then the flag's)."""
    with stock():
        ref = _outcome(build("llama"), None, build("llama", seed=1), action, at, **kwargs)
    out = _outcome(build("llama"), True, build("llama", seed=1), action, at, **kwargs)
    assert_same(test, ref[0], out[0], "the call's output (or exception)")
    assert_same(test, ref, out)
    return out


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class VerifyRedTeam(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    # --- HOLE 1: a config field added mid-call ------------------------------------------------------------------
    # `ModelGraphs.changed` compares the config fields that existed at the snapshot (and the size of every module's
    # `__dict__`), not the size of the configs' `__dict__`s: a field user code adds between two rounds is not seen.
    # Stock's base forward reads such fields at every call (`merge_with_config_defaults`, 5.17-5.24: `is_causal`
    # becomes an attention keyword, `vision_feature_select_strategy` is validated); a replay ran that Python once.

    # HOLE 1 (fixed): config.is_causal added mid-call is an attention keyword in stock, not in a replay
    def test_config_is_causal_set_between_verify_rounds_reaches_the_attention_as_in_stock(self):
        target = build("llama")
        cache = _filled_cache(target)
        ids = torch.tensor([[5, 6]])
        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        with torch.no_grad():
            for step in range(4):  # seen once, recorded, replayed, replayed with the field added
                if step == 3:
                    target.config.is_causal = False  # stock then passes `is_causal=False` to SDPA
                inputs = _verify_inputs(target, cache, ids)
                eager_cache = copy.deepcopy(cache)
                eager = target(**{**inputs, cache_kwarg.name(): eager_cache})
                out = call(**inputs)
                self.assertTrue(torch.equal(out.logits, eager.logits), f"step {step}: {call.last_eager}")
                _crop(cache)

    # HOLE 1 (fixed): the same through generate(): the sequences differ from stock's
    def test_config_is_causal_set_by_a_processor_mid_call_equals_stock(self):
        _against_stock(self, lambda model: setattr(model.config, "is_causal", False))

    # HOLE 1 (fixed): stock's next forward raises (ValueError), the replays return
    def test_a_config_field_added_mid_call_that_stocks_forward_refuses_raises_as_in_stock(self):
        out = _against_stock(self, lambda model: setattr(model.config, "vision_feature_select_strategy", "bogus"))
        self.assertEqual(out[0][0], "ValueError")

    # --- HOLE 2: the cap's eviction drops the recording it has just made -------------------------------------------
    # HOLE 2 (fixed): `_evict` runs after the new recording is stored, and it has the fewest replays
    def test_a_width_recorded_with_the_cap_full_of_replayed_widths_is_replayed_at_its_next_sighting(self):
        # exact either way; a new width once the cap holds MAX_WIDE replayed widths (the "heuristic" schedule drifting
        # over calls) is captured at every sighting and never replayed: each round pays a capture instead of a forward
        target = build("llama")
        cache = _filled_cache(target)
        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        recorded = []
        real = forward.record

        def counted(*args, **kwargs):
            recorded.append(args[2]["input_ids"].shape[1])
            return real(*args, **kwargs)

        with torch.no_grad(), mock.patch.object(forward, "record", counted):
            for width in range(2, 2 + forward.MAX_WIDE):
                for _ in range(3):  # seen once, recorded, replayed
                    call(**_verify_inputs(target, cache, torch.full((1, width), 5)))
                    _crop(cache)
            recorded.clear()
            for _ in range(4):
                call(**_verify_inputs(target, cache, torch.full((1, 12), 5)))
                _crop(cache)
        self.assertEqual(recorded, [12])

    # --- HOLE 3: another thread's rebinding of the modeling module's mask function ---------------------------------
    # HOLE 3 (fixed): `masks.swapped` restores what it saw, over another thread's rebinding
    def test_a_mask_function_rebound_by_another_thread_during_a_recording_stays_rebound(self):
        from transformers import masking_utils
        from transformers.models.llama import modeling_llama

        own = modeling_llama.create_causal_mask
        self.addCleanup(setattr, modeling_llama, "create_causal_mask", own)

        def users(*args, **kwargs):
            return masking_utils.create_causal_mask(*args, **kwargs)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        self.addCleanup(sys.setswitchinterval, interval)
        caught = []
        for seed in range(3):
            done = threading.Event()

            def rebind():
                # another thread's code (a patch, a plugin's setup) rebinds the module function while this thread
                # records a K-token verify forward; stock keeps a rebinding until someone rebinds it again
                while not done.is_set():
                    if hasattr(modeling_llama.create_causal_mask, "_tas_piecewise_original"):
                        modeling_llama.create_causal_mask = users
                        caught.append(seed)
                        return
                    time.sleep(0)

            watcher = threading.Thread(target=rebind)
            watcher.start()
            try:
                _generate(build("llama", seed=seed), prompt(batch=1)[0], torch.ones(1, 6, dtype=torch.long), True,
                          assistant_model=build("llama", seed=seed + 1), **ROUNDS)
            finally:
                done.set()
                watcher.join()
            if caught:
                break
            modeling_llama.create_causal_mask = own
        if not caught:
            self.skipTest("the other thread never ran during a recording")
        self.assertIs(modeling_llama.create_causal_mask, users)

    # --- HOLE 4: a recorded model is never freed ---------------------------------------------------------------------
    # HOLE 4 (fixed): the store's value (`ModelGraphs.modules`, `.dicts`) holds its weak key
    def test_a_model_whose_verify_forward_was_recorded_is_freed_with_it(self):
        # `staleness._STORE` is a WeakKeyDictionary whose values must not reach their model; the snapshot keeps
        # `list(model.modules())` (the model first) and every module's `__dict__`: the model, its weights and (CUDA)
        # its graph pool live as long as the process (the decode path's recordings too: tests/test_piecewise.py
        # `Store` records nothing, so it passes)
        target, helper = build("llama"), build("llama", seed=1)
        _generate(target, prompt(batch=1)[0], torch.ones(1, 6, dtype=torch.long), True, assistant_model=helper,
                  **ROUNDS)
        self.assertTrue(any(key[1] > 1 for key in forward.graphs_of(target).recordings))
        target_ref, helper_ref = weakref.ref(target), weakref.ref(helper)
        del target, helper
        gc.collect()
        self.assertIsNone(target_ref())
        self.assertIsNone(helper_ref())

    # --- what held ------------------------------------------------------------------------------------------------
    def test_the_modeling_modules_mask_function_rebound_mid_call_runs_at_the_later_rounds(self):
        from transformers import masking_utils
        from transformers.models.llama import modeling_llama

        self.addCleanup(setattr, modeling_llama, "create_causal_mask", modeling_llama.create_causal_mask)

        def hide_the_first_column(model):
            own = masking_utils.create_causal_mask

            def mask(*args, **kwargs):
                made = own(*args, **kwargs)
                if made is not None and made.dim() == 4:
                    made = made.clone()
                    made[..., 0] = False
                return made

            modeling_llama.create_causal_mask = mask

        for flag in (None, True):  # each run rebinds it anew from transformers' own
            modeling_llama.create_causal_mask = masking_utils.create_causal_mask
            if flag is None:
                with stock():
                    ref = _outcome(build("llama"), None, build("llama", seed=1), hide_the_first_column)
            else:
                out = _outcome(build("llama"), True, build("llama", seed=1), hide_the_first_column)
        assert_same(self, ref, out)
        self.assertIn("create_causal_mask was replaced", tas.last_path().verify)

    def test_an_sdpa_mask_function_registered_mid_call_runs_at_the_later_rounds(self):
        from transformers import masking_utils

        registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
        own = registry._global_mapping["sdpa"]
        self.addCleanup(registry._global_mapping.__setitem__, "sdpa", own)

        def register(model):
            def mask(*args, **kwargs):
                made = own(*args, **{**kwargs, "allow_is_causal_skip": False})
                made = made.clone()
                made[..., 0] = False
                return made

            registry.register("sdpa", mask)

        with stock():
            ref = _outcome(build("llama"), None, build("llama", seed=1), register)
        registry._global_mapping["sdpa"] = own
        out = _outcome(build("llama"), True, build("llama", seed=1), register)
        assert_same(self, ref, out)

    def test_a_2d_mask_of_any_dtype_with_zeros_in_the_middle_equals_stock(self):
        ids = prompt(batch=1)[0].clone()
        for dtype in (torch.bool, torch.float32, torch.int32):
            mask = torch.tensor([[1, 1, 0, 1, 0, 1]]).to(dtype)
            ids[mask == 0] = PAD
            with stock():
                ref = _generate(build("llama"), ids, mask, None, assistant_model=build("llama", seed=1), **ROUNDS)
            out = _generate(build("llama"), ids, mask, True, assistant_model=build("llama", seed=1), **ROUNDS)
            assert_same(self, ref, out)
            self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_an_interrupt_from_a_processor_mid_call_leaves_the_next_call_equal_to_stock(self):
        def interrupt(model):
            raise KeyboardInterrupt

        runs = {}
        for flag in (None, True):
            target, helper = build("llama"), build("llama", seed=1)
            with (stock() if flag is None else contextlib.nullcontext()):
                with self.assertRaises(KeyboardInterrupt):
                    _outcome(target, flag, helper, interrupt, at=8)
                runs[flag] = [_outcome(target, flag, helper, lambda model: None, at=10**6) for _ in range(2)]
        assert_same(self, runs[None], runs[True])

    def test_two_threads_each_in_an_assisted_call_equal_stock(self):
        def pairs():
            return [(build("llama", seed=seed), build("llama", seed=seed + 1)) for seed in (0, 2)]

        with stock():
            refs = [[_generate(t, prompt(batch=1, seed=n)[0], torch.ones(1, 6, dtype=torch.long), None,
                               assistant_model=h, **ROUNDS)[0] for n in range(2)] for t, h in pairs()]
        outs = [[None, None], [None, None]]

        def run(k, target, helper):
            for n in range(2):
                outs[k][n] = _generate(target, prompt(batch=1, seed=n)[0], torch.ones(1, 6, dtype=torch.long), True,
                                       assistant_model=helper, **ROUNDS)[0]

        threads = [threading.Thread(target=run, args=(k, *pair)) for k, pair in enumerate(pairs())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert_same(self, refs, outs)


if __name__ == "__main__":
    unittest.main()
