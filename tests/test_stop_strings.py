"""Built-in stopping criteria other than plain EOS / max_length: flag on (forced on CPU) equals stock transformers.

- `StopStringCriteria` (`stop_strings=[...]` with `tokenizer=`): a per-row criterion over the token strings;
- `EosTokenCriteria` with many EOS ids (12 or more take `torch.isin`'s sort-based algorithm instead of the
  elementwise one), given as `eos_token_id=[...]` or as an explicit criterion;
- `MaxTimeCriteria` (`max_time=`) that never fires: a criterion that returns a fresh all-False tensor every step.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import EosTokenCriteria, StoppingCriteriaList

from models import (
    PAD,
    PROMPT_LEN,
    VOCAB,
    assert_same,
    build,
    eos_ids_finishing_at,
    generate_and_draw,
    prompt,
    stock,
)
from test_config import tiny_tokenizer

FAMILIES = ("llama", "gpt2", "qwen2", "mistral")
MAX_NEW = 14
FULL_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)


def stop_string_tokenizer():
    """`tiny_tokenizer()` plus the token "abcdef": `StopStringCriteria` tokenizes that prefix to learn how each
    vocabulary entry reads, and fails on a vocabulary where it is unknown. The extra id (VOCAB) is never generated.
    Each token then reads as " wN", so stop strings match the decoded text, spaces included."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["abcdef"])
    return tokenizer


def _run(model, ids, mask, flag, seed=5, **kwargs):
    return generate_and_draw(model, ids, mask, True if flag else None, seed=seed, **kwargs)


def _greedy_tokens(model, ids, mask):
    with stock():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None)
    return out[:, PROMPT_LEN:].tolist()


def _stop_strings(kind, rows, tokenizer):
    """Stop strings taken from each row's greedy continuation, so that the greedy run stops early on them."""
    strings = []
    for row_tokens in rows:
        w = tokenizer.convert_ids_to_tokens(row_tokens)
        if kind == "one_token":
            strings += [w[3]]
        elif kind == "two_tokens":
            strings += [f"{w[2]} {w[3]}"]
        elif kind == "overhang":
            # starts inside one token and ends inside the next: "w13 w29" -> "13 w2"
            strings += [f"{w[4][1:]} {w[5][:2]}"]
        elif kind == "several":
            strings += ["no such text", f"{w[5]} {w[6]}", w[4]]
        else:
            raise ValueError(kind)
    return list(dict.fromkeys(strings))


STOP_KINDS = ("one_token", "two_tokens", "overhang", "several")


class StopStringsMatchStock(unittest.TestCase):
    @parameterized.expand([(f, k) for f in FAMILIES for k in STOP_KINDS])
    def test_stop_strings_stop_like_stock(self, family, kind):
        model = build(family)
        tokenizer = stop_string_tokenizer()
        ids, mask = prompt(batch=3, left_pad=True)
        stop_strings = _stop_strings(kind, _greedy_tokens(model, ids, mask), tokenizer)
        kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None, stop_strings=stop_strings, tokenizer=tokenizer,
                  **FULL_OUTPUTS)
        with stock():
            ref, ref_after, ref_forwards = _run(model, ids, mask, False, **kw)
        on, on_after, on_forwards = _run(model, ids, mask, True, **kw)
        assert_same(self, ref, on)
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        self.assertLess(ref.sequences.shape[1], PROMPT_LEN + MAX_NEW, "every row must meet a stop string")
        self.assertEqual(on_forwards, ref_forwards + 1)

    @parameterized.expand([(f,) for f in ("llama", "gpt2")])
    def test_single_row_stop_string_stops_early_with_one_undone_step(self, family):
        model = build(family)
        tokenizer = stop_string_tokenizer()
        ids, mask = prompt(batch=1)
        stop_strings = _stop_strings("two_tokens", _greedy_tokens(model, ids, mask), tokenizer)
        kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None, stop_strings=stop_strings, tokenizer=tokenizer)
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, False, **kw)
        on, _, on_forwards = _run(model, ids, mask, True, **kw)
        self.assertListEqual(ref.tolist(), on.tolist())
        self.assertLessEqual(ref.shape[1], PROMPT_LEN + 4, "the stop string must end the run at step 4 at latest")
        self.assertIn(stop_strings[0], tokenizer.decode(on[0, PROMPT_LEN:]))
        self.assertEqual(on_forwards, ref_forwards + 1)

    def test_stop_strings_with_sampling(self):
        model = build("qwen2")
        tokenizer = stop_string_tokenizer()
        ids, mask = prompt(batch=2)
        kw = dict(max_new_tokens=MAX_NEW, eos_token_id=None, do_sample=True, top_k=3, tokenizer=tokenizer)
        with stock():
            sampled, _, _ = _run(model, ids, mask, False, **kw)
        row = sampled[:, PROMPT_LEN:].tolist()
        kw["stop_strings"] = [f"w{row[0][3]}", f"w{row[1][2]}"]
        with stock():
            ref, ref_after, ref_forwards = _run(model, ids, mask, False, **kw)
        on, on_after, on_forwards = _run(model, ids, mask, True, **kw)
        self.assertListEqual(ref.tolist(), on.tolist())
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        self.assertLess(ref.shape[1], PROMPT_LEN + MAX_NEW, "the reference run must stop early")
        self.assertEqual(on_forwards, ref_forwards + 1)


