"""`generate()` inside `with torch.device(...)`: the package's host buffers are made on the CPU, whatever the default
device is (issue 31).

Stock runs inside `with torch.device("cuda"):`; with the flag on, CUDA raised `RuntimeError: Only dense CPU tensors
can be pinned`: the controller's pinned verdict copies (and the streamer's, the assisted loop's, the padding check's,
the peers' sums) were made with `torch.empty(..., pin_memory=True)` and no device, so on the default device. On the
CPU the same holes show under `with torch.device("meta")` (stock's CPU model runs there; the flag's host copies were
meta tensors, and reading them raised). Each case runs flag-on against unpatched stock: the sequences, the streamer's
tokens, or the same exception.
"""

from __future__ import annotations

import ast
import os
import pathlib
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop
from models import PAD, assert_same, build, prompt, stock
from transformers_async_stop.loops.dynamic_loop import eligibility

OWN_LOOP = {eligibility.DYNAMIC_LOOP_ENV: "0"}
CASES = [("dynamic_loop", {}, {}), ("own_loop", OWN_LOOP, {}), ("static_cache", {}, {"cache_implementation": "static"}),
         ("streamer", {}, {"streamer": True}), ("own_loop_streamer", OWN_LOOP, {"streamer": True}),
         ("assisted", {}, {"assistant": True}), ("prompt_lookup", {}, {"prompt_lookup_num_tokens": 2}),
         ("sampling", {}, {"do_sample": True})]


class Tokens:
    def __init__(self):
        self.got = []

    def put(self, value):
        self.got.append(value.tolist())

    def end(self):
        self.got.append("end")


class GenerateUnderADefaultDevice(unittest.TestCase):
    device = "cpu"
    default = "meta"  # stock's CPU model runs there; a host buffer made on it cannot be read

    def _run(self, model, assistant, flag, env, kw):
        kw = dict(kw)
        streamer = Tokens() if kw.pop("streamer", False) else None
        if kw.pop("assistant", False):
            kw["assistant_model"] = assistant
        one_row = streamer is not None or "assistant_model" in kw or "prompt_lookup_num_tokens" in kw
        ids, mask = prompt(batch=1 if one_row else 3, left_pad=not one_row, device=self.device)
        kw.setdefault("do_sample", False)
        torch.manual_seed(0)
        try:
            with torch.device(self.default), mock.patch.dict(os.environ, env):
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD,
                                     eos_token_id=[3, 7, 11], streamer=streamer, **kw,
                                     **({"async_stopping_criteria": True} if flag else {}))
        except Exception as error:  # stock's own exception must be the flag's
            return type(error).__name__, str(error)
        return out, None if streamer is None else streamer.got

    @parameterized.expand(CASES)
    def test_the_flag_runs_as_stock(self, _, env, kw):
        model = build("llama", device=self.device)
        assistant = build("llama", seed=1, device=self.device)
        with stock():
            ref = self._run(model, assistant, False, env, kw)
        on = self._run(model, assistant, True, env, kw)
        assert_same(self, ref, on)
        if self.device != "cpu" or "cache_implementation" not in kw:  # (stock's static cache fails on meta)
            self.assertIsInstance(ref[0], torch.Tensor, f"stock raised: {ref}")


@unittest.skipUnless(torch.cuda.is_available(), "CUDA only")
class GenerateUnderCudaDefaultDevice(GenerateUnderADefaultDevice):
    """The reported case: a CUDA model called inside `with torch.device("cuda"):`."""

    device = "cuda"
    default = "cuda"


class PinnedHostBuffersNameTheCpu(unittest.TestCase):
    def test_every_pinned_allocation_names_the_cpu(self):
        # `pin_memory=` with no `device=` allocates on the default device, which a caller may have set to a GPU
        package = pathlib.Path(transformers_async_stop.__file__).parent
        missing = []
        for path in package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    names = {k.arg for k in node.keywords}
                    if "pin_memory" in names and "device" not in names:
                        missing.append(f"{path.relative_to(package)}:{node.lineno}")
                    if isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory":
                        missing.append(f"{path.relative_to(package)}:{node.lineno} (.pin_memory())")
        self.assertEqual(missing, [])


if __name__ == "__main__":
    unittest.main()
