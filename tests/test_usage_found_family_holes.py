"""Holes of the package the usage fuzzer's `found_family` dimension found (usage_dimensions._found_family), each a
minimal reproduction, fixed.

Seed 15329 (5.24.0, `scripts/usage_fuzz.py --require found_family --seed 10000`; Ministral, whose layers slide): a
streamer raising at its last put (the call's last token) in a call asking for `return_dict_in_generate` with
`output_hidden_states` or `output_attentions`, on a user DynamicCache with sliding-window layers, leaves the cache
other than stock's: each sliding layer's `record_past` True (stock's False) and one key/value more kept (the window's
4 where stock's layer holds 3). Any sliding window does it, a Llama or Mistral with `sliding_window` set too; without
the output flags, or with the streamer raising before the last put, the two agree. The next call on the cache puts
the state back (its output equals stock's): what differed is the cache the caller holds after the exception. The
cause: the last step's tokens reach the streamer in the controller's `finish()`, after it let go of the loop's stop
check, so the exception's `abort` no longer trimmed the recorded past (5.14+ layers record it for the extra step).
Fixed in `control/stop_check.py` (`finish`); this test failed on 5.17.0, 5.23.0 and 5.24.0 before.
"""

from __future__ import annotations

import unittest

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from adversarial_helpers import cache_state
from models import build, stock


class _RaisesAtPut(BaseStreamer):
    def __init__(self, at):
        self.at, self.n = at, 0

    def put(self, value):
        n, self.n = self.n, self.n + 1
        if n == self.at:
            raise ValueError(f"streamer put {n}")

    def end(self):
        pass


def _state_after_a_raising_last_put(flag: bool):
    model = build("mistral", config_kwargs={"sliding_window": 4})
    ids = torch.tensor([[5, 7, 9]])
    cache = DynamicCache(config=model.config)
    kwargs = dict(max_new_tokens=4, do_sample=False, past_key_values=cache, eos_token_id=None, pad_token_id=0,
                  return_dict_in_generate=True, output_hidden_states=True, streamer=_RaisesAtPut(4))
    if flag:
        kwargs["async_stopping_criteria"] = True
    with _Raised() as raised:
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in cache_state(cache).items()}
    state["record_past"] = [getattr(layer, "record_past", None) for layer in cache.layers]
    return raised, state


class _Raised:
    """The message of the ValueError the block raises (None if none)."""

    def __enter__(self):
        self.message = None
        return self

    def __exit__(self, kind, exc, tb):
        if kind is ValueError:
            self.message = str(exc)
            return True
        return False


def _same(a, b) -> bool:
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape \
                    or not bool((x == y).all()):
                return False
        elif x != y:
            return False
    return True


class StreamerRaisingAtTheLastPutOnASlidingCache(unittest.TestCase):
    def _check(self):
        with stock():
            raised_stock, stock_state = _state_after_a_raising_last_put(False)
        raised_flag, flag_state = _state_after_a_raising_last_put(True)
        self.assertEqual(raised_stock.message, "streamer put 4")
        self.assertEqual(raised_flag.message, raised_stock.message)
        self.assertTrue(_same(stock_state, flag_state),
                        f"stock {stock_state['record_past']} vs flag {flag_state['record_past']}; keys "
                        f"{[tuple(v.shape) for k, v in sorted(stock_state.items()) if 'keys' in k]} vs "
                        f"{[tuple(v.shape) for k, v in sorted(flag_state.items()) if 'keys' in k]}")

    def test_the_cache_after_the_exception_equals_stocks(self):
        self._check()


if __name__ == "__main__":
    unittest.main()
