"""Nothing global survives a capture of the static-cache loop's tail (CUDA only; skipped without a GPU).

- A processor declared `graph_safe()` that reads the host (`.item()`) makes the capture fail (issue 16, item 3). The
  call must still return stock's output (the step runs eagerly), and the device's random generator must be left
  usable and where stock leaves it: a later random op, a later flag-off sampling call, the RNG state.
- Two threads generating at once on one model (each with its own StaticCache) return what each returns alone
  (issue 16, item 4): a capture never happens while another thread is inside generate(), and none starts during
  a capture.
- A capture made while the main stream is still busy (a slow forward) does not change what the replayed step draws:
  `capture_begin` resets the generator's shared graph-RNG tensors with two kernels on the capture stream, which the
  main stream's replay must not overtake (found by the CUDA usage fuzzer under load, seeds 569 and 890).
"""

from __future__ import annotations

import threading
import traceback
import unittest
import warnings
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from adversarial_helpers import static_cache
from models import PAD, TRANSFORMERS_VERSION, build, prompt, stock
from transformers_async_stop import graph_safe
from transformers_async_stop.loops.static_loop import tail as tail_module

needs_cuda = unittest.skipUnless(torch.cuda.is_available() and TRANSFORMERS_VERSION >= (5, 17),
                                 "needs a CUDA device and transformers 5.17+ (the static-cache loop)")


@graph_safe
class ReadsTheHost(LogitsProcessor):
    """Declared graph-safe, but reads a device value on the host: a capture of it fails."""

    def __call__(self, input_ids, scores):
        if scores.abs().max().item() > 1e30:
            return scores * 0.5
        return scores / 0.9


def _sample(model, ids, mask, flag, **extra):
    kw = dict(max_new_tokens=10, do_sample=True, top_k=10, pad_token_id=PAD, cache_implementation="static",
              logits_processor=LogitsProcessorList([ReadsTheHost()]), return_dict_in_generate=True,
              output_scores=True, **extra)
    if flag:
        kw["async_stopping_criteria"] = True
    torch.manual_seed(11)
    out = model.generate(ids, attention_mask=mask, **kw)
    return out, torch.rand(4, device="cuda")


@needs_cuda
class CaptureLeavesNothingBehind(unittest.TestCase):
    def test_a_failed_capture_returns_stock_output_and_leaves_the_generator_usable(self):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=2, device="cuda")
        with stock():
            ref, ref_after = _sample(model, ids, mask, flag=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on, on_after = _sample(model, ids, mask, flag=True)
        self.assertTrue(any("could not be captured" in str(w.message) for w in caught), "no capture was tried")
        self.assertTrue(torch.equal(ref.sequences, on.sequences))
        for a, b in zip(ref.scores, on.scores):
            self.assertTrue(torch.equal(a, b))
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        # and the process goes on: random ops and a flag-off sampling call work as in stock
        torch.manual_seed(3)
        later = torch.randn(8, device="cuda")
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, pad_token_id=PAD)
        with stock():
            torch.manual_seed(3)
            later_ref = torch.randn(8, device="cuda")
            plain_ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, pad_token_id=PAD)
        self.assertTrue(torch.equal(later, later_ref))
        self.assertTrue(torch.equal(plain, plain_ref))

    def test_two_threads_on_one_model_return_what_each_returns_alone(self):
        model = build("llama", device="cuda")
        prompts = [prompt(batch=b, seed=s, device="cuda") for b, s in ((1, 1), (3, 2))]

        def run(ids, mask, flag):
            outs = []
            for _ in range(4):
                # the forward uncompiled: torch.compile's own CUDA graphs (cudagraph trees) are per thread, which
                # is stock's business; the tail's capture is the package's
                kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, eos_token_id=[5, 9, 13],
                          past_key_values=static_cache(model, 40, ids.shape[0]), disable_compile=True)
                if flag:
                    kw["async_stopping_criteria"] = True
                outs.append(model.generate(ids, attention_mask=mask, **kw))
            return outs

        with stock():
            alone = [run(ids, mask, False) for ids, mask in prompts]
        results, errors = [None, None], []
        start = threading.Barrier(2)

        def worker(k):
            try:
                start.wait()
                results[k] = run(*prompts[k], True)
            except BaseException:  # reported below, with where it was raised
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(errors, [], "\n".join(errors))
        for k in range(2):
            for a, b in zip(alone[k], results[k]):
                self.assertTrue(torch.equal(a, b), f"thread {k} differs from its run alone")


@needs_cuda
class CaptureWhileTheMainStreamIsBusy(unittest.TestCase):
    """`capture_begin` queues its reset of the shared graph-RNG offset on the capture stream; a replay writes the
    offset it needs on the main stream and its graph reads it a few kernels later. The reset must never land in
    between. Device work queued on main before the capture makes both streams wait for it, and then race; a small
    delay on the capture stream before `capture_begin` (swept) moves the reset across the replay's kernels."""

    def _generate(self, model, ids, mask, flag):
        kw = dict(max_new_tokens=12, do_sample=True, top_k=3, top_p=0.9, pad_token_id=PAD,
                  cache_implementation="static", return_dict_in_generate=True, output_scores=True)
        if flag:
            kw["async_stopping_criteria"] = True
        torch.manual_seed(5)
        out = model.generate(ids, attention_mask=mask, **kw)
        return out.sequences, out.scores, torch.rand(4, device="cuda")

    def test_a_capture_behind_a_slow_forward_draws_what_stock_draws(self):
        model = build("llama", device="cuda")
        ids, mask = prompt(batch=3, device="cuda")
        with stock():
            ref = self._generate(model, ids, mask, False)
        real_capture, real_begin = tail_module.Tail._capture, torch.cuda.CUDAGraph.capture_begin
        delay = [0]

        def behind_busy_main(tail, *args, **kwargs):
            torch.cuda._sleep(50_000_000)  # about 25 ms of device time queued on the main stream, as a slow forward
            return real_capture(tail, *args, **kwargs)

        def late_reset(graph, *args, **kwargs):
            if delay[0]:
                torch.cuda._sleep(delay[0])  # on the capture stream, before the prologue's reset kernels
            return real_begin(graph, *args, **kwargs)

        with mock.patch.object(tail_module.Tail, "_capture", behind_busy_main), \
                mock.patch.object(torch.cuda.CUDAGraph, "capture_begin", late_reset):
            # five times the race as it comes, five times with the reset held back a little more (1 to 20 us),
            # across the kernels between the replay's offset write and its draw
            for attempt, cycles in enumerate((0, 0, 0, 0, 0, 2_000, 5_000, 10_000, 20_000, 40_000)):
                delay[0] = cycles
                on = self._generate(model, ids, mask, True)
                where = f"attempt {attempt} (capture stream held {cycles} cycles)"
                self.assertTrue(torch.equal(ref[0], on[0]), f"{where}: sequences differ")
                for step, (a, b) in enumerate(zip(ref[1], on[1])):
                    self.assertTrue(torch.equal(a, b), f"{where}: scores of step {step} differ")
                self.assertTrue(torch.equal(ref[2], on[2]), f"{where}: RNG state afterwards differs")


if __name__ == "__main__":
    unittest.main()
