"""Assisted decoding's verify forward through the piecewise-graphed forward (`piecewise.forward_for(verify=True)`).

The target's forward of K = candidates + 1 tokens in the rounds after the first replays from recordings K tokens
wide; each replay makes stock's 4D mask with stock's own mask function (`graphs.Recording._masks`).

CPU: the reason the verify forward stays eager ("verify eager: not CUDA (cpu)"), every verify round's inputs taken
by the recording (refused on the CPU), the inputs that keep it eager (a mask of another length, a 4D mask,
`config.return_dict` off), the switch (`piecewise.VERIFY_ON`), the recording caps.

CUDA (skipped without it), and the CPU with the graphs emulated (`testing/emulation.py`): assisted decoding and
prompt lookup with the flag, the verify forward graphed, bit-exact against unpatched transformers (sequences, fp32
scores and logits, the returned cache, the RNG state after the call), for every family the path reads, greedy and
speculative sampling, the "constant" and "heuristic" schedules, a confidence threshold, a left-padded prompt, EOS
among the candidates; the mask each replay makes equal to stock's in values, dtype, shape and strides.
"""

from __future__ import annotations

import copy
import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise import forward, graphs, masks, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate
from test_piecewise_families import _build

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the releases of the package's dynamic-cache loop
CUDA = torch.cuda.is_available() and RELEASES
FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt2", "gemma3")


def _run(target, ids, mask, flag, **kwargs):
    return _generate(target, ids, mask, flag, **kwargs)


def _check_against_stock(test, target, ids, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    with stock():
        ref, ref_after = _run(target, ids, mask, None, **kwargs)
    out, after = _run(target, ids, mask, True, **kwargs)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


def _verify_inputs(model, cache, ids, mask=None):
    """A verify round's inputs as the assisted loop makes them (the cache already filled)."""
    past = cache.get_seq_length()
    width = ids.shape[1]
    inputs = {"input_ids": ids, "position_ids": torch.arange(past, past + width, device=ids.device)[None],
              cache_kwarg.name(): cache, "use_cache": True}
    inputs["attention_mask"] = torch.ones(1, past + width, dtype=torch.long, device=ids.device) if mask is None \
        else mask
    return inputs


def _crop(cache, length=6):
    cache.crop(length - cache.get_seq_length())  # relative: 5.24 refuses a positive length


def _filled_cache(model, length=6, device="cpu"):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(3, 3 + length, device=device)[None], use_cache=True, return_dict=True,
              **{cache_kwarg.name(): cache})
    return cache


