"""Assisted decoding and prompt lookup with `async_stopping_criteria=True` (issue 11), flag on vs stock transformers.

Tiny random Llama-like models built from configs (no hub). The target has 2 layers; its drafts share its vocabulary:
- "copy":   a copy of the target (greedy drafts are always accepted; sampling drafts have p == q);
- "shared": 1 layer, sharing the target's embeddings, first layer, final norm and head (partial acceptance);
- "other":  an unrelated 1-layer model (low acceptance).
Prompt lookup runs on a prompt that ends in the target's own greedy output, which repeats n-grams, so some drafts
are accepted.

What must equal stock (the package unpatched, `models.stock()`): the returned sequences, scores, logits, hidden
states and cache (or the user's cache object), every `put()` a streamer sees and its `end()`, the RNG state after the
call (speculative sampling and the assistant's own sampling draw random numbers), and the assistant model's
`generation_config` after the call (the "heuristic" schedule writes `num_assistant_tokens` back into it; 4.57 also
writes `eos_token_id`). Errors (batch > 1, a static cache) must be the same errors.

With the flag both take the deferred path (transformers_async_stop/loops/assisted/): `TakesTheDeferredPath` checks that
no `StockPathWarning` is raised, `StaysStockWithOneWarning` what phase 1 leaves stock. `CudaAtMostOneSyncPerRound`
runs on a CUDA device only; tests/test_assisted_host_reads.py is its CPU stand-in.
"""

from __future__ import annotations

import copy
import functools
import unittest
import warnings
from unittest import mock

import pytest
import torch
from parameterized import parameterized
from transformers import DynamicCache, GenerationConfig, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from models import (PAD, TRANSFORMERS_VERSION, VOCAB, CountForwards, assert_same, build, count_syncs,
                    eos_ids_finishing_at, prompt, stock)
from transformers_async_stop import StockPathWarning
from transformers_async_stop.loops.assisted.loop import installed_port

FULL_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)
NEVER = VOCAB - 1  # an EOS id the greedy runs below do not produce (checked in `_eos`)


# --- models -----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def target():
    return build("llama")


@functools.lru_cache(maxsize=None)
def draft(kind: str):
    model = target()
    if kind == "copy":
        return copy.deepcopy(model)
    if kind == "shared":
        small = build("llama", seed=0, num_hidden_layers=1)
        small.model.embed_tokens.load_state_dict(model.model.embed_tokens.state_dict())
        small.model.layers[0].load_state_dict(model.model.layers[0].state_dict())
        small.model.norm.load_state_dict(model.model.norm.state_dict())
        small.lm_head.load_state_dict(model.lm_head.state_dict())
        return small
    if kind == "other":
        return build("llama", seed=5, num_hidden_layers=1)
    raise ValueError(kind)


def draft_config(kind: str, schedule="constant", tokens=4, threshold=0.4):
    """The assistant's generation config for one run: schedule, draft length and confidence threshold live there."""
    config = copy.deepcopy(draft(kind).generation_config)
    config.num_assistant_tokens = tokens
    config.num_assistant_tokens_schedule = schedule
    config.assistant_confidence_threshold = threshold
    return config


@functools.lru_cache(maxsize=None)
def lookup_prompt():
    """A prompt ending in 12 tokens of the target's own greedy output: its n-grams recur in what comes next."""
    ids, mask = prompt(batch=1, seed=4)
    with stock():
        out = target().generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, eos_token_id=NEVER)
    return out


# --- recording ---------------------------------------------------------------------------------------------------
class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value):
        self.puts.append(value.detach().clone())

    def end(self):
        self.ends += 1


def run(ids, flag: bool, *, assistant: str | None = None, assistant_config=None, streamer=True, seed=7, **kwargs):
    """One generate() call on the target. Returns what must equal stock, and the StockPathWarnings it raised."""
    model = target()
    if assistant is not None:
        helper = draft(assistant)
        helper.generation_config = copy.deepcopy(assistant_config or draft_config(assistant))
        kwargs["assistant_model"] = helper
    recorder = RecordingStreamer() if streamer else None
    if flag:
        kwargs["async_stopping_criteria"] = True
    rounds = CountForwards(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=PAD, streamer=recorder,
                                 **kwargs)
            after = torch.rand(4)
    finally:
        rounds.close()
    state = {
        "output": out,
        "rng_after": after,
        "streamer_puts": recorder.puts if recorder else None,
        "streamer_ends": recorder.ends if recorder else None,
    }
    if assistant is not None:
        state["assistant_generation_config"] = draft(assistant).generation_config.to_dict()
    stock_warnings = [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]
    return state, stock_warnings, rounds.count