def _many_eos(model, ids, mask, steps, count):
    """`count` distinct EOS ids: those that stop the rows at `steps`, then ids the greedy run never makes."""
    eos = eos_ids_finishing_at(model, ids, mask, steps, MAX_NEW) if any(s is not None for s in steps) else []
    seen = {t for row in _greedy_tokens(model, ids, mask) for t in row}
    unused = [t for t in range(3, VOCAB) if t not in seen and t not in eos]
    eos = eos + unused[: count - len(eos)]
    if len(eos) < count:
        raise AssertionError(f"only {len(eos)} EOS ids available")
    return eos


class ManyEosIdsMatchStock(unittest.TestCase):
    @parameterized.expand([(f, n) for f in FAMILIES for n in (12, 20)])
    def test_eos_token_id_list(self, family, count):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        eos = _many_eos(model, ids, mask, [2, 5, 8], count)
        self._assert_stock_with_early_stop(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                           **FULL_OUTPUTS)

    def _assert_stock_with_early_stop(self, model, ids, mask, **kw):
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, False, **kw)
        on, _, on_forwards = _run(model, ids, mask, True, **kw)
        assert_same(self, ref, on)
        self.assertLess(ref.sequences.shape[1], PROMPT_LEN + MAX_NEW, "the reference run must stop early")
        self.assertEqual(on_forwards, ref_forwards + 1)

    @parameterized.expand([(f,) for f in ("llama", "gpt2")])
    def test_explicit_eos_criterion_with_many_ids(self, family):
        model = build(family)
        ids, mask = prompt(batch=3)
        eos = _many_eos(model, ids, mask, [1, 4, 6], 16)
        self._assert_stock_with_early_stop(
            model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None,
            stopping_criteria=StoppingCriteriaList([EosTokenCriteria(torch.tensor(eos))]), **FULL_OUTPUTS)

    def test_many_eos_ids_with_sampling(self):
        model = build("mistral")
        ids, mask = prompt(batch=4)
        eos = list(range(VOCAB - 14, VOCAB))  # 14 ids: sampling makes some of them at some step
        kw = dict(max_new_tokens=MAX_NEW, eos_token_id=eos, do_sample=True, temperature=1.5)
        with stock():
            ref, ref_after, ref_forwards = _run(model, ids, mask, False, **kw)
        on, on_after, on_forwards = _run(model, ids, mask, True, **kw)
        self.assertListEqual(ref.tolist(), on.tolist())
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        stopped_early = ref.shape[1] < PROMPT_LEN + MAX_NEW
        self.assertEqual(on_forwards, ref_forwards + (1 if stopped_early else 0))


class MaxTimeNeverFiringMatchesStock(unittest.TestCase):
    @parameterized.expand([(f, early) for f in FAMILIES for early in (False, True)])
    def test_huge_max_time(self, family, early):
        model = build(family)
        ids, mask = prompt(batch=3, left_pad=True)
        eos = _many_eos(model, ids, mask, [3, 5, 6] if early else [None, None, None], 1)
        kw = dict(max_new_tokens=MAX_NEW, max_time=1e9, eos_token_id=eos, **FULL_OUTPUTS)
        with stock():
            ref, _, ref_forwards = _run(model, ids, mask, False, **kw)
        on, _, on_forwards = _run(model, ids, mask, True, **kw)
        assert_same(self, ref, on)
        stopped_early = ref.sequences.shape[1] < PROMPT_LEN + MAX_NEW
        self.assertEqual(stopped_early, early)
        self.assertEqual(on_forwards, ref_forwards + (1 if early else 0))


if __name__ == "__main__":
    unittest.main()
