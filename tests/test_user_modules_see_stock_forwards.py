"""Issue 31 (found by the usage fuzzer's user-module dimension on CUDA, 5.23.0: 24 of 2,000 scenarios): a module of
the user's own inside the model (a step counter, an activation recorder, a steering schedule) ran in the flag's extra
step too, so it saw one forward more than stock; the undo cannot reach what it did there. Default-deny
(`module_state.foreign_module`): while a module of code the package has not read is in the model, at the call's start
or swapped in mid-call, each verdict is read before the next forward (`immediate`, with the module named), so it sees
exactly stock's forwards. Eager attention keeps the graphed forward out of it: this is the deferred loop's own rule.
"""

from __future__ import annotations

import unittest

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import build, stock


class Counter(torch.nn.Module):
    """Counts its forwards and records the norm of what it passes on (an activation recorder)."""

    def __init__(self, inner, log):
        super().__init__()
        self.inner, self.log = inner, log

    def forward(self, x):
        out = self.inner(x)
        self.log.append(round(float(out.float().norm()), 4))
        return out


class _SwapAt(StoppingCriteria):
    def __init__(self, model, at, log):
        self.model, self.at, self.log, self.calls = model, at, log, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            layer = self.model.model.layers[0]
            layer.mlp = Counter(layer.mlp, self.log)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _run(flag, cache, mid_call, sample):
    model = build("llama", attn="eager")
    log = []
    criteria = StoppingCriteriaList()
    if mid_call:
        criteria.append(_SwapAt(model, 2, log))
    else:
        model.model.layers[1].mlp = Counter(model.model.layers[1].mlp, log)
        model.eval()
    ids = torch.randint(3, 48, (1, 5), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(4)
    # an EOS the greedy run reaches early, so the flag's run stops with an extra step queued
    with torch.no_grad():
        probe = model.generate(ids, max_new_tokens=6, do_sample=sample, pad_token_id=0, cache_implementation=cache,
                               **({"async_stopping_criteria": True} if flag else {}))
    torch.manual_seed(4)
    del log[:]
    eos = int(probe[0, -3])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=sample, pad_token_id=0, eos_token_id=eos,
                             cache_implementation=cache, stopping_criteria=criteria,
                             **({"async_stopping_criteria": True} if flag else {}))
    return out, list(log), torch.rand(2), (tas.last_path() if flag else None)


class UserModulesSeeStockForwards(unittest.TestCase):
    def test_a_recorder_in_the_model_sees_exactly_stock_forwards(self):
        for cache in (None, "static"):
            for sample in (False, True):
                for mid_call in (False, True):
                    with self.subTest(cache=cache, sample=sample, mid_call=mid_call):
                        with stock():
                            want = _run(False, cache, mid_call, sample)
                        got = _run(True, cache, mid_call, sample)
                        self.assertTrue(torch.equal(want[0], got[0]))
                        self.assertEqual(want[1], got[1], "the recorder saw other forwards than in stock")
                        self.assertTrue(torch.equal(want[2], got[2]), "the RNG after the call")
                        if not mid_call:  # the call says why (the static loop: in its plan's note)
                            self.assertIn("Counter", got[3].describe())

    def test_a_model_of_transformers_and_torch_modules_alone_stays_deferred(self):
        model = build("llama", attn="eager")
        ids = torch.randint(3, 48, (1, 5), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, async_stopping_criteria=True)
        self.assertEqual(tas.last_path().path, "deferred", tas.last_path().describe())


if __name__ == "__main__":
    unittest.main()