def _eos(ids, step, max_new_tokens=16):
    """An EOS id that the target's greedy run from `ids` first produces at about `step` (0-based)."""
    return eos_ids_finishing_at(target(), ids, torch.ones_like(ids), [step], max_new_tokens)


def _sampled_eos(ids, step, kind, config, kw):
    """An EOS id that a seeded stock run of this very scenario (without EOS) first samples at `step` or later. With
    it as EOS, the run is the same up to that token, so it stops there (a copy drafts it, and accepts it)."""
    with stock():
        state, _, _ = run(ids, False, assistant=kind, assistant_config=config, streamer=False,
                          **dict(kw, eos_token_id=NEVER))
    tokens = state["output"][0, ids.shape[1]:].tolist()
    for k in range(step, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return [tokens[k]]
    return [NEVER]


# --- scenarios ---------------------------------------------------------------------------------------------------
def assisted_scenario(name):
    """(prompt ids, assistant kind, assistant config, generate kwargs, whether stock must stop before max_new_tokens).

    A "copy" draft runs without the confidence criterion unless the name sets a threshold, so that it drafts 4
    tokens a round and the target accepts them all (greedy) or with probability 1 (sampling: p == q)."""
    ids, _ = prompt(batch=1)
    kind = name.split("_")[1]
    sample = name.startswith("sample")
    kw = dict(max_new_tokens=14, eos_token_id=NEVER)
    threshold = 0.0 if kind == "copy" else 0.4
    schedule, tokens = "constant", 4
    early = False
    if sample:
        kw.update(do_sample=True, temperature=1.3)
    if "eos_in_draft" in name:  # EOS among the accepted draft tokens (a copy drafts what the target picks), or the
        # token right after them
        step = 2 if name.endswith("first") else 7
        if sample:
            kw["eos_token_id"] = _sampled_eos(ids, step, kind, draft_config(kind, schedule, tokens, threshold), kw)
        else:
            kw["eos_token_id"] = _eos(ids, step)
        early = True
    elif "eos_bonus" in name:  # EOS picked by the target after a rejected or a short draft
        kw["eos_token_id"] = _eos(ids, 5)
        early = not sample
    elif "model_eos" in name:  # the model's own EOS (token 2), which its greedy run reaches after 7 tokens
        kw.pop("eos_token_id")
        early = not sample
    elif "max_length" in name:  # `max_length - cur_len - 1` cuts the assistant's draft below its 4 tokens
        kw["max_new_tokens"] = int(name.rsplit("_", 1)[1])
    elif "heuristic_transient" in name:
        schedule, tokens = "heuristic_transient", 2
    elif "heuristic" in name:
        schedule, tokens = "heuristic", 2
    elif "no_threshold_long" in name:  # no confidence criterion: drafts stop only at their length or at EOS
        threshold, tokens = 0.0, 5
        kw["max_new_tokens"] = 10
    elif "threshold" in name:
        threshold = float(name.rsplit("_", 1)[1])
    elif "top_k" in name:
        kw["top_k"] = 5
    elif "ensemble" in name:  # 5.17+: verification against w * p + (1 - w) * q (DIVERSE)
        kw["assistant_ensemble_weight"] = 0.5
    elif "eos_ends_prompt" in name:  # one token left: a round without candidates whose input already ends on an
        # EOS (4.57-5.17 keep nothing in it: `is_done_candidate and n_matches == 0` gives the bonus token back)
        kw.update(max_new_tokens=1, eos_token_id=[int(ids[0, -1])])
    elif "max_time" in name:  # a MaxTimeCriteria that never fires: folded into the round's verdict on the host
        kw["max_time"] = 600.0
    elif "two_eos" in name:  # a list of EOS ids, one of them among the accepted draft tokens
        kw["eos_token_id"] = [NEVER] + _eos(ids, 6)
        early = not sample
    elif "no_max_new_tokens" in name:  # the budget comes from max_length only
        kw.pop("max_new_tokens")
        kw["max_length"] = ids.shape[1] + 9
    return ids, kind, draft_config(kind, schedule, tokens, threshold), kw, early


HAS_ENSEMBLE = hasattr(GenerationConfig(), "assistant_ensemble_weight")
PORTED = installed_port() is not None  # 4.57.6, 5.0-5.23 (targets.SHORTCUTS)


ASSISTED = [
    "greedy_copy", "greedy_shared", "greedy_other",
    "greedy_copy_eos_in_draft_first", "greedy_copy_eos_in_draft_second", "greedy_shared_eos_bonus",
    "greedy_shared_model_eos",
    "greedy_copy_max_length_1", "greedy_copy_max_length_3", "greedy_copy_max_length_7",
    "greedy_shared_heuristic", "greedy_copy_heuristic", "greedy_copy_heuristic_transient",
    "greedy_copy_threshold_0.4", "greedy_shared_threshold_0.9", "greedy_other_no_threshold_long",
    "sample_copy", "sample_shared", "sample_other",
    "sample_copy_eos_in_draft_first", "sample_copy_eos_in_draft_second", "sample_shared_eos_bonus", "sample_shared_model_eos",
    "sample_copy_max_length_7", "sample_other_max_length_6",
    "sample_copy_heuristic", "sample_shared_heuristic_transient",
    "sample_copy_threshold_0.4", "sample_shared_threshold_0.9", "sample_other_no_threshold_long",
    "sample_shared_top_k", "greedy_shared_ensemble", "sample_shared_ensemble",
    "greedy_shared_eos_ends_prompt", "sample_shared_eos_ends_prompt", "greedy_copy_max_time",
    "sample_shared_max_time", "greedy_copy_two_eos", "sample_copy_two_eos", "sample_copy_max_length_3",
    "greedy_copy_max_length_2", "greedy_copy_no_max_new_tokens", "sample_other_heuristic",
    "greedy_other_heuristic_transient", "sample_shared_threshold_0.0",
]


def lookup_scenario(name):
    ids = lookup_prompt()
    kw = dict(max_new_tokens=20, eos_token_id=NEVER, prompt_lookup_num_tokens=3)
    early = False
    if name.startswith("sample"):
        kw.update(do_sample=True, temperature=0.7)
    if "eos_ends_prompt" in name:  # one token left: no candidates, and the input already ends on an EOS
        kw.update(max_new_tokens=1, eos_token_id=[int(ids[0, -1])])
    elif "eos" in name and "min_new_tokens" not in name:
        kw["eos_token_id"] = _eos(ids, 9, 20)
        early = not name.startswith("sample")
    elif "max_length" in name:  # a draft longer than what is left of the budget (5.17+ crops the accepted run)
        kw["max_new_tokens"] = int(name.rsplit("_", 1)[1])
    elif "tokens_10" in name:
        kw["prompt_lookup_num_tokens"] = 10
    elif "ngram_1" in name:
        kw["max_matching_ngram_size"] = 1
    elif "repetition_penalty" in name:  # a logits processor that the candidate check runs on fake logits
        kw["repetition_penalty"] = 1.3
    elif "no_repeat_ngram" in name:  # a processor that forbids tokens: the candidate check can cut a draft
        kw["no_repeat_ngram_size"] = 4
    elif "eos_min_new_tokens" in name:  # the candidate check's min-length processor forbids an EOS candidate
        kw.update(eos_token_id=_eos(ids, 0, 20), min_new_tokens=16)
    elif "top_k_min_p" in name:  # processors whose forbidden-candidate check cannot cut a draft (taken on the host)
        kw.update(top_k=5, min_p=0.05)
    elif "max_time" in name:
        kw["max_time"] = 600.0
    return ids, kw, early


LOOKUP = [
    "greedy", "greedy_eos", "greedy_max_length_1", "greedy_max_length_2", "greedy_max_length_3",
    "greedy_tokens_10", "greedy_ngram_1", "greedy_repetition_penalty", "greedy_no_repeat_ngram",
    "sample", "sample_eos", "sample_max_length_2",
    "greedy_eos_ends_prompt", "sample_eos_ends_prompt", "sample_top_k_min_p", "greedy_max_time",
    "greedy_eos_min_new_tokens", "sample_eos_min_new_tokens", "sample_repetition_penalty",
]


# --- equality with stock -----------------------------------------------------------------------------------------
class AssistedEqualsStock(unittest.TestCase):
    """Assisted decoding with a draft model (greedy, and speculative sampling with do_sample=True)."""

    @parameterized.expand([(name,) for name in ASSISTED])
    def test_outputs_match_stock(self, name):
        if "ensemble" in name and not HAS_ENSEMBLE:
            self.skipTest("assistant_ensemble_weight is new in 5.17")
        ids, kind, config, kw, early = assisted_scenario(name)
        with stock():
            try:
                ref, _, ref_rounds = run(ids, False, assistant=kind, assistant_config=config, **kw, **FULL_OUTPUTS)
            except Exception as exc:  # noqa: BLE001 - 5.15.1's own loop crashes in some all-accepted rounds
                failed = exc
            else:
                failed = None
        if failed is not None:  # then the flag must fail the same way
            with self.assertRaises(type(failed)) as caught:
                run(ids, True, assistant=kind, assistant_config=config, **kw, **FULL_OUTPUTS)
            self.assertEqual(str(caught.exception), str(failed))
            return
        on, _, _ = run(ids, True, assistant=kind, assistant_config=config, **kw, **FULL_OUTPUTS)
        assert_same(self, ref, on, "flag on")
        new_tokens = ref["output"].sequences.shape[1] - ids.shape[1]
        if early:
            self.assertLess(new_tokens, kw["max_new_tokens"], "the scenario was meant to stop on EOS")
        if "max_length" in name:
            self.assertEqual(new_tokens, kw["max_new_tokens"])
        if kind == "copy" and not kw.get("do_sample") and new_tokens > 2:
            self.assertLess(ref_rounds, new_tokens, "a copy of the target should have drafts accepted")

    @parameterized.expand([("greedy",), ("sample",)])
    @pytest.mark.core
    def test_plain_tensor_output_matches_stock(self, mode):
        ids, _ = prompt(batch=1)
        kw = dict(max_new_tokens=10, eos_token_id=_eos(ids, 6), do_sample=mode == "sample")
        with stock():
            ref, _, _ = run(ids, False, assistant="shared", **kw)
        on, _, _ = run(ids, True, assistant="shared", **kw)
        assert_same(self, ref, on, "flag on")

    @parameterized.expand([("greedy",), ("sample",)])
    @pytest.mark.core
    def test_user_cache_matches_stock(self, mode):
        """A DynamicCache the caller passes in (and keeps) holds what stock leaves in it."""
        ids, _ = prompt(batch=1)
        kw = dict(max_new_tokens=10, eos_token_id=_eos(ids, 5), do_sample=mode == "sample")
        with stock():
            ref_cache = DynamicCache()
            ref, _, _ = run(ids, False, assistant="shared", past_key_values=ref_cache, **kw)
        on_cache = DynamicCache()
        on, _, _ = run(ids, True, assistant="shared", past_key_values=on_cache, **kw)
        assert_same(self, ref, on, "flag on")
        assert_same(self, ref_cache, on_cache, "user cache")

    def test_a_second_seeded_call_continues_like_stock(self):
        """The RNG after a speculative-sampling call feeds the next call: two calls in a row match stock."""
        ids, _ = prompt(batch=1)
        kw = dict(max_new_tokens=9, eos_token_id=_eos(ids, 4), do_sample=True)

        def two_calls(flag):
            helper = draft("shared")
            helper.generation_config = draft_config("shared", schedule="heuristic", tokens=3)
            torch.manual_seed(11)
            extra = dict(async_stopping_criteria=True) if flag else {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StockPathWarning)
                first = target().generate(ids, assistant_model=helper, pad_token_id=PAD, **kw, **extra)
                second = target().generate(ids, assistant_model=helper, pad_token_id=PAD, **kw, **extra)
            return first, second, helper.generation_config.num_assistant_tokens

        with stock():
            ref = two_calls(False)
        on = two_calls(True)
        assert_same(self, ref, on, "two calls")

    @parameterized.expand([("batch_2",), ("cache_implementation_static",), ("user_static_cache",)])
    def test_unsupported_inputs_behave_like_stock(self, name):
        """Assisted decoding takes batch size 1. A batch of 2 raises on every release; a StaticCache object raises on
        4.57-5.23 and is taken on 5.24+ (whose static layers can be cropped); `cache_implementation="static"` raises
        on 5.17-5.23, while 4.57 and 5.0 swap in a DynamicCache and return it. With the flag, the same error, or the
        same outputs."""
        ids, _ = prompt(batch=2 if name == "batch_2" else 1)

        def outcome(flag):
            kw = dict(max_new_tokens=8, eos_token_id=NEVER)
            if name == "cache_implementation_static":
                kw["cache_implementation"] = "static"
            elif name == "user_static_cache":
                kw["past_key_values"] = StaticCache(config=target().config, max_cache_len=32)
            try:
                state, _, _ = run(ids, flag, assistant="shared", **kw, **FULL_OUTPUTS)
            except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
                return ("raised", type(exc), str(exc))
            return ("returned", state)

        with stock():
            ref = outcome(False)
        if name == "batch_2" or (name == "user_static_cache" and TRANSFORMERS_VERSION < (5, 24)):
            self.assertEqual(ref[0], "raised", "stock accepts this input now: update the test")
        elif name == "user_static_cache":
            self.assertEqual(ref[0], "returned", "5.24+ take a static cache in assisted decoding")
        assert_same(self, ref, outcome(True), "flag on")


class PromptLookupEqualsStock(unittest.TestCase):
    @parameterized.expand([(name,) for name in LOOKUP])
    @pytest.mark.core
    def test_outputs_match_stock(self, name):
        ids, kw, early = lookup_scenario(name)
        with stock():
            ref, _, ref_rounds = run(ids, False, **kw, **FULL_OUTPUTS)
        on, _, _ = run(ids, True, **kw, **FULL_OUTPUTS)
        assert_same(self, ref, on, "flag on")
        new_tokens = ref["output"].sequences.shape[1] - ids.shape[1]
        if early:
            self.assertLess(new_tokens, kw["max_new_tokens"], "the scenario was meant to stop on EOS")
        if name == "greedy":
            self.assertLess(ref_rounds, new_tokens, "the lookup prompt should have drafts accepted")


# --- the deferred path runs --------------------------------------------------------------------------------------
NO_WARNING = [
    "assisted:greedy_shared", "assisted:greedy_copy_eos_in_draft_first", "assisted:greedy_copy_heuristic",
    "assisted:greedy_copy_threshold_0.4", "assisted:greedy_copy_max_length_3",
    "assisted:sample_copy", "assisted:sample_shared_heuristic_transient",
    "lookup:greedy", "lookup:greedy_eos", "lookup:greedy_max_length_2", "lookup:sample",
    "lookup:greedy_repetition_penalty", "lookup:sample_top_k_min_p", "lookup:greedy_eos_min_new_tokens",
    "assisted:greedy_copy_max_time", "assisted:sample_copy_two_eos", "assisted:greedy_shared_eos_ends_prompt",
]


@unittest.skipUnless(PORTED, "this transformers release's assisted decoding loop was not ported: it runs stock")
class TakesTheDeferredPath(unittest.TestCase):
    """With the flag, assisted decoding and prompt lookup take the deferred path: no StockPathWarning."""

    @parameterized.expand([(case,) for case in NO_WARNING])
    def test_no_stock_path_warning(self, case):
        method, name = case.split(":")
        if method == "assisted":
            ids, kind, config, kw, _ = assisted_scenario(name)
            _, caught, _ = run(ids, True, assistant=kind, assistant_config=config, **kw, **FULL_OUTPUTS)
        else:
            ids, kw, _ = lookup_scenario(name)
            _, caught, _ = run(ids, True, **kw, **FULL_OUTPUTS)
        self.assertEqual(caught, [], "StockPathWarning raised with async_stopping_criteria=True")

    @pytest.mark.core
    def test_no_stock_path_warning_with_a_user_cache(self):
        ids, _ = prompt(batch=1)
        _, caught, _ = run(ids, True, assistant="shared", past_key_values=DynamicCache(), max_new_tokens=8,
                           eos_token_id=NEVER)
        self.assertEqual(caught, [])


class NeverStops(StoppingCriteria):
    """A user criterion: its verdict cannot ride in the round's one read (phase 1 keeps such calls stock)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _encoder_decoder():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=PAD,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
                        init_std=0.5, max_position_embeddings=64)
    return BartForConditionalGeneration(config).eval()


STOCK_CASES = ["user_criterion", "lookup_forbidding_processor", "unported_release", "encoder_decoder"]


class StaysStockWithOneWarning(unittest.TestCase):
    """What phase 1 leaves stock: exactly one StockPathWarning, and stock's output."""

    @parameterized.expand([(name,) for name in STOCK_CASES])
    def test_one_warning_and_stock_output(self, name):
        ids, _ = prompt(batch=1)
        model = target()
        kw = dict(max_new_tokens=8, eos_token_id=NEVER, pad_token_id=PAD, attention_mask=torch.ones_like(ids))
        words = "assisted decoding"
        if name == "user_criterion":
            kw.update(assistant_model=draft("shared"), stopping_criteria=StoppingCriteriaList([NeverStops()]))
        elif name == "lookup_forbidding_processor":
            ids = lookup_prompt()
            kw.update(prompt_lookup_num_tokens=3, no_repeat_ngram_size=4, attention_mask=torch.ones_like(ids))
            words = "NoRepeatNGramLogitsProcessor"
        elif name == "unported_release":
            kw.update(assistant_model=draft("shared"))
            words = "not one the deferred path was ported from"
        else:
            model = _encoder_decoder()
            kw.update(assistant_model=model, eos_token_id=None)
            words = "encoder-decoder"

        def call(flag):
            torch.manual_seed(3)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model.generate(ids, **kw, **({"async_stopping_criteria": True} if flag else {}))
            return out, [str(w.message) for w in caught if issubclass(w.category, StockPathWarning)]

        with stock():
            ref, _ = call(False)
        if name == "unported_release":
            from transformers_async_stop.loops.assisted import loop

            with mock.patch.object(loop, "installed_port", return_value=None):
                out, caught = call(True)
        else:
            out, caught = call(True)
        self.assertEqual(len(caught), 1, caught)
        self.assertIn(words if PORTED else "not one the deferred path was ported from", caught[0])
        assert_same(self, ref, out, "flag on")


# --- CUDA: syncs per verify round --------------------------------------------------------------------------------
CUDA = torch.cuda.is_available()


@unittest.skipUnless(CUDA, "needs a CUDA device")
class CudaAtMostOneSyncPerRound(unittest.TestCase):
    """Blocking syncs of an N-token call minus a short call, per verify round (the target's forwards) and per
    accepted token: at most one per round with the flag (the accepted length, EOS verdict and tokens come back in one
    pinned copy, and the draft loop reads nothing per token); stock makes several. Run with `-s` to see the counts:
    each case prints one line, `CUDA syncs ...`."""

    def measure(self, flag, method, sample):
        ids = (lookup_prompt() if method == "lookup" else prompt(batch=1)[0]).to("cuda")  # built on the CPU
        model = target().to("cuda")
        helper = draft("shared").to("cuda")
        helper.generation_config = draft_config("shared")
        kw = dict(pad_token_id=PAD, eos_token_id=NEVER, do_sample=sample)
        kw.update(prompt_lookup_num_tokens=3) if method == "lookup" else kw.update(assistant_model=helper)
        if flag:
            kw["async_stopping_criteria"] = True

        def call(n):
            counter = CountForwards(model)
            torch.manual_seed(0)
            syncs = count_syncs(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                       **kw))
            counter.close()
            return syncs, counter.count

        call(20)  # warm-up
        (long_syncs, long_rounds), (short_syncs, short_rounds) = call(20), call(2)
        self.assertGreater(long_rounds, short_rounds)
        extra = long_syncs - short_syncs
        return extra / (long_rounds - short_rounds), extra / (20 - 2), (long_syncs, long_rounds)

    @parameterized.expand([("assisted", False), ("assisted", True), ("lookup", False), ("lookup", True)])
    def test_at_most_one_sync_per_round(self, method, sample):
        import transformers

        try:
            with stock():
                stock_round, stock_token, stock_raw = self.measure(False, method, sample)
            flag_round, flag_token, flag_raw = self.measure(True, method, sample)
            mode = "sample" if sample else "greedy"
            print(f"\nCUDA syncs, transformers {transformers.__version__}, {method} {mode}: "
                  f"stock {stock_round:.2f}/round {stock_token:.2f}/token (20-token call: {stock_raw[0]} syncs, "
                  f"{stock_raw[1]} rounds); flag {flag_round:.2f}/round {flag_token:.2f}/token (20-token call: "
                  f"{flag_raw[0]} syncs, {flag_raw[1]} rounds)")
            self.assertGreater(stock_round, 1.0, "the counter sees stock's syncs")
            self.assertLessEqual(flag_round, 1.0)
        finally:
            target().to("cpu")
            draft("shared").to("cpu")


if __name__ == "__main__":
    unittest.main()
