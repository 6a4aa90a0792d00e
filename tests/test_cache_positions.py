"""The undo and the room check count in the cache's own positions, never in sequence length.

A caller that reuses a cache across chat turns feeds only the tokens the cache lacks (with the full-length attention
mask, as transformers documents), or generates from `inputs_embeds`: then `input_ids.shape[-1]` is not where the
cache writes. With the flag, the extra step's position must be given back exactly there (issue 16, item 1), and a
cache sized for the flag-off run must never see a forward past its end (item 2). Every case compares with unpatched
stock: sequences, scores, the cache's whole state after each turn, and what a later turn makes of it. Where stock
itself raises (a cache too small), the flag must raise the same error.

Each case runs on the deferred path (`TRANSFORMERS_ASYNC_STOP_STATIC_LOOP=0`) and, on 5.17+, on the static-cache loop.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import pytest
import torch
from parameterized import parameterized

from adversarial_helpers import assert_same_cache_state, static_cache
from models import PAD, TRANSFORMERS_VERSION, build, prompt, stock

LOOPS = ("deferred", "static loop") if TRANSFORMERS_VERSION >= (5, 17) else ("deferred",)
# releases whose `generate()` accepts a cache fed only the new tokens (positions come from the cache): 5.3+
NEW_TOKENS_ONLY = TRANSFORMERS_VERSION >= (5, 3)
EOS = [5, 7, 9, 11, 13, 17, 19]


def _loop_env(loop: str):
    return mock.patch.dict(os.environ, {"TRANSFORMERS_ASYNC_STOP_STATIC_LOOP": "1" if loop == "static loop" else "0"})


def _kwargs(flag):
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS, return_dict_in_generate=True,
              output_scores=True)
    if flag:
        kw["async_stopping_criteria"] = True
    return kw


def _outcome(run):
    """`run()`'s result, or the exception's type and message (stock may raise; the flag must raise the same)."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - the comparison is the point
        return (type(error), str(error))


