"""Seeded differential fuzzing: flag on (one-step-late path, forced on CPU) vs stock transformers, bit for bit.

Each draw picks, from `random.Random(seed)`: a model family, batch size 1-4, left padding, EOS positions per row,
extra logits processors, `max_new_tokens` or `max_length`, greedy or seeded sampling, output flags, the cache
kind, and in one draw of five beam search (beams, `early_stopping`, `num_return_sequences`, length penalty). The flag-on output must equal stock's exactly (sequences, scores, logits, hidden states, returned cache),
the RNG must be left in the same state (`torch.rand(4)` after the call), and the deferred path must have run: one
extra forward exactly when stock stopped before the length limit, and no `StockPathWarning`.

Drawn after those, with modest probabilities, the adversarial shapes of issue 10 (see test_adversarial.py):
- `nested`: a logits processor or stopping criterion that runs an inner `generate()` (another model or the same
  one; greedy, sampling or beam search; flag on or off) whose first token steers the outer call; every inner call
  stock made must have returned the same under the flag (the extra step may add one call at the end);
- `subclass`: a `MaxLengthCriteria` subclass that also stops on a token the model makes, or an `EosTokenCriteria`
  subclass with 10+ ids whose `__call__` ignores EOS before a length (generate's own EOS is then left out);
- `cache="tight_static"`: a user StaticCache with exactly the positions the flag-off run writes;
- `randomness`: dropout in train mode, or a `torch.rand` noise processor, drawing from the RNG outside sampling;
- `raise_at`: a logits processor raising at a random call; both runs must raise, and a recording streamer (when not
  beam search) and the user cache must hold exactly what stock left in them.
Every user cache is compared in full (`adversarial_helpers.assert_same_cache_state`).

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
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList

from adversarial_helpers import (
    Boom,
    EosOnlyAfter,
    InnerGenerate,
    InnerGenerateCriterion,
    InnerGenerateProcessor,
    MaxLengthOrToken,
    NoiseProcessor,
    RaiseAtCall,
    RecordingStreamer,
    assert_same_cache_state,
    judge_model,
    static_cache,
)
from models import PAD, PROMPT_LEN, VOCAB, CountForwards, assert_same, build, pick_eos, prompt, stock
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


DROPOUT = {"gpt2": dict(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)}  # others: attention_dropout


@functools.lru_cache(maxsize=None)
def model_of(family, dropout=False):
    """One model per family per process: generate() leaves no state on the model. `dropout`: a copy with dropout
    in its config, in train() mode (its forwards draw from the RNG)."""
    if not dropout:
        return build(family, device=DEVICE)
    return build(family, device=DEVICE, **DROPOUT.get(family, dict(attention_dropout=0.2))).train()


@functools.lru_cache(maxsize=None)
def judge_of():
    return judge_model().to(DEVICE)


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
    # issue 10's adversarial shapes, drawn after everything above (earlier draws keep their values)
    if rng.random() < 0.05:
        case["nested"] = dict(model=rng.choice(("judge", "same")), where=rng.choice(("processor", "criterion")),
                              max_new_tokens=rng.randint(1, 3), beams=rng.choice((1, 1, 2)),
                              do_sample=rng.random() < 0.3, flag=rng.random() < 0.3)
    if rng.random() < 0.08:
        case["subclass"] = rng.choice(("max_length_or_token", "eos_after"))
        case["subclass_step"] = rng.randint(0, max(steps - 2, 0))
    if family in STATIC_FAMILIES and rng.random() < 0.08:
        case["cache"] = "tight_static"
    if rng.random() < 0.08:
        case["randomness"] = rng.choice(("dropout", "noise"))
    if rng.random() < 0.06:
        case["raise_at"] = rng.randint(0, steps)
    return case


GENERATE_KEYS = ("max_new_tokens", "max_length", "repetition_penalty", "min_new_tokens", "do_sample", "top_k",
                 "top_p", "temperature", "return_dict_in_generate", "output_scores", "output_logits",
                 "output_hidden_states", "num_beams", "early_stopping", "num_return_sequences", "length_penalty")


class Run:
    """What one generate() call left: output (None if it raised `Boom`), user cache, RNG draw, forwards, ..."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _callbacks(case: dict, model, eos, tokens):
    """Fresh logits processors, stopping criteria, streamer and inner-call recorder for one run of `case`."""
    processors, criteria, inner, streamer = [], [], None, None
    if "nested" in case:
        spec = case["nested"]
        inner = InnerGenerate(judge_of() if spec["model"] == "judge" else model, flag=spec["flag"] or None,
                              bias=0.5, max_new_tokens=spec["max_new_tokens"], num_beams=spec["beams"],
                              do_sample=spec["do_sample"], eos_token_id=None)
        if spec["where"] == "processor":
            processors.append(InnerGenerateProcessor(inner))
        else:
            criteria.append(InnerGenerateCriterion(inner))
    if case.get("randomness") == "noise":
        processors.append(NoiseProcessor())
    if "raise_at" in case:
        processors.append(RaiseAtCall(case["raise_at"]))
        if "num_beams" not in case:  # stock refuses a streamer with beam search
            streamer = RecordingStreamer()
    if "subclass" in case:
        if case["subclass"] == "max_length_or_token":
            criteria.append(MaxLengthOrToken(max_length=PROMPT_LEN + MAX_STEPS + 10, token=tokens[0]))
        else:
            # generate's own EOS criterion is left out (it would stop the rows first): the subclass holds the EOS
            # ids, 10 ids that are never made (past the vocabulary) and honours them from a length on
            criteria.append(EosOnlyAfter(list(eos or []) + list(range(VOCAB, VOCAB + 10)),
                                         min_length=PROMPT_LEN + case["subclass_step"] + 1))
    return processors, criteria, inner, streamer


