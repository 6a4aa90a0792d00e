"""What the decode-loop tests (test_static_loop.py, test_dynamic_loop.py, and others) share: a processor and a
criterion that record every call, a criterion that changes something mid-call (`ChangeAtStep`), a streamer that
keeps what it is given, the kwargs of a call whose rows stop at different steps, and the tests both loops pass the
same way (`LoopContract`)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from models import PAD, assert_same, build, eos_ids_finishing_at, prompt


def loop_kwargs(model, ids, mask, sampling, finishing=(3, 5, None), **extra):
    """Greedy or sampling, rows finishing after the given numbers of new tokens (None: at max_new_tokens), every
    output a loop must reproduce."""
    kw = dict(max_new_tokens=10, min_new_tokens=2, pad_token_id=PAD,
              eos_token_id=eos_ids_finishing_at(model, ids, mask, list(finishing)), return_dict_in_generate=True,
              output_scores=True, output_logits=True, **extra)
    if sampling:
        kw.update(do_sample=True, top_k=12, top_p=0.9, temperature=0.8)
    return kw


class Recorder(LogitsProcessor):
    """A processor that reads `input_ids` (so no capture can prove it pure) and records every call."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append((input_ids.clone(), scores.clone()))
        return scores - 0.01 * input_ids[:, -1:].float()


class ChangeAtStep(StoppingCriteria):
    """Never stops; at its call number `at` (1 = after the prefill step) it runs `change()`: a callback that edits a
    processor, a setting or the cache in the middle of a call."""

    def __init__(self, at, change):
        self.at, self.change, self.calls = at, change, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.change()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StopAfterRepeat(StoppingCriteria):
    """A user criterion reading the whole sequence: a row stops once its last token already appeared in it."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.clone())
        return (input_ids[:, :-1] == input_ids[:, -1:]).any(-1)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended += 1


class LoopContract:
    """Tests of what user code sees, run by each loop's test case: `LOOP_KWARGS` makes generate() take the loop,
    `stock_then_loop(run)` runs `run(None)` on stock and `run(True)` through the loop (which it must take)."""

    LOOP_KWARGS: dict = {}

    def stock_then_loop(self, run):
        raise NotImplementedError

    @pytest.mark.core
    def test_user_processors_and_criteria_see_what_they_see_in_stock(self):
        model = build("llama")
        ids, mask = prompt(batch=3, left_pad=True)

        def run(flag):
            processor, criterion = Recorder(), StopAfterRepeat()
            kw = {} if flag is None else dict(async_stopping_criteria=flag)
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=PAD, eos_token_id=None,
                                 do_sample=True, top_k=8, logits_processor=LogitsProcessorList([processor]),
                                 stopping_criteria=StoppingCriteriaList([criterion]), **self.LOOP_KWARGS, **kw)
            return out, processor.seen, criterion.seen

        ref, on = self.stock_then_loop(run)
        self.assertLess(ref[0].shape[1], ids.shape[1] + 14, "the criterion must stop the rows early")
        assert_same(self, ref, on)

    @pytest.mark.core
    def test_a_streamer_gets_stocks_tokens(self):
        model = build("llama")
        ids, mask = prompt(batch=1)
        eos = eos_ids_finishing_at(model, ids, mask, [4])

        def run(flag):
            streamer = Collect()
            kw = {} if flag is None else dict(async_stopping_criteria=flag)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD,
                                 streamer=streamer, **self.LOOP_KWARGS, **kw)
            return out, streamer.chunks, streamer.ended

        ref, on = self.stock_then_loop(run)
        assert_same(self, ref, on)
