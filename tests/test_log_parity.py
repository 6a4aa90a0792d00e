"""What transformers logs and warns during a call is the same with the flag as on unpatched stock: the same records,
in the same order, the same `warnings`, and the same `warning_once` cache afterwards.

The case that differed (red team, 5.23): GPT-2-like models check `pad_token_id in input_ids[:, [-1, 0]]` at every
forward without an attention mask (5.18+ drops an all-ones mask), and warn once ("We strongly recommend passing in an
`attention_mask`..."). A decode step feeds the pad token once a row has finished. With the flag the check was skipped
at decode steps (it reads a device tensor), so the warning was never emitted. The flag must also not emit it where
only its extra step, which stock never runs, feeds a pad token.

`warning_once` is cached for the process: the cache is cleared before each run, so each run shows what it emits.
"""

from __future__ import annotations

import logging
import unittest
import warnings

import torch
from parameterized import parameterized
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, build, stock

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]])
EOS = 47  # set so the loop pads finished rows; the rows are stopped by `StopRowsAt`, never by this id
user_log = hf_logging.get_logger("transformers.user_code")  # user code logging through transformers' logger


class StopRowsAt(StoppingCriteria):
    """Row r finishes when the sequence reaches `PROMPT_LEN + at[r]` tokens (None: never); logs each call, so the
    order of transformers' records against the steps shows."""

    def __init__(self, at, prompt_len):
        self.at, self.prompt_len = at, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        made = input_ids.shape[1] - self.prompt_len
        user_log.warning(f"criterion at {made}")
        per_row = input_ids.shape[0] // len(self.at)  # beam search: each prompt row's beams
        done = [step is not None and made >= step for step in self.at for _ in range(per_row)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class LoggingProcessor(LogitsProcessor):
    def __call__(self, input_ids, scores):
        user_log.warning(f"processor at {input_ids.shape[1]}")
        return scores


class Streamer(BaseStreamer):
    def put(self, value):
        user_log.warning(f"streamed {value.tolist()}")

    def end(self):
        user_log.warning("stream end")


def observe(call):
    """transformers' log records, the warnings, the `warning_once` cache size and the result of `call()`."""
    hf_logging.warning_once.cache_clear()
    hf_logging.info_once.cache_clear()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.funcName, record.getMessage()))

    handler = Keep()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call()
    finally:
        root.removeHandler(handler)
    seen = [(w.category.__name__, str(w.message)) for w in caught
            if "generation flags are not valid" not in str(w.message)]
    return records, seen, hf_logging.warning_once.cache_info().currsize, out


# (name, family, stop steps per row, cache, mask, extra generate kwargs)
CASES = [
    # a row finishes early: later steps feed the pad token; stock warns once, mid-call
    ("rows_finish_apart_dynamic", "gpt2", [2, None, 4], None, "ones", {}),
    ("rows_finish_apart_no_mask", "gpt2", [2, None, 4], None, "none", {}),
    ("rows_finish_apart_static", "gpt2", [2, None, 4], "static", "ones", {}),
    ("rows_finish_apart_streamer", "gpt2", [2, None, 4], None, "ones", {"streamer": True}),
    ("rows_finish_apart_sampled", "gpt2", [2, None, 4], None, "ones", {"do_sample": True}),
    ("rows_finish_apart_llama", "llama", [2, None, 4], None, "ones", {}),
    ("rows_finish_apart_llama_static", "llama", [2, None, 4], "static", "ones", {}),
    # the last row finishes the step after the first: only the flag's extra step would feed a pad token
    ("only_the_extra_step_feeds_pad", "gpt2", [2, 3, 3], None, "ones", {}),
    ("only_the_extra_step_feeds_pad_no_mask", "gpt2", [2, 3, 3], None, "none", {}),
    ("only_the_extra_step_feeds_pad_static", "gpt2", [2, 3, 3], "static", "ones", {}),
    ("only_the_extra_step_feeds_pad_streamer", "gpt2", [2, 3, 3], None, "ones", {"streamer": True}),
    ("only_the_extra_step_feeds_pad_llama", "llama", [2, 3, 3], None, "ones", {}),
    # a left-padded prompt: a mask is passed at every step; no row finishes
    ("left_padded_prompt", "gpt2", [None, None, None], None, "left", {}),
    ("left_padded_prompt_static", "gpt2", [None, None, None], "static", "left", {}),
    # a prompt with a pad token and no mask: stock warns at the prefill
    ("padded_prompt_without_mask", "gpt2", [2, None, 4], None, "pad_no_mask", {}),
    ("padded_prompt_without_mask_llama", "llama", [2, None, 4], None, "pad_no_mask", {}),
    # the whole batch runs to max_length
    ("no_row_finishes", "gpt2", [None, None, None], None, "ones", {}),
    ("beam_search", "gpt2", [None, None, None], None, "ones", {"num_beams": 2}),
    ("beam_search_rows_finish_apart", "gpt2", [2, None, 4], None, "ones", {"num_beams": 2}),
]