def run(case: dict, flag: bool, eos=None, tokens=None, cache_len=None):
    """One call of `case`: a `Run` (output or None if `Boom` was raised, user cache, torch.rand(4) after, forward
    count, StockPathWarnings, streamer puts, inner call records)."""
    model = model_of(case["family"], case.get("randomness") == "dropout")
    ids, mask = prompt(batch=case["batch"], left_pad=case["left_pad"], seed=case["prompt_seed"], device=DEVICE)
    kwargs = {key: case[key] for key in GENERATE_KEYS if key in case}
    kwargs["eos_token_id"] = None if case.get("subclass") == "eos_after" else eos
    processors, criteria, inner, streamer = _callbacks(case, model, eos, tokens)
    if processors:
        kwargs["logits_processor"] = LogitsProcessorList(processors)
    if criteria:
        kwargs["stopping_criteria"] = StoppingCriteriaList(criteria)
    if streamer is not None:
        kwargs["streamer"] = streamer
    cache = None
    if case["cache"] == "static":
        kwargs["cache_implementation"] = "static"
        if DEVICE != "cpu":
            kwargs["disable_compile"] = True
    elif case["cache"] == "user_dynamic":
        cache = kwargs["past_key_values"] = DynamicCache(config=model.config)
    elif case["cache"] == "tight_static":
        cache = kwargs["past_key_values"] = static_cache(model, cache_len or PROMPT_LEN + MAX_STEPS + 2,
                                                         batch_size=case["batch"])
        kwargs["disable_compile"] = True
    if flag:
        kwargs["async_stopping_criteria"] = True
    counter = CountForwards(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StockPathWarning)
            torch.manual_seed(case["sample_seed"])
            try:
                out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
            except Boom:
                out = None
            after = torch.rand(4, device=DEVICE)
    finally:
        counter.close()
    stock_path = [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]
    return Run(out=out, cache=cache, after=after, forwards=counter.count, stock_path=stock_path,
               puts=None if streamer is None else (streamer.puts, streamer.ends),
               records=None if inner is None else inner.records)


def _probe(case: dict):
    """The tokens each row makes in a stock run of the same call without EOS (same processors, same sampling seed,
    same dropout; no stopping subclass, no raise, no output flags)."""
    probe = {k: v for k, v in case.items() if k not in (
        "min_new_tokens", "return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states",
        "subclass", "raise_at")}
    if probe["cache"] == "tight_static":
        probe["cache"] = "dynamic"
    with stock():
        out = run(probe, flag=False, eos=None).out
    return out[:, PROMPT_LEN:].tolist()


def eos_of(case: dict, generated=None):
    """EOS ids that stop each row about where `case["eos_steps"]` says.

    Like `models.eos_ids_finishing_at`, but read from a stock run of the same call without EOS (same processors,
    same sampling seed), so the ids are also hit under sampling and repetition penalties.
    """
    if case["eos_steps"] == "no_eos":
        return None
    generated = _probe(case) if generated is None else generated
    return pick_eos(generated, case["eos_steps"]) or [VOCAB - 1]


def limit_of(case: dict) -> int:
    """The total length stock stops at when no stopping criterion fires first."""
    return case["max_length"] if "max_length" in case else PROMPT_LEN + case["max_new_tokens"]


