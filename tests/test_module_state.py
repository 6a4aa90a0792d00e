"""State a module keeps on itself and changes inside its forward (issue 25, item 2).

A rope of type `dynamic` grows `inv_freq` / `max_seq_len_cached` with the longest position it has seen, and `longrope`
switches `inv_freq` between its short and long factors. The flag's extra step runs one more forward, one position
further, than stock: before the fix the rotary module kept what that forward left there (`max_seq_len_cached` 12 where
stock has 11) and the next call's logits could differ. Each test compares a call that stops on EOS, then the rotary
module's whole state, then a next call, against unpatched transformers.
"""

from __future__ import annotations

import unittest

import pytest
import torch
from parameterized import parameterized

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, build, stock
from transformers_async_stop.undo.module_state import why_stateful

ROPE_THETA = 10000.0
ORIGINAL_MAX = 8  # the tiny model's original length: a 6-token prompt crosses it within a call
HALF_HEAD = 4
# the token the call stops at: the prefill is at length 6, decode step k at 6 + k; stopping at token n puts stock's
# last forward at 5 + n and the extra step's at 6 + n (longrope switches factors past ORIGINAL_MAX = 8)
STOP = {"dynamic": 6, "longrope": 3, "default": 6, "linear": 6, "yarn": 6, "llama3": 6}  # llama of tests/models.py: hidden 16, 2 heads -> head_dim 8


def rope(rope_type: str) -> dict:
    params = {"rope_type": rope_type, "rope_theta": ROPE_THETA}
    if rope_type in ("dynamic", "linear"):
        params["factor"] = 2.0
    elif rope_type == "yarn":
        params.update(factor=2.0, original_max_position_embeddings=ORIGINAL_MAX)
    elif rope_type == "llama3":
        params.update(factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=ORIGINAL_MAX)
    elif rope_type == "longrope":
        params.update(short_factor=[1.0, 1.5, 2.0, 2.5][:HALF_HEAD], long_factor=[3.0, 4.0, 5.0, 6.0][:HALF_HEAD],
                      original_max_position_embeddings=ORIGINAL_MAX)
    return params


def model_with(rope_type: str):
    if TRANSFORMERS_VERSION >= (5, 0):
        return build("llama", seed=0, rope_parameters=rope(rope_type), max_position_embeddings=ORIGINAL_MAX)
    # 4.x spells it `rope_scaling` (no theta inside), and longrope needs its `factor` given
    scaling = {k: v for k, v in rope(rope_type).items() if k != "rope_theta"}
    if rope_type == "longrope":
        scaling["factor"] = 2.0
    return build("llama", seed=0, rope_scaling=None if rope_type == "default" else scaling,
                 max_position_embeddings=ORIGINAL_MAX)


def rotary_state(model) -> dict:
    """Everything the rotary module keeps: its attributes and buffers, tensors copied."""
    rotary = model.model.rotary_emb
    state = {}
    for name, value in sorted(vars(rotary).items()):
        if name in ("config", "training") or name.startswith("_") and name not in ("_buffers",):
            continue
        state[name] = value.clone() if isinstance(value, torch.Tensor) else value
    state["_buffers"] = {k: v.clone() for k, v in rotary._buffers.items()}
    return state


def assert_state_equal(test, a, b, path="rotary"):
    test.assertEqual(sorted(a), sorted(b), path)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert_state_equal(test, x, y, f"{path}.{key}")
        elif isinstance(x, torch.Tensor):
            test.assertTrue(torch.equal(x, y), f"{path}.{key}: {x} vs {y}")
        else:
            test.assertEqual(x, y, f"{path}.{key}")


