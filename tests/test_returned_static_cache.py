"""A returned static cache equals stock's bit for bit after an early stop, whatever the release's `crop()` does.

transformers 5.24 makes `StaticLayer` (and `StaticSlidingWindowLayer` while it stays inside its window, and
`StaticIndexedLayer`) croppable, and their `crop()` only moves the counters back: the undone step's keys and values
stay in the buffers, where the flag-off run never wrote (zeros). The deferred path must clear them on every release.
"""

from __future__ import annotations

import unittest

import pytest
import torch
from transformers import StaticCache

from models import PAD, assert_same, build, eos_ids_finishing_at, prompt, stock

MAX_NEW = 10


def _generate(model, ids, mask, flag, **kwargs):
    if flag:
        kwargs["async_stopping_criteria"] = True
    return model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=MAX_NEW, do_sample=False,
                          return_dict_in_generate=True, output_scores=True, **kwargs)


def _cache_of(out):
    cache = getattr(out, "cache", None) if "cache" in out else None
    return cache if cache is not None else out["past_key_values"]


class ReturnedStaticCache(unittest.TestCase):
    def _check(self, model, **kwargs):
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [2, 4, 3], max_new_tokens=MAX_NEW)
        with stock():
            ref = _generate(model, ids, mask, False, eos_token_id=eos, **kwargs)
        on = _generate(model, ids, mask, True, eos_token_id=eos, **kwargs)
        self.assertLess(ref.sequences.shape[1], ids.shape[1] + MAX_NEW, "the call must stop early")
        assert_same(self, ref, on)
        return ref, on

    @pytest.mark.core
    def test_a_returned_static_cache_has_zeros_where_the_undone_step_wrote(self):
        model = build("llama")
        ref, on = self._check(model, cache_implementation="static")
        length = ref.sequences.shape[1] - 1
        for layer in _cache_of(on).layers:
            self.assertTrue(torch.equal(layer.keys[:, :, length:], torch.zeros_like(layer.keys[:, :, length:])))

    def test_a_returned_static_sliding_window_cache_inside_its_window_equals_stock(self):
        # a window wider than the whole call: 5.24's StaticSlidingWindowLayer is croppable there
        model = build("mistral", sliding_window=64)
        self._check(model, cache_implementation="static")

    def test_a_user_static_cache_passed_under_either_keyword_equals_stock(self):
        model = build("llama")
        ids, mask = prompt()
        eos = eos_ids_finishing_at(model, ids, mask, [2, 4, 3], max_new_tokens=MAX_NEW)
        keywords = ("past_key_values", "cache") if "cache" in _cache_names() else ("past_key_values",)
        for keyword in keywords:
            with self.subTest(keyword=keyword):
                caches = []
                for flag in (False, True):
                    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + MAX_NEW)
                    if flag:
                        out = _generate(model, ids, mask, True, eos_token_id=eos, **{keyword: cache})
                    else:
                        with stock():
                            out = _generate(model, ids, mask, False, eos_token_id=eos, **{keyword: cache})
                    caches.append((out, cache))
                (ref, ref_cache), (on, on_cache) = caches
                assert_same(self, ref, on)
                assert_same(self, ref_cache, on_cache, "user cache")
                self.assertIs(_cache_of(on), on_cache)


def _cache_names():
    from transformers.generation.utils import ALL_CACHE_NAMES

    return ALL_CACHE_NAMES


if __name__ == "__main__":
    unittest.main()
