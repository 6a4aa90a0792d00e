"""Another thread working on the same CUDA stream cannot change a deferred call's output (CUDA only).

The deferred loop runs the stopping criteria on a side stream. The first step's `unfinished_sequences & ~is_done`
reads stock's initial `unfinished_sequences` there, a tensor made on the main stream that stock drops as soon as
the `&` is queued. Unless the allocator is told that the side stream still reads it, its memory is free for the next
allocation on the main stream. In one thread that allocation comes after the main stream waited for the side one.
Another thread generating on the same (default) stream can take the memory at once and write to it before the side
stream has read it: every row then looks finished after one token. The usage fuzzer found this on an H100 (three of
about 250 two-thread scenarios: a row padded after its first token, a call stopped after one token).

Here (CUDA) a second thread writes to freshly allocated main-stream memory in a tight loop while the first thread
generates, with the interpreter switching threads as often as it can. Each call must return stock's output. The part
tied to transformers' source (finding that tensor in stock's `_sample` frame) is checked on CPU, on every release.
"""

from __future__ import annotations

import sys
import threading
import unittest
from unittest import mock

import torch

import transformers_async_stop
from transformers_async_stop.control import step_lists
from models import PAD, build, prompt, stock

needs_cuda = unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")


def _generate(model, ids, mask, flag):
    # hidden states keep the call on the deferred path (stock's loop with the package's criteria list); only
    # transformers' own criteria, which the deferred path runs on the side stream (a user criterion keeps them all on
    # the caller's stream, `SideStreamCriteria`)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=[1], return_dict_in_generate=True,
              output_hidden_states=True)
    if flag:
        kw["async_stopping_criteria"] = True
    return model.generate(ids, attention_mask=mask, **kw).sequences


class TheFirstStepsInputIsFound(unittest.TestCase):
    """The part tied to transformers' source, checked on every release CI runs (no CUDA needed): the criteria list
    finds, in the stock `_sample` frame that calls it, the `unfinished_sequences` the first step's `&` reads."""

    def test_the_criteria_list_finds_stocks_first_unfinished_sequences(self):
        model = build("llama")
        ids, mask = prompt(batch=3)
        found, real_call = [], step_lists.SideStreamCriteria.__call__

        def spy(self, input_ids, scores, **kwargs):
            found.append(step_lists._loop_unfinished(sys._getframe(1), input_ids))
            return real_call(self, input_ids, scores, **kwargs)

        with mock.patch.object(step_lists.SideStreamCriteria, "__call__", spy):
            _generate(model, ids, mask, flag=True)
        self.assertTrue(found, "the deferred path's criteria list was not called")
        first = found[0]
        self.assertIsInstance(first, torch.Tensor)
        self.assertTrue(torch.equal(first, torch.ones(3, dtype=torch.long)), first)

    def test_a_caller_that_is_not_stocks_loop_gives_nothing(self):
        unfinished_sequences = torch.ones(3, dtype=torch.long)  # noqa: F841 - a local of the right name elsewhere
        self.assertIsNone(step_lists._loop_unfinished(sys._getframe(0), torch.zeros(3, 4, dtype=torch.long)))

    def test_where_it_is_not_found_the_criteria_stay_on_the_main_stream(self):
        from transformers_async_stop.control.controller import AsyncStop

        ctl = AsyncStop(torch.zeros(2, 3, dtype=torch.long), 8, done_when="unfinished")
        self.assertTrue(ctl.side_ok)
        ctl.allow_side(None)
        self.assertFalse(ctl.side_ok)


@needs_cuda
class CudaThreadsSharingTheMainStream(unittest.TestCase):
    def test_a_thread_allocating_on_the_main_stream_cannot_finish_another_threads_rows(self):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=3, device="cuda")
        with stock():
            ref = _generate(model, ids, mask, flag=False)
        self.assertGreater(ref.shape[1], ids.shape[1] + 1, "stock itself stopped at once: nothing to compare")

        stop, writes = threading.Event(), [0]

        def hammer():
            # block-sized long tensors like `unfinished_sequences`, written on the default stream as soon as made
            while not stop.is_set():
                torch.empty(ids.shape[0], dtype=torch.long, device="cuda").fill_(0)
                writes[0] += 1

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        other = threading.Thread(target=hammer)
        other.start()
        try:
            outs = [_generate(model, ids, mask, flag=True) for _ in range(40)]
        finally:
            stop.set()
            other.join()
            sys.setswitchinterval(interval)
        self.assertGreater(writes[0], 0)
        last = transformers_async_stop.last_path()
        self.assertEqual(last.path, "deferred", last.describe())
        bad = [i for i, out in enumerate(outs) if not torch.equal(out, ref)]
        self.assertEqual(bad, [], f"calls {bad} differ from stock: {outs[bad[0]].tolist() if bad else ''} vs "
                                  f"{ref.tolist()}")


if __name__ == "__main__":
    unittest.main()