class RotaryStateAfterAnEarlyStop(unittest.TestCase):
    def run_case(self, rope_type, cache, do_sample, flag):
        model = model_with(rope_type)
        ids = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(1))
        kw = dict(max_new_tokens=12, do_sample=do_sample, pad_token_id=PAD, cache_implementation=cache)
        with stock():
            torch.manual_seed(5)
            free = model.generate(ids, eos_token_id=None, **kw)
        # the call stops at token `STOP[rope_type]` (each row's token there is an EOS id); longrope's state differs
        # only where the last real forward is at the original length and the extra step's one past it
        eos = sorted(set(free[:, 6 + STOP[rope_type] - 1].tolist()))
        model = model_with(rope_type)  # a fresh rotary module for the compared call
        torch.manual_seed(5)
        if flag:
            out = model.generate(ids, eos_token_id=eos, async_stopping_criteria=True, **kw)
            path = tas.last_path()
        else:
            with stock():
                out = model.generate(ids, eos_token_id=eos, **kw)
            path = None
        if not flag and rope_type in ("dynamic", "longrope"):
            self.assertEqual(out.shape[1], 6 + STOP[rope_type], "the case must stop where the states would differ")
        state = rotary_state(model)
        # a next call at a length between: stock and the flag's state disagreed exactly there
        nxt = torch.randint(3, 48, (1, out.shape[1]), generator=torch.Generator().manual_seed(2))
        with stock():
            logits = model(nxt).logits
        return out, state, logits, torch.rand(3), path

    @parameterized.expand([(r, c, s) for r in ("dynamic", "longrope") for c in (None, "static")
                           for s in (False, True)])
    def test_rope_state_and_next_call_equal_stock(self, rope_type, cache, do_sample):
        plain = self.run_case(rope_type, cache, do_sample, flag=False)
        fast = self.run_case(rope_type, cache, do_sample, flag=True)
        self.assertTrue(torch.equal(plain[0], fast[0]), "sequences")
        assert_state_equal(self, plain[1], fast[1])
        self.assertTrue(torch.equal(plain[2], fast[2]), "the next call's logits")
        self.assertTrue(torch.equal(plain[3], fast[3]), "the RNG state after the call")
        self.assertEqual(fast[4].path, "stock")
        self.assertIn(rope_type, fast[4].reason)

    @parameterized.expand([(r,) for r in ("default", "linear", "yarn", "llama3")])
    def test_ropes_computed_once_keep_the_fast_path(self, rope_type):
        plain = self.run_case(rope_type, None, False, flag=False)
        fast = self.run_case(rope_type, None, False, flag=True)
        self.assertTrue(torch.equal(plain[0], fast[0]))
        assert_state_equal(self, plain[1], fast[1])
        self.assertTrue(torch.equal(plain[2], fast[2]))
        self.assertEqual(fast[4].path, "deferred")

    def test_beam_search_with_a_dynamic_rope_equals_stock(self):
        model = model_with("dynamic")
        ids = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(1))
        kw = dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=PAD, eos_token_id=[7, 9, 11])
        with stock():
            plain = model.generate(ids, **kw)
        plain_state = rotary_state(model)
        model = model_with("dynamic")
        fast = model.generate(ids, async_stopping_criteria=True, **kw)
        self.assertTrue(torch.equal(plain, fast))
        assert_state_equal(self, plain_state, rotary_state(model))
        self.assertEqual(tas.last_path().path, "stock")


@pytest.mark.core
class StatefulModulesAreFound(unittest.TestCase):
    """The drift check of `why_stateful`: it recognises transformers' rope decorator by its code object, so a release
    that changes the decorator must fail here rather than let the extra step change a rope's state."""

    def test_dynamic_and_longrope_are_found(self):
        for rope_type in ("dynamic", "longrope"):
            reason = why_stateful(model_with(rope_type))
            self.assertIsNotNone(reason, rope_type)
            self.assertIn("rotary_emb", reason)

    def test_ropes_computed_once_are_not(self):
        for rope_type in ("default", "linear", "yarn", "llama3"):
            self.assertIsNone(why_stateful(model_with(rope_type)), rope_type)
        self.assertIsNone(why_stateful(build("gpt2")))
