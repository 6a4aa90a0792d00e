"""The assisted loop's host copy of the sequence (`lookup.Mirror`) follows writes that user code makes in place.

Stock hands the call's own sequence tensor to the logits processors (the draft's first step of each round gets it),
and its assistant builds a mask from the pad id found in that same tensor. A processor that writes the pad id into
the sequence in place therefore changes stock's later drafts. The flag's draft decides on the host copy whether the
assistant would build an all-ones mask (`DraftRun._builds_ones`); before the mirror followed such writes it kept the
token the round had accepted, handed an all-ones mask, and drafted other tokens than stock (usage fuzzer seed 297,
CUDA: the processor's calls and then the sequences differed). On the CPU the prompt used to be aliased, not copied,
which hid a write made in the first round: the mirror now copies on both devices.
"""

from __future__ import annotations

import copy
import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList

from models import PAD, TRANSFORMERS_VERSION, build, stock
from transformers_async_stop.loops.assisted.lookup import Mirror

CUDA = torch.cuda.is_available()


class PadWriter(LogitsProcessor):
    """Writes the pad id over the last token of the sequence it is handed, in place, at the calls `at`; keeps a
    copy of every call's ids and scores (the draft's scores show which mask the assistant ran with)."""

    def __init__(self, at=()):
        self.at, self.calls, self.seen = set(at), 0, []

    def __call__(self, input_ids, scores):
        self.seen.append((input_ids.cpu().clone(), scores.cpu().clone()))
        if self.calls in self.at:
            input_ids[:, -1] = PAD
        self.calls += 1
        return scores


def _run(device, at, flag, inference):
    target = build("gpt2", device=device)
    helper = copy.copy(target)  # the fuzzer's `copy` draft: the target's modules, a config of its own
    helper.generation_config = copy.deepcopy(target.generation_config)
    helper.generation_config.num_assistant_tokens = 3
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    helper.generation_config.assistant_confidence_threshold = 0.0
    processor = PadWriter(at)
    kwargs = dict(assistant_model=helper, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                  logits_processor=LogitsProcessorList([processor]))
    if flag:
        kwargs["async_stopping_criteria"] = True
    with torch.inference_mode() if inference else torch.no_grad():
        ids = torch.tensor([[5, 17, 9, 30]], device=device)
        out = target.generate(ids, **kwargs)
    return out.cpu(), processor.seen


@unittest.skipUnless(TRANSFORMERS_VERSION >= (5, 0), "the copy draft of the usage fuzzer is drawn on 5.x")
class ProcessorWritingTheSequence(unittest.TestCase):
    device = "cpu"

    # call 0 is the draft's first step of round 1 (the prompt's last token), call 7 the draft's first step of
    # round 3 on this model (a token round 2 kept): before the fix the flag's processor saw 22 calls, stock's 27
    @parameterized.expand([(f"{name}_call_{at}", at, inference)
                           for at in (0, 7) for name, inference in (("no_grad", False), ("inference_mode", True))])
    def test_a_pad_id_written_in_place_reaches_the_drafts_as_in_stock(self, _, at, inference):
        with stock():
            expected, stock_seen = _run(self.device, (at,), False, inference)
        got, seen = _run(self.device, (at,), True, inference)
        self.assertTrue(torch.equal(expected, got), (expected.tolist(), got.tolist()))
        self.assertEqual(len(seen), len(stock_seen))
        for i, ((ids, scores), (stock_ids, stock_scores)) in enumerate(zip(seen, stock_seen)):
            self.assertTrue(torch.equal(ids, stock_ids), f"call {i}: ids {ids.tolist()} vs {stock_ids.tolist()}")
            self.assertTrue(torch.equal(scores, stock_scores), f"call {i}: scores")


class MirrorFollowsWrites(unittest.TestCase):
    device = "cpu"

    def test_a_write_through_a_view_before_the_append_is_read_back(self):
        ids = torch.tensor([[5, 6, 7]], device=self.device)
        mirror = Mirror(ids)
        ids[:, :2][:, -1] = PAD  # a processor handed `input_ids[:, :cur_len + i]`
        grown = torch.cat((ids, torch.tensor([[8]], device=self.device)), dim=1)
        mirror.extend(torch.tensor([[8]]), grown)
        self.assertEqual(mirror.ids.tolist(), [[5, PAD, 7, 8]])
        self.assertTrue(mirror.contains(PAD))
        self.assertEqual(mirror.reads, 1)

    def test_a_write_after_the_append_is_read_back(self):
        ids = torch.tensor([[5, 6, 7]], device=self.device)
        mirror = Mirror(ids)
        grown = torch.cat((ids, torch.tensor([[8]], device=self.device)), dim=1)
        mirror.extend(torch.tensor([[8]]), grown)
        grown[:, -1] = PAD
        self.assertEqual(mirror.ids.tolist(), [[5, 6, 7, PAD]])

    def test_without_a_write_the_device_is_not_read_again(self):
        ids = torch.tensor([[5, 6, 7]], device=self.device)
        mirror = Mirror(ids, foreign=True)
        for token in (8, 9):
            ids = torch.cat((ids, torch.tensor([[token]], device=self.device)), dim=1)
            mirror.extend(torch.tensor([[token]]), ids)
            self.assertFalse(mirror.contains(PAD))
        self.assertEqual(mirror.reads, 0)

    def test_the_prompt_is_a_copy_on_every_device(self):
        ids = torch.tensor([[5, 6, 7]], device=self.device)
        mirror = Mirror(ids)
        self.assertNotEqual(mirror.ids.data_ptr(), ids.data_ptr())

    def test_an_inference_tensor_handed_to_user_code_is_read_each_time(self):
        with torch.inference_mode():
            ids = torch.tensor([[5, 6, 7]], device=self.device)
        followed, own = Mirror(ids, foreign=True), Mirror(ids, foreign=False)
        with torch.inference_mode():
            ids[:, -1] = PAD  # no version counter to tell
        self.assertTrue(followed.contains(PAD))
        self.assertFalse(own.contains(PAD))  # only transformers' processors: nobody writes it


@unittest.skipUnless(CUDA, "CUDA only")
class ProcessorWritingTheSequenceCuda(ProcessorWritingTheSequence):
    device = "cuda"


@unittest.skipUnless(CUDA, "CUDA only")
class MirrorFollowsWritesCuda(MirrorFollowsWrites):
    device = "cuda"


if __name__ == "__main__":
    unittest.main()
