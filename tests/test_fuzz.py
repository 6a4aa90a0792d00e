"""Seeded differential fuzzing: flag on (one-step-late path, forced on CPU) vs stock transformers, bit for bit.

Each draw picks, from `random.Random(seed)`: a model family, batch size 1-4, left padding, EOS positions per row,
extra logits processors, `max_new_tokens` or `max_length`, greedy or seeded sampling, output flags, the cache
kind, and in one draw of five beam search (beams, `early_stopping`, `num_return_sequences`, length penalty). The flag-on output must equal stock's exactly (sequences, scores, logits, hidden states, returned cache),
the RNG must be left in the same state (`torch.rand(4)` after the call), and the deferred path must have run: one
extra forward exactly when stock stopped before the length limit, and no `StockPathWarning`.

Environment:
- `TAS_FUZZ_DRAWS`: number of draws (default 300);
- `TAS_FUZZ_SEED`: the first draw's seed (default 0; draw i uses seed TAS_FUZZ_SEED + i);
- `TAS_FUZZ_ONLY`: a comma-separated list of seeds to replay instead (e.g. the ones a failure reported);
- `TAS_FUZZ_DEVICE`: where the models run (default cpu; `cuda` on a GPU machine, where a static cache is used
  without auto-compilation: every draw's new shapes would recompile, and compiled decoding has tests of its own).
"""

from __future__ import annotations

import functools
import os
import random
import unittest
import warnings

import torch
from parameterized import parameterized
from transformers import DynamicCache

from models import PAD, PROMPT_LEN, VOCAB, CountForwards, assert_same, build, prompt, stock
from transformers_async_stop import StockPathWarning

FAMILIES = ("llama", "gpt2", "qwen2", "mistral")
STATIC_FAMILIES = ("llama", "qwen2", "mistral")
MAX_STEPS = 16
CHUNK = 50
DEVICE = os.environ.get("TAS_FUZZ_DEVICE", "cpu")


def _seeds() -> list[int]:
    only = os.environ.get("TAS_FUZZ_ONLY", "").strip()
    if only:
        return [int(s) for s in only.split(",") if s.strip()]
    draws = int(os.environ.get("TAS_FUZZ_DRAWS", "300"))
    first = int(os.environ.get("TAS_FUZZ_SEED", "0"))
    return list(range(first, first + draws))


SEEDS = _seeds()
CHUNKS = [SEEDS[i:i + CHUNK] for i in range(0, len(SEEDS), CHUNK)]


@functools.lru_cache(maxsize=None)
def model_of(family):
    """One model per family per process: generate() leaves no state on the model."""
    return build(family, device=DEVICE)


