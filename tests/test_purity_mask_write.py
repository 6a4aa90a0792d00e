"""`static_loop.purity` on a boolean-mask write alone (`out[scores < 0] = -inf`), whose aten op changed with torch:
torch 2.13 dispatches `index_put_` with the boolean mask as its index (a kernel that turns the mask into indices: on
CUDA a host read, and a capture would bake in the capture step's mask), torch 2.15 `masked_fill_` (a device kernel
that reads the mask at every replay). The proof judges the op torch dispatches, not the Python spelling: rejected on
the one, capturable on the other, and generate() with the flag equals unpatched stock on both. A torch that
dispatches something else fails here until someone decides what that op reads.

(`test_purity.py`'s `host_mask` processor also reads by the mask, `scores[m]`: a value-dependent shape on every torch.)
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LogitsProcessor

from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from test_purity import _INTEGRATED, DEVICES, _CountCaptures, _inputs, _static_generate
from transformers_async_stop.loops.static_loop.purity import guard_for

_INDEX_PUT = ("index_put", "index_put_", "_index_put_impl_")
_MASKED_FILL = ("masked_fill", "masked_fill_")


class MaskWrite(LogitsProcessor):
    def __call__(self, input_ids, scores):
        out = scores.clone()
        out[scores < 0] = -float("inf")
        return out


class _Ops(TorchDispatchMode):
    """The aten ops a call dispatches, with whether any tensor index among their arguments is boolean."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        self.ops.append((func._schema.name.split("::")[-1],
                         any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)))
        return func(*args, **(kwargs or {}))


def _mask_write_reads_the_host(device) -> bool:
    """Whether this torch's aten op for `out[m] = v` turns the mask into indices (True: `index_put_` with a boolean
    index) or fills on the device (False: `masked_fill_`)."""
    ids, scores = _inputs(device)
    with _Ops() as seen:
        MaskWrite()(ids, scores)
    names = [name for name, _ in seen.ops]
    if any(name in _INDEX_PUT and boolean for name, boolean in seen.ops):
        return True
    if any(name in _MASKED_FILL for name in names) and not any(name in _INDEX_PUT for name in names):
        return False
    raise AssertionError(f"torch {torch.__version__} dispatches {names} for `out[m] = v` on {device}: decide whether "
                         "that reads the host, then teach this test (and the proof, if it must reject it)")


class MaskWriteVerdict(unittest.TestCase):
    @parameterized.expand(DEVICES)
    def test_a_boolean_mask_write_is_rejected_exactly_where_torch_dispatches_an_index_put(self, device):
        reads_host = _mask_write_reads_the_host(device)
        ids, scores = _inputs(device)
        want = MaskWrite()(ids.clone(), scores.clone())
        guard = guard_for(MaskWrite())
        self.assertIsNotNone(guard)
        got = guard.observe(ids.clone(), scores.clone())
        self.assertTrue(torch.equal(want, got))
        self.assertIs(guard.capturable, not reads_host, f"torch {torch.__version__}: {guard.reason}")
        if reads_host:
            self.assertIn("boolean mask", guard.reason)
        self.assertIs(guard.unchanged(), not reads_host)


@unittest.skipUnless(TRANSFORMERS_VERSION >= (5, 17), "the static-cache loop is taken on transformers 5.17+")
class MaskWriteGenerateEqualsStock(unittest.TestCase):
    @parameterized.expand([(device, sampling) for device in DEVICES for sampling in (False, True)])
    def test_a_boolean_mask_write_in_static_generate_equals_stock(self, device, sampling):
        model = build("llama", device=device)
        ids, mask = prompt(batch=2, device=device)
        with stock():
            ref = _static_generate(model, ids, mask, MaskWrite(), False, sampling)
        with _CountCaptures() as captures:
            on = _static_generate(model, ids, mask, MaskWrite(), True, sampling)
        assert_same(self, ref, on)
        if device == "cuda" and _mask_write_reads_the_host(device):
            self.assertEqual(captures.count, 0, "a processor whose op reads the host was captured")
        elif device == "cuda" and _INTEGRATED:
            self.assertGreater(captures.count, 0, "a mask write torch fills on the device was not captured")
