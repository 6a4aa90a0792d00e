"""CPU stand-in for the CUDA sync test: with the flag, a decode step reads no tensor on the host.

On CUDA every `bool(t)`, `t.item()`, `t.tolist()`, `int(t)` of a device tensor is a blocking sync. CI has no GPU,
so here we intercept those calls on CPU tensors during `generate()` and count them per decode step (N-token call
minus 1-token call). Three reads are host reads by design and allowed: the lagged verdict in `AsyncStop.step`
(pinned host memory on CUDA), the mask-skip check run on its CPU stand-in, and the padding check of a GPT-2-like
decode step without a mask (`padding_check.PendingChecks.settle`: stock's check run on a pinned copy of two columns of
the ids, taken without waiting and landed with the previous verdict).
"""

from __future__ import annotations

import traceback
import unittest
from collections import Counter
from unittest import mock

import torch
from parameterized import parameterized

from models import PAD, build, prompt

READS = ("__bool__", "item", "__int__", "__index__", "__float__", "tolist")


def _allowed(stack) -> bool:
    for frame in stack:
        if frame.name == "step" and frame.filename.endswith("stop_check.py"):
            return True
        if frame.name == "_ignore_mask_sdpa" and "stand_in" in (frame.line or ""):
            return True
        if frame.name == "settle" and frame.filename.endswith("padding_check.py"):
            return True
    return False


def host_reads(fn) -> Counter:
    seen = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def spy(name):
        def read(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            if not _allowed(stack):
                seen[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack[-3:])] += 1
            return originals[name](self, *args, **kwargs)

        return read

    with mock.patch.multiple(torch.Tensor, **{name: spy(name) for name in READS}):
        fn()
    return seen


class NoHostReadPerDecodeStep(unittest.TestCase):
    @parameterized.expand([
        (family, padded, sampling, cache)
        for family in ("llama", "gpt2", "qwen2")
        for padded in (False, True)
        for sampling in (False, True)
        for cache in ("dynamic", "static")
        if not (family == "gpt2" and cache == "static")
    ])
    def test_flag_on(self, family, padded, sampling, cache):
        model = build(family)
        ids, mask = prompt(batch=2, left_pad=padded)
        kw = dict(pad_token_id=PAD, async_stopping_criteria=True, do_sample=sampling)
        if cache == "static":
            kw.update(cache_implementation="static")
        if not padded:
            mask = None  # the common call: no mask passed at all

        def call(n):
            return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)

        # a model's first call runs its prefill under the position watch (`undo/position_table.py`), whose frame
        # would key that call's prefill reads apart from the other call's: both measured calls come after it
        call(1)()
        many, one = host_reads(call(9)), host_reads(call(1))
        per_step = {site: count - one.get(site, 0) for site, count in many.items() if count != one.get(site, 0)}
        self.assertEqual(per_step, {}, "host reads of tensors repeated every decode step")


if __name__ == "__main__":
    unittest.main()