class _GraphedVerifyCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"

    def models(self, family="llama", dtype=torch.float32):
        target = _build(family, device=self.DEVICE, dtype=dtype)
        return target, build("llama", seed=1, device=self.DEVICE, dtype=dtype)

    @parameterized.expand([
        (f"{family}_{dtype_name}_{'sample' if sample else 'greedy'}", family, dtype, sample)
        for family in FAMILIES
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for sample in (False, True)
    ])
    def test_assisted_decoding_with_a_graphed_verify_equals_stock(self, _, family, dtype, sample):
        target, helper = self.models(family, dtype)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24, do_sample=sample,
                             eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    @parameterized.expand([
        (f"{schedule}_{tokens}_{threshold}", schedule, tokens, threshold)
        for schedule, tokens in (("constant", 3), ("constant", 5), ("heuristic", 2), ("heuristic_transient", 4))
        for threshold in (0.0, 0.4)
    ])
    def test_each_candidate_schedule_equals_stock(self, _, schedule, tokens, threshold):
        target, helper = self.models()
        helper.generation_config.num_assistant_tokens_schedule = schedule
        helper.generation_config.num_assistant_tokens = tokens
        helper.generation_config.assistant_confidence_threshold = threshold
        ids = prompt(batch=1, device=self.DEVICE)[0]
        mask = torch.ones_like(ids)
        for sample in (False, True):
            # each run its own assistant: "heuristic" writes its final length into the assistant's config
            kwargs = dict(max_new_tokens=30, do_sample=sample, eos_token_id=None)
            with stock():
                ref, ref_after = _run(target, ids, mask, None, assistant_model=copy.deepcopy(helper), **kwargs)
            mine = copy.deepcopy(helper)
            out, after = _run(target, ids, mask, True, assistant_model=mine, **kwargs)
            assert_same(self, ref, out)
            self.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")

    @parameterized.expand([("greedy", False), ("sample", True)])
    def test_prompt_lookup_with_a_graphed_verify_equals_stock(self, _, sample):
        target, _helper = self.models()
        # a prompt that repeats: lookup finds candidates in some rounds and none (K=1) in others
        ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 7, 3, 4]], device=self.DEVICE)
        _check_against_stock(self, target, ids, prompt_lookup_num_tokens=3, max_new_tokens=30, do_sample=sample,
                             eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_a_left_padded_prompt_equals_stock(self):
        # the verify mask holds the padding: stock's mask function builds it at every round, and so does each replay
        target, helper = self.models()
        ids = prompt(batch=1, device=self.DEVICE)[0]
        mask = torch.ones_like(ids)
        ids[:, :2], mask[:, :2] = PAD, 0
        _check_against_stock(self, target, ids, mask, assistant_model=helper, max_new_tokens=24, do_sample=False,
                             eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_eos_among_the_candidates_and_a_clipped_last_round_equal_stock(self):
        target, helper = self.models()
        ids = prompt(batch=1, device=self.DEVICE)[0]
        for eos in range(3, 12):
            for length in (13, 24):
                _check_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=length,
                                     do_sample=False, eos_token_id=eos)

    def test_a_draft_sharing_the_targets_weights_equals_stock(self):
        target, _helper = self.models()
        ids = prompt(batch=1, device=self.DEVICE)[0]
        _check_against_stock(self, target, ids, assistant_model=copy.copy(target), max_new_tokens=24,
                             do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_the_returned_fp32_scores_are_the_callers_own(self):
        # fp32: stock's `new_logits` is the forward's logits tensor itself, written into by the processors and
        # returned as scores; a replay's logits buffer is the next round's, so the verify forward hands out a copy
        target, helper = self.models()
        ids = prompt(batch=1, device=self.DEVICE)[0]
        out = _check_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, repetition_penalty=1.3)
        pointers = {score.untyped_storage().data_ptr() for score in out.scores}
        self.assertGreater(len(pointers), 1)

    def test_a_repeated_call_reuses_its_recordings(self):
        # the first call records the widths it sees twice, the second the rest (each seen once before): a third
        # makes none
        target, helper = self.models()
        ids = prompt(batch=1, device=self.DEVICE)[0]
        for _ in range(2):
            _check_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24, do_sample=False,
                                 eos_token_id=None)
        recordings = dict(forward.graphs_of(target).recordings)
        self.assertTrue(any(key[1] > 1 for key in recordings), list(recordings))
        _check_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24, do_sample=False,
                             eos_token_id=None)
        self.assertEqual(dict(forward.graphs_of(target).recordings), recordings)

    def test_a_width_is_recorded_at_its_second_sighting(self):
        target, _helper = self.models()
        ids = torch.tensor([[5, 6, 7]], device=self.DEVICE)
        cache = _filled_cache(target, device=self.DEVICE)
        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        with torch.no_grad():
            call(**_verify_inputs(target, cache, ids))
            self.assertEqual([key[1] for key in forward.graphs_of(target).recordings], [])
            self.assertEqual(call.last_eager, "width 3 seen once")
            _crop(cache)
            call(**_verify_inputs(target, cache, ids))
        self.assertEqual([key[1] for key in forward.graphs_of(target).recordings], [3])

    def test_the_wide_recordings_are_capped_and_the_least_replayed_goes_first(self):
        target, _helper = self.models()
        cache = _filled_cache(target, device=self.DEVICE)
        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        widths = range(2, forward.MAX_WIDE + 3)
        with torch.no_grad():
            for width in widths:
                # width 2 replayed most: it stays (its count halved by the eviction, as every other's); 3 is the
                # least replayed of the rest and the oldest
                for _ in range(2 + (3 if width == 2 else 1 if width > 3 else 0)):
                    call(**_verify_inputs(target, cache, torch.full((1, width), 5, device=self.DEVICE)))
                    _crop(cache)
        kept = sorted(key[1] for key in forward.graphs_of(target).recordings)
        self.assertEqual(len(kept), forward.MAX_WIDE)
        self.assertIn(2, kept)
        self.assertNotIn(3, kept)

    def test_the_failed_recordings_remembered_are_capped(self):
        # one width recorded, then every other refused by the recording: each is remembered (not tried again), at
        # most the caps' sum of them
        def refused(*args, **kwargs):
            raise graphs.NotRecordable("refused by the test")

        target, _helper = self.models()
        cache = _filled_cache(target, device=self.DEVICE)
        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        with torch.no_grad():
            for _ in range(2):
                call(**_verify_inputs(target, cache, torch.full((1, 2), 5, device=self.DEVICE)))
                _crop(cache)
            self.assertEqual(call.replayed, 1)
            with mock.patch.object(forward, "record", refused):
                for width in range(3, 30):
                    for _ in range(2):
                        call(**_verify_inputs(target, cache, torch.full((1, width), 5, device=self.DEVICE)))
                        _crop(cache)
                    self.assertEqual(call.last_eager, "not recordable: refused by the test")
        failed = forward.graphs_of(target).failed
        self.assertEqual(len(failed), forward.MAX_KEYS + forward.MAX_WIDE)
        self.assertEqual(max(key[1] for key in failed), 29)

    def test_each_replay_hands_the_attention_stocks_mask(self):
        from transformers.models.llama import modeling_llama

        target, _helper = self.models()
        cache = _filled_cache(target, device=self.DEVICE)
        ids = torch.tensor([[5, 6, 7, 8]], device=self.DEVICE)
        mask = torch.ones(1, 10, dtype=torch.long, device=self.DEVICE)
        mask[:, :2] = 0
        made = []
        real = masks.mask_call

        def spy(*args, **kwargs):
            made.append(real(*args, **kwargs))
            return made[-1]

        call = forward.PiecewiseForward(target, target.__call__, None, role="verify")
        with torch.no_grad(), mock.patch.object(masks, "mask_call", spy):
            for _ in range(3):  # seen once, recorded, replayed
                inputs = _verify_inputs(target, cache, ids, mask)
                expected = modeling_llama.create_causal_mask(
                    config=target.config, inputs_embeds=target.get_input_embeddings()(ids), attention_mask=mask,
                    **{cache_kwarg.name(): cache}, position_ids=inputs["position_ids"])
                before = len(made)
                eager_cache = copy.deepcopy(cache)
                eager = target(**{**inputs, cache_kwarg.name(): eager_cache})
                out = call(**inputs)
                self.assertTrue(torch.equal(out.logits, eager.logits))
                assert_same(self, eager_cache, cache)
                _crop(cache)
        self.assertEqual(call.replayed, 2)
        self.assertEqual(len(made), before + 1)  # the last round's replay made its mask through stock's function
        self.assertTrue(torch.equal(made[-1], expected))
        self.assertEqual((made[-1].dtype, made[-1].shape, made[-1].stride()),
                         (expected.dtype, expected.shape, expected.stride()))


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class VerifyOnCuda(_GraphedVerifyCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class VerifyEmulatedOnCpu(_GraphedVerifyCases, unittest.TestCase):
    """The same cases on the CPU, the graphs emulated (recorded ATen ops replayed without Python)."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class VerifyOnTheCpu(unittest.TestCase):
    def setUp(self):
        self.target, self.helper = build("llama", seed=0), build("llama", seed=1)
        self.ids = prompt(batch=1)[0]

    def test_the_cpu_keeps_the_eager_verify_forward_and_says_why(self):
        _check_against_stock(self, self.target, self.ids, assistant_model=self.helper, max_new_tokens=10,
                             do_sample=False)
        self.assertEqual(tas.last_path().verify, "eager: not CUDA (cpu)")
        self.assertIn("verify forward eager: not CUDA (cpu)", tas.last_path().describe())

    def test_every_verify_round_is_taken_by_the_recording(self):
        # the model admitted on the CPU and the recording refused: each round after the first gets as far as the
        # recording (its inputs, mask and cache taken), then runs eagerly with the cache as it was
        verdicts = []
        step = forward.PiecewiseForward._step

        def noted(self, inputs):
            made = step(self, inputs)
            if self.role == "verify":
                verdicts.append(made[2])
            return made

        def refused(*args, **kwargs):
            raise graphs.NotRecordable("refused by the test")

        for lookup in (False, True):
            verdicts.clear()
            kwargs = dict(prompt_lookup_num_tokens=3) if lookup else dict(assistant_model=self.helper)
            with mock.patch.object(forward.PiecewiseForward, "_step", noted), \
                    mock.patch.object(forward, "record", refused), \
                    mock.patch.object(forward.ModelGraphs, "sighting", lambda self, key: 2), \
                    mock.patch.object(piecewise, "why_not_model", lambda model, model_forward: None), \
                    mock.patch.object(forward.proof, "why_not_model", lambda model, model_forward: None):
                _check_against_stock(self, self.target, self.ids, max_new_tokens=20, do_sample=False,
                                     eos_token_id=None, **kwargs)
            self.assertEqual(tas.last_path().verify, "eager: not recordable: refused by the test")
            self.assertTrue(verdicts)
            self.assertEqual(set(verdicts), {None})

    def _step(self, config_return_dict=True, **changes):
        self.target.config.return_dict = True
        cache = _filled_cache(self.target)
        self.target.config.return_dict = config_return_dict
        inputs = {**_verify_inputs(self.target, cache, torch.tensor([[5, 6, 7]])), **changes}
        with torch.no_grad():
            return forward.PiecewiseForward(self.target, self.target.__call__, None, role="verify")._step(inputs)[2]

    def test_a_verify_round_with_a_mask_of_another_length_stays_eager(self):
        self.assertIsNone(self._step())
        self.assertIsNone(self._step(attention_mask=None))
        self.assertEqual(self._step(attention_mask=torch.ones(1, 8, dtype=torch.long)),
                         "a 2D mask whose length is not the cache's + the step's tokens")
        self.assertEqual(self._step(attention_mask=torch.ones(1, 1, 3, 9, dtype=torch.bool)),
                         "a mask the recording does not take")

    def test_a_verify_round_with_config_return_dict_off_stays_eager(self):
        self.assertEqual(self._step(config_return_dict=False), "config.return_dict is off")
        self.assertIsNone(self._step(config_return_dict=False, return_dict=True))

    def test_a_verify_batch_other_than_1_stays_eager(self):
        self.assertEqual(self._step(input_ids=torch.ones(2, 3, dtype=torch.long),
                                    position_ids=torch.ones(2, 3, dtype=torch.long)),
                         "a verify batch other than 1")

    def test_the_decode_role_takes_one_token_only(self):
        cache = _filled_cache(self.target)
        inputs = _verify_inputs(self.target, cache, torch.tensor([[5, 6, 7]]))
        with torch.no_grad():
            why = forward.PiecewiseForward(self.target, self.target.__call__, None)._step(inputs)[2]
        self.assertEqual(why, "not a one-token decode step")

    def test_an_unknown_role_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "role='target'.*decode"):
            forward.PiecewiseForward(self.target, self.target.__call__, None, role="target")

    def test_the_verify_switch_off_keeps_the_eager_verify_forward(self):
        config = mock.Mock(is_assistant=False)
        with mock.patch.object(piecewise, "why_not_model", lambda model, model_forward: None):
            made = piecewise.forward_for(self.target, self.target.__call__, config, verify=True)
            self.assertIsInstance(made, forward.PiecewiseForward)
            self.assertEqual(made.role, "verify")
            with mock.patch.object(piecewise, "VERIFY_ON", False):
                self.assertIsNone(piecewise.forward_for(self.target, self.target.__call__, config, verify=True))
