"""The assistant's hook watch is carried from round to round of one assisted call (`DraftStop.watch_hooks`, issue 38):
its first look, a walk of every module, is made once per call; between two rounds it checks what it checks between
two steps, and a watch that noticed something, or whose hook tables filled without a handle, is made again. Each case
counts a forward hook's calls on the assistant against unpatched stock: an extra draft step the flag failed to read
at once would show as one more call."""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from models import TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.undo import module_state
from test_piecewise import _generate

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=24, do_sample=False)


class AtLength(LogitsProcessor):
    """Runs `action` once, the first time the target's sequence reaches `length` (between two draft rounds)."""

    def __init__(self, length, action):
        self.length, self.action, self.done = length, action, False

    def __call__(self, input_ids, scores):
        if not self.done and input_ids.shape[1] >= self.length:
            self.done = True
            self.action()
        return scores


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class DraftHookWatchAcrossRounds(unittest.TestCase):
    def setUp(self):
        self.enterContext(mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"}))
        self.ids = prompt(batch=1)[0]
        self.target = build("llama")
        # an EOS id the draft proposes now and then: its loop stops on EOS, one token late with the flag
        self.eos = int(self.ids[0, -1])

    def _calls(self, flag, make_processor=None, setup=None):
        """(output, the hook's call count) of one assisted call with a fresh assistant."""
        helper = build("llama", seed=1)
        calls = []
        hook = lambda module, args, output: calls.append(1)  # noqa: E731
        if setup is not None:
            setup(helper, hook)
        processors = LogitsProcessorList([make_processor(helper, hook)] if make_processor else [])
        context = stock() if flag is None else mock.patch.dict(os.environ, {})
        with context:
            out, _ = _generate(self.target, self.ids, torch.ones_like(self.ids), flag, assistant_model=helper,
                               eos_token_id=self.eos, logits_processor=processors, **_KW)
        return out, len(calls)

    def _against_stock(self, **kwargs):
        ref, ref_calls = self._calls(None, **kwargs)
        out, calls = self._calls(True, **kwargs)
        assert_same(self, ref, out)
        self.assertEqual(ref_calls, calls, "the assistant's hook ran another number of times than in stock")
        return calls

    def test_the_watch_is_made_once_per_call_when_nothing_changes(self):
        made = []
        original = module_state.HookWatch.__init__

        def counted(self, model):
            original(self, model)
            made.append(model)

        helper = build("llama", seed=1)
        with mock.patch.object(module_state.HookWatch, "__init__", counted):
            _generate(self.target, self.ids, torch.ones_like(self.ids), True, assistant_model=helper, **_KW,
                      eos_token_id=None)
        self.assertEqual(sum(model is helper for model in made), 1)

    def test_a_hook_registered_on_the_assistant_between_rounds_is_seen(self):
        def make(helper, hook):
            return AtLength(self.ids.shape[1] + 6, lambda: helper.model.layers[0].register_forward_hook(hook))

        self.assertGreater(self._against_stock(make_processor=make), 0)

    def test_a_hook_put_in_a_table_without_a_handle_between_rounds_is_seen(self):
        def make(helper, hook):
            return AtLength(self.ids.shape[1] + 6, lambda: helper.model.norm._forward_hooks.__setitem__(10**6, hook))

        self.assertGreater(self._against_stock(make_processor=make), 0)

    def test_a_hook_there_from_the_start_is_seen_in_every_round(self):
        def setup(helper, hook):
            helper.model.layers[1].mlp.register_forward_hook(hook)

        self.assertGreater(self._against_stock(setup=setup), 0)

    def test_a_module_swapped_between_rounds_is_looked_at_again(self):
        class Counting(torch.nn.Module):  # user code: the watch reads each verdict at once from then on
            def __init__(self, inner, hook):
                super().__init__()
                self.inner, self.hook = inner, hook

            def forward(self, *args, **kwargs):
                self.hook(self, args, None)
                return self.inner(*args, **kwargs)

        def make(helper, hook):
            def swap():
                helper.model.norm = Counting(helper.model.norm, hook)
            return AtLength(self.ids.shape[1] + 6, swap)

        self.assertGreater(self._against_stock(make_processor=make), 0)
