"""transformers imported under a second path is still transformers (issue 31).

transformers' own test suite loads the package again with `direct_transformers_import(path)`, which executes its
`__init__.py` from `path` and makes that module `sys.modules["transformers"]`. Where `path` is a symlinked copy of
the installed package, `transformers.__file__` then names the copy while every class already imported keeps the
installed file names. The package told transformers' files by path prefix: `LlamaForCausalLM.forward` (a
transformers decorator's wrapper) counted as "replaced by user code", so each call read every verdict at once
(`immediate`), and the wrappers around the sources it checks counted as foreign, so no shortcut matched (stock's
slower objects, and an eager forward). Files are now compared by real path.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import unittest

import torch
import transformers
from transformers.utils.import_utils import direct_transformers_import

import transformers_async_stop
from models import PAD, assert_same, build, prompt, stock
from transformers_async_stop.release_checks import verified
from transformers_async_stop.testing.emulation import emulated
from transformers_async_stop.release_checks.targets import SHORTCUTS


class TransformersUnderASecondPath(unittest.TestCase):
    def setUp(self):
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.copy = os.path.join(folder.name, "transformers")
        os.symlink(os.path.dirname(transformers.__file__), self.copy)
        installed = sys.modules["transformers"]
        self.addCleanup(sys.modules.__setitem__, "transformers", installed)

    def _second_import(self):
        direct_transformers_import(self.copy)
        self.assertTrue(sys.modules["transformers"].__file__.startswith(self.copy))

    def test_the_checked_sources_still_match(self):
        names = [shortcut.name for shortcut in SHORTCUTS]
        before = {name: verified.installed_digests(name) for name in names}
        self._second_import()
        after = {name: verified.installed_digests(name) for name in names}
        self.assertEqual(after, before)

    def _generate(self, model, flag):
        ids, mask = prompt(batch=3, left_pad=True)
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, pad_token_id=PAD,
                             eos_token_id=[3, 7], return_dict_in_generate=True, output_scores=True,
                             **({"async_stopping_criteria": True} if flag else {}))
        return (out.sequences, out.scores, torch.rand(2)), transformers_async_stop.last_path() if flag else None

    def test_a_call_after_it_takes_the_same_path_as_before(self):
        model = build("llama")
        with stock():
            reference, _ = self._generate(model, False)
        for graphed in (False, True):
            with self.subTest(graphed=graphed):
                with emulated() if graphed else contextlib.nullcontext():
                    first, path_before = self._generate(model, True)
                    installed = sys.modules["transformers"]
                    self._second_import()
                    try:
                        second, path_after = self._generate(model, True)
                    finally:
                        sys.modules["transformers"] = installed
                assert_same(self, reference, first)
                assert_same(self, reference, second)
                self.assertEqual(path_after.path, "deferred")
                self.assertEqual(path_after, path_before)


if __name__ == "__main__":
    unittest.main()
