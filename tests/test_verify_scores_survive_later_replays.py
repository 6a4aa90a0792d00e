"""A verify round's scores stay the round's after later rounds replay (issue 43, item 1).

Stock's assisted loop keeps each round's fp32 verify logits as that round's scores (`.to(float32)` of fp32 logits is
the same tensor). A recording's logits live in its model's graph pool, whose memory CUDA's allocator may give a later
capture: so a replay of any recording captured earlier may overwrite them. The verify forward hands the caller a copy
of every replay's logits; a recording of a found family that was made and not kept (its proof waits for a second
position: "recorded once, to be confirmed") returned its buffer itself, and the next round's replay overwrote the
last score row on an H200 (a Granite target and draft, max abs difference 1.3e3). The CPU emulation now overwrites
what a later capture of a pool made at every replay of an earlier one (`testing/emulation.py`, `_Pool`), which makes
the fault certain where CUDA makes it likely.

Cases: found families as target and draft, a found draft for a hand-read target and the reverse, prompt lookup,
speculative sampling, and the last round clipped to fewer tokens than the draft width; each on the CPU with the
graphs emulated and on CUDA (skipped without it), against unpatched transformers: sequences, scores, logits and the
RNG state after the call, over two calls (the first records, the second replays).
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from family_models import build_family
from models import PAD, TRANSFORMERS_VERSION, assert_same, stock
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the releases of the graphed verify forward
CUDA = torch.cuda.is_available() and RELEASES

# (name, target family, draft family or None for prompt lookup, sampling, new tokens)
CASES = [
    ("found_target_found_draft", "granite", "granite", False, 14),
    ("hand_read_target_found_draft", "llama", "olmo", False, 14),
    ("found_target_hand_read_draft", "olmo", "llama", False, 14),
    ("found_target_prompt_lookup", "granite", None, False, 14),
    ("found_target_found_draft_sampling", "granite", "olmo", True, 14),
    # 13 tokens with 3 drafted per round: the last round has fewer tokens left than the draft width
    ("found_target_last_round_clipped", "olmo2", "granite", False, 13),
]


def _models(target_family, draft_family, device):
    target = build_family(target_family, device=device, seed=5)
    draft = None if draft_family is None else build_family(draft_family, device=device, seed=11, num_hidden_layers=1)
    return target, draft


def _generate(target, draft, ids, sample, new_tokens, flag):
    kwargs = dict(max_new_tokens=new_tokens, pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, do_sample=sample)
    if draft is None:
        kwargs["prompt_lookup_num_tokens"] = 3
    else:
        kwargs.update(assistant_model=draft, num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
    if ids.device.type == "cuda":
        kwargs["disable_compile"] = True
    if flag:
        kwargs["async_stopping_criteria"] = True
    torch.manual_seed(3)
    out = target.generate(ids, **kwargs)
    return out, torch.rand(4, device=ids.device)


class _Cases:
    DEVICE = "cuda"

    def _context(self):
        return emulated() if self.DEVICE == "cpu" else _nothing()

    @parameterized.expand(CASES)
    def test_scores_equal_stock_after_later_rounds_replay(self, _, target_family, draft_family, sample, new_tokens):
        target, draft = _models(target_family, draft_family, self.DEVICE)
        # a prompt that repeats itself: prompt lookup finds candidates in it
        ids = torch.tensor([[5, 9, 12, 7, 5, 9, 12, 7, 5, 9]], device=self.DEVICE)
        with stock():
            refs = [_generate(target, draft, ids, sample, new_tokens, False) for _ in range(2)]
        with self._context():
            outs = [_generate(target, draft, ids, sample, new_tokens, True) for _ in range(2)]
            verify = tas.last_path().verify or ""
        self.assertIn("graphed", verify, "the verify forward must replay for the case to test it")
        for call, ((ref, ref_after), (out, after)) in enumerate(zip(refs, outs)):
            assert_same(self, ref, out, f"call {call}")
            self.assertTrue(torch.equal(ref_after, after), f"call {call}: RNG state after generate() differs")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@unittest.skipUnless(RELEASES, "the graphed verify forward runs on transformers 5.17-5.24")
class VerifyScoresEmulated(_Cases, unittest.TestCase):
    DEVICE = "cpu"


@unittest.skipUnless(CUDA, "needs CUDA and transformers 5.17-5.24")
class VerifyScoresCuda(_Cases, unittest.TestCase):
    DEVICE = "cuda"


if __name__ == "__main__":
    unittest.main()
