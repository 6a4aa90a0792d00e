"""CPU stand-in for the CUDA sync counts of assisted decoding and prompt lookup (tests/test_assisted.py,
`CudaAtMostOneSyncPerRound`): with the flag, a verify round reads the device once, in the round's one pinned copy,
and a drafted token not at all.

On CUDA every `bool(t)`, `t.item()`, `t.tolist()`, `int(t)`, `t.cpu()` of a device tensor is a blocking sync, and
so is `torch.tensor(x, device=...)`. CI has no GPU, so here those calls are intercepted on CPU tensors during
`generate()` and counted per round: the reads of a long call minus those of a short one, divided by the difference
in target forwards. The round's verdict reaches the host through `RoundBox.receive` (numpy, no tensor read): it is
counted separately and must be exactly one per round. Reads of memory that is on the host by design are allowed:
- the SDPA mask-skip check run on its CPU stand-in (`masking.py`), as in tests/test_host_reads.py;
- prompt lookup's n-gram search, which runs on the host copy of the sequence (`HostLookup.get_candidates`);
- 5.21+: the assistant's "is the mask all ones" check, once per round where the package handed it a CPU mask
  (`DraftRun.host_mask`); on CUDA that mask is a CPU tensor too.
Stock is measured the same way, so the counter is known to see its reads.
"""

from __future__ import annotations

import linecache
import traceback
import unittest
from collections import Counter
from unittest import mock

import pytest
import torch
from parameterized import parameterized

from models import PAD, stock
from test_assisted import NEVER, PORTED, CountForwards, draft, draft_config, lookup_prompt, prompt, target
from transformers_async_stop.loops.assisted import acceptance, draft as draft_module

READS = ("__bool__", "item", "__int__", "__index__", "__float__", "tolist", "cpu")


def _host_side(stack) -> str | None:
    """Which designated host read this is, if any."""
    for frame in stack:
        if frame.name == "_ignore_mask_sdpa" and "stand_in" in (frame.line or ""):
            return "stand-in"
        if frame.name == "get_candidates" and frame.filename.endswith("assisted/lookup.py"):
            return "mirror"
    last = stack[-1]
    if last.name == "generate" and last.filename.endswith("generation/utils.py"):
        # a multi-line condition reports the line of its `if (`
        statement = "".join(linecache.getline(last.filename, last.lineno + i) for i in range(6))
        if '["attention_mask"] == 1).all()' in statement:
            return "mask drop"
    return None


def reads_during(fn):
    """(device reads by site, host-side reads by kind, round-box reads, masks handed to the assistant on the host)."""
    device, host = Counter(), Counter()
    boxes, masks = [0], [0]
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    receive, host_mask, tensor = acceptance.RoundBox.receive, draft_module.DraftRun.host_mask, torch.tensor

    def site(stack):
        return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stack[-3:])

    def spy(name):
        def read(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            kind = _host_side(stack)
            if kind is None:
                device[f"{name} {site(stack)}"] += 1
            else:
                host[kind] += 1
            return originals[name](self, *args, **kwargs)

        return read

    def counted_receive(self):
        boxes[0] += 1
        return receive(self)

    def counted_host_mask(self, *args, **kwargs):
        mask = host_mask(self, *args, **kwargs)
        masks[0] += mask is not None
        return mask

    def counted_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:  # a blocking H2D copy on CUDA
            device[f"torch.tensor(device=) {site(traceback.extract_stack()[:-1])}"] += 1
        return tensor(*args, **kwargs)

    with mock.patch.multiple(torch.Tensor, **{name: spy(name) for name in READS}), \
            mock.patch.object(acceptance.RoundBox, "receive", counted_receive), \
            mock.patch.object(draft_module.DraftRun, "host_mask", counted_host_mask), \
            mock.patch.object(torch, "tensor", counted_tensor):
        fn()
    return device, host, boxes[0], masks[0]


def per_round(flag: bool, method: str, sample: bool):
    ids = lookup_prompt() if method == "lookup" else prompt(batch=1)[0]
    model = target()
    kw = dict(pad_token_id=PAD, eos_token_id=NEVER, do_sample=sample)
    if method == "lookup":
        kw["prompt_lookup_num_tokens"] = 3
    else:
        helper = draft("shared")
        helper.generation_config = draft_config("shared")
        kw["assistant_model"] = helper
    if flag:
        kw["async_stopping_criteria"] = True

    def call(n):
        counter = CountForwards(model)
        torch.manual_seed(0)
        try:
            return reads_during(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                       **kw)), counter.count
        finally:
            counter.close()

    (long, long_rounds), (short, short_rounds) = call(20), call(2)
    rounds = long_rounds - short_rounds
    assert rounds > 0
    device = {site: (count - short[0].get(site, 0)) / rounds for site, count in long[0].items()
              if count != short[0].get(site, 0)}
    mask_drops = long[1]["mask drop"] - short[1]["mask drop"]
    masks = long[3] - short[3]
    return device, (long[2] - short[2]) / rounds, mask_drops, masks


CASES = [("assisted", False), ("assisted", True), ("lookup", False), ("lookup", True)]


class AtMostOneReadPerRound(unittest.TestCase):
    @parameterized.expand(CASES)
    @pytest.mark.core
    @unittest.skipUnless(PORTED, "this transformers release's assisted decoding loop was not ported: it runs stock")
    def test_flag_on_reads_the_device_only_in_the_rounds_copy(self, method, sample):
        device, boxes, mask_drops, masks = per_round(True, method, sample)
        self.assertEqual(device, {}, "host reads of device tensors repeated every verify round or drafted token")
        self.assertEqual(boxes, 1.0, "the round's verdict comes back in exactly one copy per round")
        self.assertLessEqual(mask_drops, masks, "a mask-drop check read a mask the package did not put on the host")

    @parameterized.expand(CASES)
    def test_stock_reads_the_device_several_times_per_round(self, method, sample):
        with stock():
            device, boxes, _, _ = per_round(False, method, sample)
        self.assertEqual(boxes, 0.0)
        self.assertGreater(sum(device.values()), 1.0, "the counter sees stock's reads")


if __name__ == "__main__":
    unittest.main()