class LogParityTest(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_logs_and_warnings_match_stock(self, _name, family, stop_at, cache, mask_kind, extra):
        self._compare(family, stop_at, cache, mask_kind, extra, "cpu")

    @parameterized.expand([case for case in CASES if case[1] == "gpt2"])
    @unittest.skipUnless(torch.cuda.is_available(), "CUDA: the check's pinned copy and event")
    def test_logs_and_warnings_match_stock_on_cuda(self, _name, family, stop_at, cache, mask_kind, extra):
        self._compare(family, stop_at, cache, mask_kind, extra, "cuda")

    def _compare(self, family, stop_at, cache, mask_kind, extra, device):
        model = build(family, device=device)
        ids = PROMPT.clone()
        mask = torch.ones_like(ids)
        if mask_kind == "left":
            ids[1, :2] = PAD
            mask[1, :2] = 0
        if mask_kind == "pad_no_mask":
            ids[2, 0] = PAD

        def call(flag):
            kwargs = dict(max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS,
                          stopping_criteria=StoppingCriteriaList([StopRowsAt(stop_at, ids.shape[1])]),
                          logits_processor=LogitsProcessorList([LoggingProcessor()]))
            if mask_kind in ("ones", "left"):
                kwargs["attention_mask"] = mask.to(device)
            if cache is not None:
                kwargs["cache_implementation"] = cache
            if extra.get("streamer"):
                kwargs["streamer"] = Streamer()
            if extra.get("num_beams"):
                kwargs["num_beams"] = extra["num_beams"]
            if extra.get("do_sample"):
                kwargs.update(do_sample=True, top_k=0)
            else:
                kwargs["do_sample"] = False
            torch.manual_seed(0)
            if flag:
                return model.generate(ids.to(device), async_stopping_criteria=True, **kwargs)
            with stock():
                return model.generate(ids.to(device), **kwargs)

        want = observe(lambda: call(False))
        got = observe(lambda: call(True))
        torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)
        self.assertEqual(got[0], want[0])  # the records, in order
        self.assertEqual(got[1], want[1])
        self.assertEqual(got[2], want[2])  # what `warning_once` has emitted (and will not emit again)

    def test_a_forward_raising_after_its_padding_check_has_warned_as_stock(self):
        """The decode forward that first feeds a pad token raises after its check (an instance forward of the final
        norm): stock warned before the exception, and so must the flag (the controller's abort runs the check)."""
        model = build("gpt2")
        norm = model.transformer.ln_f

        def call(flag):
            calls = [0]

            def raising(hidden):
                calls[0] += 1
                if calls[0] == 2:  # the first decode forward: row 0 finished at the prefill's step, it feeds a pad
                    raise RuntimeError("forward failed")
                return type(norm).forward(norm, hidden)

            norm.forward = raising
            kwargs = dict(max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS, do_sample=False,
                          attention_mask=torch.ones_like(PROMPT),
                          stopping_criteria=StoppingCriteriaList([StopRowsAt([1, None, None], PROMPT.shape[1])]))
            try:
                with self.assertRaisesRegex(RuntimeError, "forward failed"):
                    if flag:
                        model.generate(PROMPT, async_stopping_criteria=True, **kwargs)
                    else:
                        with stock():
                            model.generate(PROMPT, **kwargs)
            finally:
                del norm.forward

        want = observe(lambda: call(False))
        got = observe(lambda: call(True))
        if TRANSFORMERS_VERSION >= (5, 18):  # earlier releases keep the all-ones mask: no check, no warning
            self.assertTrue(any("attention_mask" in r[3] for r in want[0]))  # the case reaches the warning
        self.assertEqual(got[:3], want[:3])
        self.assertEqual(tas.last_path().path, "deferred")

if __name__ == "__main__":
    unittest.main()