class DifferentialFuzz(unittest.TestCase):
    def check_draw(self, seed: int) -> bool:
        """Compare one draw with stock; return whether stock stopped before the length limit."""
        case = draw(seed)
        generated = _probe(case) if (case["eos_steps"] != "no_eos" or "subclass" in case) else None
        eos = eos_of(case, generated)
        # the subclass's own stop token: what row 0 makes at the drawn step
        tokens = [generated[0][min(case["subclass_step"], len(generated[0]) - 1)]] if "subclass" in case else None
        cache_len = None
        if case["cache"] == "tight_static":
            # the positions stock writes: the prompt, then one per forward after the prefill
            with stock():
                roomy = run(case, flag=False, eos=eos, tokens=tokens)
            cache_len = PROMPT_LEN + roomy.forwards - 1
        with stock():
            ref = run(case, flag=False, eos=eos, tokens=tokens, cache_len=cache_len)
        on = run(case, flag=True, eos=eos, tokens=tokens, cache_len=cache_len)
        self.assertEqual(ref.out is None, on.out is None,
                         f"raised Boom: stock {ref.out is None}, flag on {on.out is None}")
        if ref.out is not None:
            assert_same(self, ref.out, on.out, "output")
        if ref.cache is not None:
            assert_same_cache_state(self, ref.cache, on.cache, "user cache")
        self.assertEqual(ref.puts, on.puts, "streamer puts")
        if ref.records is not None:
            # no processor or criterion runs in the extra step: the inner calls are exactly stock's
            assert_same(self, ref.records, on.records, "inner generate() calls")
        self.assertTrue(torch.equal(ref.after, on.after), "RNG state after generate() differs")
        self.assertEqual(on.stock_path, [], "the flag-on call ran the stock path")
        if ref.out is None or case.get("nested", {}).get("model") == "same":
            return False  # forwards: an exception ends both runs wherever it is raised; inner calls are counted too
        # one forward per step: stock stopped early when it made fewer steps than the limit allows (beam search
        # may return shorter sequences than the steps it made: its best beams can have finished earlier)
        stopped_early = ref.forwards < limit_of(case) - PROMPT_LEN
        # a cache with room for exactly stock's positions has none for an extra step: its last verdict is read at
        # once instead
        extra = 1 if stopped_early and case["cache"] != "tight_static" else 0
        self.assertEqual(on.forwards - ref.forwards, extra,
                         f"forwards: stock {ref.forwards}, flag on {on.forwards}, stopped early: {stopped_early}")
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
        self.assertEqual({c["cache"] for c in cases}, {"dynamic", "user_dynamic", "static", "tight_static"})
        self.assertFalse({"static", "tight_static"} & {c["cache"] for c in cases if c["family"] == "gpt2"})
        for key in ("max_length", "max_new_tokens", "repetition_penalty", "min_new_tokens", "top_k", "top_p",
                    "temperature", "output_scores", "output_logits", "output_hidden_states", "num_beams",
                    "num_return_sequences", "length_penalty"):
            self.assertTrue(any(key in c for c in cases), key)
        self.assertTrue(any(c["do_sample"] for c in cases) and not all(c["do_sample"] for c in cases))
        self.assertTrue(any(c["left_pad"] for c in cases) and not all(c["left_pad"] for c in cases))
        self.assertTrue(any(c["eos_steps"] == "no_eos" for c in cases))
        # issue 10's shapes, each in a few draws (not so many that the default 300 draws get slow)
        self.assertEqual({c["subclass"] for c in cases if "subclass" in c}, {"max_length_or_token", "eos_after"})
        self.assertEqual({c["randomness"] for c in cases if "randomness" in c}, {"dropout", "noise"})
        nested = [c["nested"] for c in cases if "nested" in c]
        self.assertEqual({n["model"] for n in nested}, {"judge", "same"})
        self.assertEqual({n["where"] for n in nested}, {"processor", "criterion"})
        self.assertTrue(any(n["beams"] == 2 for n in nested) and any(n["flag"] for n in nested))
        for key in ("nested", "subclass", "randomness", "raise_at"):
            self.assertTrue(3 <= sum(key in c for c in cases) <= 40, key)
        self.assertTrue(3 <= sum(c["cache"] == "tight_static" for c in cases) <= 40)
        self.assertTrue(any("raise_at" in c and "num_beams" not in c for c in cases))

    def test_draws_are_reproducible(self):
        self.assertEqual(draw(12345), draw(12345))


if __name__ == "__main__":
    unittest.main()
