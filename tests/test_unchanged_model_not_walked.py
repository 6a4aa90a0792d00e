"""A model recorded and unchanged since is not walked module by module at each call (issue 38): `why_not_again` asks
`ModelGraphs.same_instances()` (every module's `__dict__` and children tables hold the very keys and objects they held
as proven) instead of the proof's walk of every `__dict__`; any table edited, whatever its size, walks again.

Each case: a tiny Llama on the CPU with the graphs emulated, recorded by two calls, then the flag against unpatched
stock (`models.stock()`)."""

from __future__ import annotations

import operator
import os
import unittest
from unittest import mock

import torch

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)


class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class UnchangedModelNotWalked(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.enterContext(mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"}))
        self.ids, self.mask = prompt(batch=1)
        self.model = build("llama")
        for _ in range(2):
            self._against_stock()
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def _against_stock(self):
        with stock():
            ref, _ = _generate(self.model, self.ids, self.mask, None, **_KW)
        out, _ = _generate(self.model, self.ids, self.mask, True, **_KW)
        self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
        for a, b in zip(ref.logits, out.logits):
            self.assertTrue(torch.equal(a, b), "logits differ from stock")

    def _walks(self):
        """The proof's walks of every module during one more call against stock: (why_instances, why_observed)."""
        deny, admission = proof.default_deny, proof.admission
        with mock.patch.object(deny, "why_instances", wraps=deny.why_instances) as instances, \
                mock.patch.object(admission, "why_observed", wraps=admission.why_observed) as observed:
            self._against_stock()
        return instances.call_count, observed.call_count

    def test_an_unchanged_model_is_not_walked_module_by_module_at_the_next_call(self):
        self.assertTrue(forward.graphs_of(self.model).same_instances())
        self.assertEqual(self._walks(), (0, 0))
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_a_private_attribute_set_to_a_module_in_place_walks_again_and_refuses(self):
        # same keys, same size: only the value's identity shows it (an unregistered module, found by the proof's walk)
        layer = self.model.model.layers[0]
        layer.__dict__["_is_full_backward_hook"] = Wrap(torch.nn.Identity())
        self.assertFalse(forward.graphs_of(self.model).same_instances())
        self.assertEqual(self._walks()[0], 1)
        self.assertIn("unregistered module", tas.last_path().forward)

    def test_a_key_renamed_in_place_with_the_same_values_walks_again(self):
        # the keys after one re-inserted in order, one renamed: every value and the size as proven
        table = self.model.model.norm.__dict__
        before = list(table.values())
        keys = list(table)
        at = keys.index("_is_full_backward_hook")
        tail = [(key, table.pop(key)) for key in keys[at:]]
        table["_renamed_flag"] = tail[0][1]
        table.update(tail[1:])
        self.assertEqual(len(table), len(before))
        self.assertTrue(all(map(operator.is_, table.values(), before)))
        self.assertFalse(forward.graphs_of(self.model).same_instances())
        self.assertEqual(self._walks()[0], 1)

    def test_a_hook_added_to_a_kept_table_is_seen_at_the_next_call(self):
        handle = self.model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 2)
        self.addCleanup(handle.remove)
        self.assertTrue(forward.graphs_of(self.model).same_instances())  # the same table, one hook more
        self._against_stock()
        self.assertEqual(tas.last_path().forward, "eager: a hook on LlamaMLP")

    def test_a_child_added_under_a_new_name_walks_again(self):
        self.model.model.layers[0].extra = Wrap(torch.nn.Identity())
        self.assertFalse(forward.graphs_of(self.model).same_instances())
        self.assertEqual(self._walks()[0], 1)