def _copy_into(model, source, room: int, batch: int):
    """A user StaticCache of `room` positions holding what `source` holds (as far as it fits)."""
    cache = static_cache(model, room, batch)
    model(torch.zeros((batch, 1), dtype=torch.long), past_key_values=cache)  # lazy initialisation
    for src, dst in zip(source.layers, cache.layers):
        n = min(src.keys.shape[-2], dst.keys.shape[-2])
        dst.keys.zero_()
        dst.values.zero_()
        dst.keys[..., :n, :] = src.keys[..., :n, :]
        dst.values[..., :n, :] = src.values[..., :n, :]
        counter = getattr(dst, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.copy_(src.cumulative_length)
    return cache


class CachePositionsEqualStock(unittest.TestCase):
    def _compare(self, scenario):
        """scenario(flag) -> (outputs..., caches...) or an exception; both runs must agree on everything."""
        with stock():
            torch.manual_seed(0)
            ref = _outcome(lambda: scenario(False))
        torch.manual_seed(0)
        on = _outcome(lambda: scenario(True))
        if isinstance(ref, tuple) and ref and isinstance(ref[0], type):
            self.assertEqual(on, ref, "stock raised; the flag must raise the same")
            return
        self.assertFalse(isinstance(on, tuple) and on and isinstance(on[0], type), f"the flag raised {on}")
        for i, (a, b) in enumerate(zip(ref, on)):
            if isinstance(a, torch.Tensor):
                self.assertTrue(torch.equal(a, b), f"output {i} differs")
            elif hasattr(a, "layers"):
                assert_same_cache_state(self, a, b, f"cache {i}")
            else:
                self.assertTrue(torch.equal(a.sequences, b.sequences), f"turn {i}: sequences differ")
                for j, (x, y) in enumerate(zip(a.scores, b.scores)):
                    self.assertTrue(torch.equal(x, y), f"turn {i}: scores[{j}] differ")
                self.assertEqual(len(a.scores), len(b.scores), f"turn {i}: number of scores")

    @parameterized.expand([(loop,) for loop in LOOPS])
    @pytest.mark.core
    def test_a_chat_fed_only_the_new_tokens_leaves_the_cache_and_the_next_turn_as_stock(self, loop):
        if not NEW_TOKENS_ONLY:
            self.skipTest("generate() takes only the new tokens with a cache from 5.3 on")
        model = build("llama")
        ids, mask = prompt(batch=2)
        new = [torch.randint(3, 40, (2, 3), generator=torch.Generator().manual_seed(s)) for s in (5, 6)]

        def chat(flag):
            cache = static_cache(model, 64, 2)
            turns, seq = [], ids
            full_mask = mask
            for k in range(3):
                # turn 1: the prompt; later turns: the tokens the cache lacks (the last answer's last token and the
                # user's new ones), with the attention mask of the whole conversation
                fed = seq if k == 0 else torch.cat([seq[:, -1:], new[k - 1]], -1)
                if k:
                    full_mask = torch.cat([full_mask, torch.ones_like(seq[:, full_mask.shape[1]:]),
                                           torch.ones_like(new[k - 1])], -1)
                    seq = torch.cat([seq, new[k - 1]], -1)
                out = model.generate(fed, attention_mask=full_mask, past_key_values=cache, **_kwargs(flag))
                turns.append(out)
                seq = torch.cat([seq, out.sequences[:, fed.shape[1]:]], -1)
                full_mask = torch.cat([full_mask, torch.ones_like(out.sequences[:, fed.shape[1]:])], -1)
            return (*turns, cache)

        with _loop_env(loop):
            self._compare(chat)

    @parameterized.expand([(loop, returned) for loop in LOOPS for returned in ("user cache", "returned cache")])
    @pytest.mark.core
    def test_inputs_embeds_with_a_static_cache_gives_the_extra_step_back_where_it_was_written(self, loop, returned):
        model = build("llama")
        ids, mask = prompt(batch=2)
        embeds = model.get_input_embeddings()(ids).detach()

        def run(flag):
            kw = _kwargs(flag)
            if returned == "user cache":
                kw["past_key_values"] = static_cache(model, 32, 2)
            else:
                kw["cache_implementation"] = "static"
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, **kw)
            cache = out.past_key_values
            # and the cache's later use: one forward on top of what it holds
            nxt = model(out.sequences[:, -1:], past_key_values=cache).logits
            return out, nxt, cache

        with _loop_env(loop):
            self._compare(run)

    @parameterized.expand([(loop, mode) for loop in LOOPS for mode in ("new tokens only", "inputs_embeds")])
    def test_a_cache_sized_around_the_stop_never_sees_a_forward_past_its_end(self, loop, mode):
        if mode == "new tokens only" and not NEW_TOKENS_ONLY:
            self.skipTest("generate() takes only the new tokens with a cache from 5.3 on")
        model = build("llama")
        ids, mask = prompt(batch=2)
        with stock():
            first = static_cache(model, 64, 2)
            out1 = model.generate(ids, attention_mask=mask, past_key_values=first, **_kwargs(False))
        new = torch.randint(3, 40, (2, 3), generator=torch.Generator().manual_seed(5))
        full_mask = torch.ones((2, out1.sequences.shape[1] + 3), dtype=torch.long)
        fed = torch.cat([out1.sequences[:, -1:], new], -1)
        held = int(first.get_seq_length())
        for room in range(held + 2, held + 14):
            def run(flag, room=room):
                if mode == "inputs_embeds":
                    cache = static_cache(model, room - held + ids.shape[1], 2)
                    out = model.generate(inputs_embeds=model.get_input_embeddings()(ids).detach(),
                                         attention_mask=mask, past_key_values=cache, **_kwargs(flag))
                else:
                    cache = _copy_into(model, first, room, 2)
                    out = model.generate(fed, attention_mask=full_mask, past_key_values=cache, **_kwargs(flag))
                return out, cache

            with self.subTest(room=room), _loop_env(loop):
                self._compare(run)


if __name__ == "__main__":
    unittest.main()