def draw(seed: int) -> dict:
    """The parameters of one draw (plain values, printable in a failure report)."""
    rng = random.Random(seed)
    family = rng.choice(FAMILIES)
    batch = rng.randint(1, 4)
    case = dict(family=family, batch=batch, left_pad=rng.random() < 0.5, prompt_seed=rng.randint(0, 20))
    steps = 1 if rng.random() < 0.05 else rng.randint(2, MAX_STEPS)  # 1: prefill only
    if rng.random() < 0.5:
        case["max_new_tokens"] = steps
    else:
        case["max_length"] = PROMPT_LEN + steps
    eos_kind = rng.choices(("rows", "never", "no_eos"), weights=(75, 10, 15))[0]
    if eos_kind == "rows":
        # the step (of the same call without EOS) at which each row should make its EOS id; None: never
        # (a stop at the last step is a stop at the length limit: no extra step to undo, so aim before it)
        case["eos_steps"] = tuple(None if rng.random() < 0.1 else rng.randint(0, max(steps - 2, 0))
                                  for _ in range(batch))
    elif eos_kind == "never":
        case["eos_steps"] = (None,) * batch
    else:
        case["eos_steps"] = "no_eos"  # eos_token_id=None: no EOS criterion at all, finished rows are not padded
    if rng.random() < 0.3:
        case["repetition_penalty"] = rng.choice((0.8, 1.3, 2.0))
    if rng.random() < 0.3:
        # mostly below the EOS steps; at times past them (EOS suppressed) or past the limit
        case["min_new_tokens"] = rng.randint(1, steps // 2 + 1) if rng.random() < 0.7 else rng.randint(1, MAX_STEPS)
    case["do_sample"] = rng.random() < 0.4
    if case["do_sample"]:
        for name, values in (("top_k", (None, 1, 3, 10)), ("top_p", (None, 0.5, 0.9)),
                             ("temperature", (None, 0.5, 1.0, 1.7))):
            value = rng.choice(values)
            if value is not None:
                case[name] = value
    case["sample_seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.5:
        case["return_dict_in_generate"] = True
        for name in ("output_scores", "output_logits", "output_hidden_states"):
            if rng.random() < 0.5:
                case[name] = True
    kinds = ("dynamic", "user_dynamic") + (("static",) if family in STATIC_FAMILIES else ())
    case["cache"] = rng.choice(kinds)
    # drawn last, so that the draws above are the same as before beam search joined
    if rng.random() < 0.2:
        beams = case["num_beams"] = rng.choice((2, 3))
        case["early_stopping"] = rng.choice((True, False, "never"))
        if rng.random() < 0.4:
            case["num_return_sequences"] = rng.randint(1, beams)
        if rng.random() < 0.3:
            case["length_penalty"] = rng.choice((-1.0, 0.0, 2.0))
    return case


GENERATE_KEYS = ("max_new_tokens", "max_length", "repetition_penalty", "min_new_tokens", "do_sample", "top_k",
                 "top_p", "temperature", "return_dict_in_generate", "output_scores", "output_logits",
                 "output_hidden_states", "num_beams", "early_stopping", "num_return_sequences", "length_penalty")


def run(case: dict, flag: bool, eos=None):
    """(output, user cache or None, torch.rand(4) after, forward count, StockPathWarnings) of one call."""
    model = model_of(case["family"])
    ids, mask = prompt(batch=case["batch"], left_pad=case["left_pad"], seed=case["prompt_seed"], device=DEVICE)
    kwargs = {key: case[key] for key in GENERATE_KEYS if key in case}
    kwargs["eos_token_id"] = eos
    cache = None
    if case["cache"] == "static":
        kwargs["cache_implementation"] = "static"
        if DEVICE != "cpu":
            kwargs["disable_compile"] = True
    elif case["cache"] == "user_dynamic":
        cache = kwargs["past_key_values"] = DynamicCache(config=model.config)
    if flag:
        kwargs["async_stopping_criteria"] = True
    counter = CountForwards(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StockPathWarning)
            torch.manual_seed(case["sample_seed"])
            out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
            after = torch.rand(4, device=DEVICE)
    finally:
        counter.close()
    stock_path = [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]
    return out, cache, after, counter.count, stock_path


def eos_of(case: dict):
    """EOS ids that stop each row about where `case["eos_steps"]` says.

    Like `models.eos_ids_finishing_at`, but read from a stock run of the same call without EOS (same processors,
    same sampling seed), so the ids are also hit under sampling and repetition penalties.
    """
    if case["eos_steps"] == "no_eos":
        return None
    probe = {k: v for k, v in case.items() if k not in ("min_new_tokens", "return_dict_in_generate", "output_scores",
                                                           "output_logits", "output_hidden_states")}
    with stock():
        out = run(probe, flag=False, eos=None)[0]
    generated = out[:, PROMPT_LEN:].tolist()
    chosen = []
    for tokens, step in zip(generated, case["eos_steps"]):
        if step is None:
            continue
        firsts = [k for k in range(len(tokens)) if tokens[k] not in tokens[:k] and tokens[k] != PAD]
        later = [k for k in firsts if k >= step]
        if later or firsts:
            chosen.append(tokens[later[0] if later else firsts[-1]])
    never = {t for tokens, step in zip(generated, case["eos_steps"]) if step is None for t in tokens}
    return [t for t in dict.fromkeys(chosen) if t not in never] or [VOCAB - 1]


def limit_of(case: dict) -> int:
    """The total length stock stops at when no stopping criterion fires first."""
    return case["max_length"] if "max_length" in case else PROMPT_LEN + case["max_new_tokens"]


class DifferentialFuzz(unittest.TestCase):
    def check_draw(self, seed: int) -> bool:
        """Compare one draw with stock; return whether stock stopped before the length limit."""
        case = draw(seed)
        eos = eos_of(case)
        with stock():
            ref, ref_cache, ref_after, ref_forwards, _ = run(case, flag=False, eos=eos)
        on, on_cache, on_after, on_forwards, stock_path = run(case, flag=True, eos=eos)
        assert_same(self, ref, on, "output")
        if ref_cache is not None:
            assert_same(self, ref_cache, on_cache, "user cache")
        self.assertTrue(torch.equal(ref_after, on_after), "RNG state after generate() differs")
        self.assertEqual(stock_path, [], "the flag-on call ran the stock path")
        # one forward per step: stock stopped early when it made fewer steps than the limit allows (beam search
        # may return shorter sequences than the steps it made: its best beams can have finished earlier)
        stopped_early = ref_forwards < limit_of(case) - PROMPT_LEN
        self.assertEqual(on_forwards - ref_forwards, 1 if stopped_early else 0,
                         f"forwards: stock {ref_forwards}, flag on {on_forwards}, stopped early: {stopped_early}")
        return stopped_early

    @parameterized.expand([(f"seeds_{c[0]}_to_{c[-1]}", c) for c in CHUNKS])
    def test_flag_on_equals_stock(self, _, seeds):
        failures, early = [], 0
        for seed in seeds:
            try:
                early += self.check_draw(seed)
            except Exception as exc:  # noqa: BLE001 - every failing draw is collected with its seed
                failures.append(f"seed {seed}: {draw(seed)}\n    {type(exc).__name__}: {exc}")
        self.assertEqual(failures, [], f"{len(failures)} of {len(seeds)} draws differ from stock "
                                       f"(replay with TAS_FUZZ_ONLY=<seeds>):\n" + "\n".join(failures))
        if len(seeds) >= 20:
            # the draws must exercise the extra step and its undo, not only runs that end at the length limit
            self.assertGreaterEqual(early, len(seeds) // 5, f"only {early} of {len(seeds)} draws stopped early")


class DrawsCoverTheSpace(unittest.TestCase):
    """The draws reach every knob (so the fuzz test cannot silently shrink to a few easy cases)."""

    def test_every_knob_is_drawn(self):
        cases = [draw(seed) for seed in range(300)]
        self.assertEqual({c["family"] for c in cases}, set(FAMILIES))
        self.assertEqual({c["batch"] for c in cases}, {1, 2, 3, 4})
        self.assertEqual({c["cache"] for c in cases}, {"dynamic", "user_dynamic", "static"})
        self.assertNotIn("static", {c["cache"] for c in cases if c["family"] == "gpt2"})
        for key in ("max_length", "max_new_tokens", "repetition_penalty", "min_new_tokens", "top_k", "top_p",
                    "temperature", "output_scores", "output_logits", "output_hidden_states", "num_beams",
                    "num_return_sequences", "length_penalty"):
            self.assertTrue(any(key in c for c in cases), key)
        self.assertTrue(any(c["do_sample"] for c in cases) and not all(c["do_sample"] for c in cases))
        self.assertTrue(any(c["left_pad"] for c in cases) and not all(c["left_pad"] for c in cases))
        self.assertTrue(any(c["eos_steps"] == "no_eos" for c in cases))

    def test_draws_are_reproducible(self):
        self.assertEqual(draw(12345), draw(12345))


if __name__ == "__main__":
    unittest.main()
