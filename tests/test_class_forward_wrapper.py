"""A class-level `forward` wrapper sees exactly the forwards stock runs (the usage fuzzer's seed 5026).

`type(model).forward = wrapper` (a logger, a profiler, an interpretability tool) is user code that runs at every
forward, like a forward hook, but torch's hook registry never sees it. The flag's extra step ran one forward more
than stock when the call stopped early: the wrapper, installed before the call or mid-call by a processor, recorded a
call stock never made. While such a wrapper is on the model's class, each verdict is read before the next forward
(`module_state.HookWatch`), as for hooks.
"""

from __future__ import annotations

import functools
import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList

from models import PAD, build, stock

PROMPT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


class Wrap:
    """Installs a recording class-level forward on `type(model)`; `undo()` puts the original back."""

    def __init__(self, model):
        self.cls, self.original, self.calls = type(model), type(model).forward, []

    def install(self):
        original, calls = self.original, self.calls

        @functools.wraps(original)
        def forward(this, *args, **kwargs):
            calls.append(kwargs["input_ids"].shape[-1] if kwargs.get("input_ids") is not None else None)
            return original(this, *args, **kwargs)

        self.cls.forward = forward

    def undo(self):
        self.cls.forward = self.original


class WrapAt(LogitsProcessor):
    def __init__(self, wrap, at):
        self.wrap, self.at, self.step = wrap, at, 0

    def __call__(self, input_ids, scores):
        if self.step == self.at:
            self.wrap.install()
        self.step += 1
        return scores


def stop_ids(steps=3):
    with stock():
        free = build("llama").generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                       pad_token_id=PAD)
    return sorted(set(free[:, 4 + steps - 1].tolist()))


def run(flag, when, do_sample):
    model = build("llama")
    wrap = Wrap(model)
    extra = {"async_stopping_criteria": True} if flag else {}
    if when == "mid-call":
        extra["logits_processor"] = LogitsProcessorList([WrapAt(wrap, at=1)])
    else:
        wrap.install()
    torch.manual_seed(3)
    try:
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=10, do_sample=do_sample,
                             eos_token_id=stop_ids(), pad_token_id=PAD, **extra)
    finally:
        wrap.undo()
    return out.tolist(), wrap.calls, torch.rand(2).tolist()


class ClassForwardWrapperSeesStocksForwards(unittest.TestCase):
    @parameterized.expand([(w, s) for w in ("before the call", "mid-call") for s in (False, True)])
    def test_the_wrapper_sees_stocks_forwards(self, when, do_sample):
        with stock():
            ref = run(False, when, do_sample)
        got = run(True, when, do_sample)
        self.assertLess(len(ref[0][0]), 4 + 10, "the call must stop early for the extra step to exist")
        self.assertEqual(ref, got)


if __name__ == "__main__":
    unittest.main()


class ModelClassesOwnForwardKeepsTheDeferredPath(unittest.TestCase):
    """A model class defined outside transformers (remote code, a user's subclass) whose `forward` is written in that
    class's own file is the model's code, not a wrapper added to it: the call stays deferred."""

    def test_a_subclass_forward_in_its_own_file_is_not_a_wrapper(self):
        import transformers_async_stop as tas

        model = build("llama")
        base = type(model)
        sub = type("Sub", (base,), {"forward": lambda self, *a, **k: base.forward(self, *a, **k),
                                    "__module__": __name__})
        model.__class__ = sub
        model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=False,
                       eos_token_id=stop_ids(), pad_token_id=PAD, async_stopping_criteria=True)
        self.assertNotIn("replaced by user code", str(tas.last_path()))


class AWrapperAtTheFirstProofIsNotKeptAsTheOriginal(unittest.TestCase):
    """The piecewise proof keeps, per process, the object first seen at each class method a replay skips, and sends a
    step eager where another is there now (`proof/names._first_seen`). A user's wrapper there at the process's first
    proof of the class was kept as the first: once the original was put back, every later model of the class decoded
    eagerly for the rest of the process ("LlamaForCausalLM.forward was replaced"; a test's wrapper at a pytest
    worker's first Llama proof failed 191 later tests of the 5.17 suite)."""

    def test_a_class_wrapped_at_its_first_proof_is_graphed_once_the_original_is_back(self):
        from models import TRANSFORMERS_VERSION, prompt
        from test_piecewise import _check_against_stock
        from transformers_async_stop.graphs.piecewise.proof import names
        from transformers_async_stop.testing.emulation import emulated

        import transformers_async_stop as tas

        if not (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24):
            self.skipTest("the piecewise forward's releases (5.17-5.24)")
        model = build("llama")
        key = (type(model), "forward")
        missing = object()
        saved = names._FIRST_SEEN.pop(key, missing)  # as in a process that has not proven a Llama yet
        self.addCleanup(lambda: names._FIRST_SEEN.__setitem__(key, saved) if saved is not missing
                        else names._FIRST_SEEN.pop(key, None))
        ids, mask = prompt(batch=1)
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
        wrap = Wrap(model)
        wrap.install()
        try:
            with emulated():
                _check_against_stock(self, model, ids, mask, **kwargs)
            self.assertFalse((tas.last_path().forward or "").startswith("graphed"), tas.last_path().forward)
        finally:
            wrap.undo()
        with emulated():
            _check_against_stock(self, build("llama"), ids, mask, **kwargs)
        self.assertTrue((tas.last_path().forward or "").startswith("graphed"), tas.last_path().forward)


class AWrapperAtTheFirstFlaggedCallIsNoReleaseNotice(unittest.TestCase):
    """The release notice ("transformers X's sources differ ...; these fast paths are off") is computed once per
    process, at its first flagged call. A user's class-level wrapper there turned shortcuts off and was reported as
    the release's difference, on every later call of the process (found in this stop's 5.17 suite, a pytest worker's
    first flagged call after the notice's reset)."""

    def test_a_wrapper_at_the_first_flagged_call_leaves_no_notice_on_later_calls(self):
        import warnings

        import transformers_async_stop as tas
        from transformers_async_stop.release_checks import release_notice

        release_notice.reset()
        self.addCleanup(release_notice.reset)
        if release_notice.notice_text() is not None:
            self.skipTest("this release has a notice of its own")
        release_notice.reset()
        model = build("llama")
        kwargs = dict(attention_mask=torch.ones_like(PROMPT), max_new_tokens=3, pad_token_id=PAD,
                      async_stopping_criteria=True)
        wrap = Wrap(model)
        wrap.install()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.generate(PROMPT, **kwargs)
        finally:
            wrap.undo()
        self.assertFalse([w for w in caught if issubclass(w.category, release_notice.NewerReleaseWarning)])
        model.generate(PROMPT, **kwargs)
        self.assertIsNone(tas.last_path().notice)
