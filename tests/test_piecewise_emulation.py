"""The CPU emulation of CUDA graphs (`testing/emulation.py`) behaves as a CUDA graph does where the piecewise tests
rely on it: a replay reruns the captured ops on the captured tensors and none of the Python that issued them; in-place
ops apply once per replay; views follow their base; a host read fails the capture and leaves no capture on; and the
piecewise path under it runs the model's Python only to prefill and to record."""

from __future__ import annotations

import os
import sys
import unittest
from unittest import mock

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, build, prompt
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.testing.emulation import Graph, active, emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)


def _captured(fn):
    graph = Graph()
    graph.capture_begin()
    out = fn()
    graph.capture_end()
    graph.replay()  # as `graphs._Recorder.end` does: the capture's run is this first replay
    return graph, out


class EmulatedGraph(unittest.TestCase):
    def test_a_replay_runs_the_captured_ops_not_the_python_that_issued_them(self):
        x, scale = torch.ones(3), [2.0]
        graph, y = _captured(lambda: x * scale[0])
        x.fill_(5.0)
        scale[0] = 10.0  # Python state the capture read: baked in, as in a CUDA graph
        graph.replay()
        self.assertTrue(torch.equal(y, torch.full((3,), 10.0)))

    def test_a_replay_keeps_the_memory_of_a_tensor_rebound_after_the_capture(self):
        # `p.data = ...` after a capture: a CUDA graph still reads the old address, and so does the emulation
        # (a missed staleness check shows as a stale value here, as on CUDA)
        x, weight = torch.ones(3), torch.nn.Parameter(torch.ones(3), requires_grad=False)
        graph, y = _captured(lambda: x * weight)
        weight.data = torch.full((3,), 2.0)
        x.fill_(3.0)
        graph.replay()
        self.assertTrue(torch.equal(y, torch.full((3,), 3.0)))

    def test_an_in_place_op_applies_once_per_replay(self):
        x = torch.ones(3)

        def piece():
            y = x.clone()
            y.add_(1.0)
            return y

        graph, y = _captured(piece)
        self.assertTrue(torch.equal(y, torch.full((3,), 2.0)))
        x.fill_(5.0)
        graph.replay()
        self.assertTrue(torch.equal(y, torch.full((3,), 6.0)))
        graph.replay()
        self.assertTrue(torch.equal(y, torch.full((3,), 6.0)))

    def test_a_view_follows_its_refreshed_base(self):
        x = torch.ones(4)
        graph, (base, view) = _captured(lambda: (lambda b: (b, b.view(2, 2).t()))(x * 3.0))
        x.copy_(torch.arange(4.0))
        graph.replay()
        self.assertTrue(torch.equal(view, (torch.arange(4.0) * 3.0).view(2, 2).t()))
        self.assertEqual(view.data_ptr(), base.data_ptr())

    def test_a_replay_overwrites_what_a_later_capture_of_its_pool_made(self):
        # CUDA's allocator may give a later capture of a shared pool the memory an earlier capture freed: replaying
        # the earlier graph then writes over the later one's tensors. The emulation makes it certain (issue 43)
        x = torch.ones(3)
        first = Graph()
        first.capture_begin()
        (x * 2.0).sum()  # a temporary of the first capture
        first.capture_end()
        first.replay()
        second = Graph()
        second.capture_begin(pool=first.pool())
        kept = x * 3.0
        second.capture_end()
        second.replay()
        outside = x * 4.0  # made outside any capture: not the pool's
        first.replay()
        self.assertTrue(torch.isnan(kept).all())
        self.assertTrue(torch.equal(outside, torch.full((3,), 4.0)))
        second.replay()  # a replay of the later graph writes its tensors again, and touches no earlier one's
        self.assertTrue(torch.equal(kept, torch.full((3,), 3.0)))

    def test_a_capture_into_a_pool_whose_graphs_are_gone_fails_as_on_cuda(self):
        x = torch.ones(3)
        first, _ = _captured(lambda: x * 2.0)
        pool = first.pool()
        del first
        import gc

        gc.collect()
        with self.assertRaisesRegex(RuntimeError, "use_count"):
            Graph().capture_begin(pool=pool)

    def test_graphs_of_different_pools_do_not_overwrite_each_other(self):
        x = torch.ones(3)
        first, _ = _captured(lambda: x * 2.0)
        second, kept = _captured(lambda: x * 3.0)
        first.replay()
        self.assertTrue(torch.equal(kept, torch.full((3,), 3.0)))

    def test_a_host_read_fails_the_capture_and_leaves_no_capture_on(self):
        x = torch.ones(3)
        graph = Graph()
        graph.capture_begin()
        with self.assertRaisesRegex(RuntimeError, "not permitted while capturing"):
            x.sum().item()
        graph.abort()
        recorded = len(graph.ops)
        _ = x * 2.0  # not recorded: the capture is off
        self.assertEqual(len(graph.ops), recorded)

    def test_a_data_dependent_shape_fails_the_capture(self):
        x = torch.tensor([0.0, 1.0, 2.0])
        graph = Graph()
        graph.capture_begin()
        try:
            with self.assertRaisesRegex(RuntimeError, "not permitted while capturing"):
                torch.nonzero(x)
        finally:
            graph.abort()

    def test_the_emulation_is_off_outside_its_context(self):
        self.assertFalse(active())
        with emulated():
            self.assertTrue(active())
            with emulated():
                self.assertTrue(active())
            self.assertTrue(active())
        self.assertFalse(active())


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "1"})
class EmulatedPiecewiseForward(unittest.TestCase):
    def test_the_models_python_runs_only_for_the_prefill_and_the_recording(self):
        model = build("llama")
        ids, mask = prompt(batch=1)
        norm_code = type(model.model.norm).forward.__code__
        calls = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code is norm_code:
                calls.append(1)

        layers = model.config.num_hidden_layers
        per_forward = 2 * layers + 1  # each layer's two norms and the final norm
        with emulated(), torch.no_grad():
            sys.setprofile(profile)
            try:
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False,
                               eos_token_id=None, async_stopping_criteria=True)
            finally:
                sys.setprofile(None)
        self.assertEqual(tas.last_path().forward, "graphed (3 pieces): 7 decode steps")
        self.assertEqual(len(calls), 2 * per_forward)  # the prefill and the recording step; 6 replays run none

    def test_the_report_counts_every_eager_step_after_replays(self):
        # after replays, each eager step for the same reason is counted (the note was refreshed only on a new reason)
        model = build("llama")
        ids, mask = prompt(batch=1)
        handles = []

        class HookFrom(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                if input_ids.shape[1] == ids.shape[1] + 3 and not handles:
                    handles.append(model.model.norm.register_forward_hook(lambda *args: None))
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        try:
            with emulated(), torch.no_grad():
                model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=9, do_sample=False,
                               eos_token_id=None, async_stopping_criteria=True,
                               stopping_criteria=StoppingCriteriaList([HookFrom()]))
        finally:
            for handle in handles:
                handle.remove()
        # 8 decode steps: 2 graphed (the recording and one replay), then 6 eager once the hook is on
        self.assertEqual(tas.last_path().forward, "graphed (3 pieces): 2 decode steps; 6 eager: a hook was added")

    def test_without_the_emulation_the_cpu_keeps_the_eager_forward(self):
        model = build("llama")
        ids, mask = prompt(batch=1)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, do_sample=False,
                           eos_token_id=None, async_stopping_criteria=True)
        self.assertEqual(tas.last_path().forward, "eager: not CUDA (cpu)")


if __name__ == "__main__":
    unittest.main()
