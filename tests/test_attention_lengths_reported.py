"""`last_path().attention_lengths`: how many decode steps of a call ran at a key/value length its thread had not met
(each costs a cuDNN SDPA plan on CUDA, in stock too: `loops/dynamic_loop/kv_lengths.py`). Counted on the host from
the cache's length; the CPU under the graph emulation counts as CUDA would."""

from __future__ import annotations

import threading
import unittest

import torch

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, build
from transformers_async_stop.testing.emulation import emulated

LOOP = (5, 17) <= TRANSFORMERS_VERSION  # the dynamic-cache loop's releases


def _call(model, length, new_tokens=6):
    ids = (torch.arange(length) % 40 + 3)[None]
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0, async_stopping_criteria=True)
    return tas.last_path().attention_lengths


@unittest.skipUnless(LOOP, "the dynamic-cache loop runs on transformers 5.17+")
class AttentionLengthsReported(unittest.TestCase):
    def test_a_call_over_lengths_met_before_meets_none_and_a_longer_prompt_meets_its_new_ones(self):
        model = build("llama", seed=11)
        seen = []
        with emulated():
            # in a thread of its own: this thread's earlier tests may have met these lengths
            thread = threading.Thread(target=lambda: seen.extend(_call(model, length) for length in (20, 20, 22)))
            thread.start()
            thread.join()
        first, again, longer = seen
        # six tokens: the prefill's, then five decode steps at key/value lengths 21-25 (the length ends the call on
        # the host: no extra step)
        self.assertEqual(first, "5 new of 5")
        self.assertEqual(again, "0 new of 5")
        self.assertEqual(longer, "2 new of 5", "lengths 26 and 27 are past the first call's")

    def test_another_thread_meets_every_length_again(self):
        model = build("llama", seed=11)
        with emulated():
            _call(model, 30)
            seen = []
            thread = threading.Thread(target=lambda: seen.append(_call(model, 30)))
            thread.start()
            thread.join()
        self.assertEqual(seen, ["5 new of 5"], "cuDNN's plans are kept per thread: so is the count")

    def test_nothing_is_counted_on_the_cpu_without_the_emulation(self):
        self.assertIsNone(_call(build("llama"), 10))


if __name__ == "__main__":
    unittest.main()
