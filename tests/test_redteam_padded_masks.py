"""Red team of commit 3a27b93 (padded batches graphed on the decode forward: a one-token SDPA step handed a padded 2D
mask is recorded with its masks made again at each replay by the modeling module's own mask functions,
`graphs/piecewise/mask_kind.py`, `masks.mask_call`). docs/red-team/2026-11-29-padded-masks.md has the report.

Every case runs on the CPU with the CUDA graphs emulated (`testing/emulation.py`) and the piecewise forward on, and
compares the flag-on call with unpatched transformers bit for bit (sequences, scores, logits, the returned cache, the
RNG state after the call); where the padded path is the point, `last_path().forward` must say graphed.

One case found a hole, fixed since: a Llama whose config carries `sliding_window`, in a padded batch (a shape error in
the dynamic loop's grown 4D mask, which assumed full-attention cache layers). The others held and are kept as
regression guards.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from family_models import build_family
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, pick_eos, prompt, stock
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate
from test_piecewise_sliding import _build as build_sliding

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)


def _model(name, dtype=torch.float32, device="cpu"):
    """qwen3 (full attention, no grown 4D mask: every padded step remade), llama (a grown 4D mask from step 2),
    gemma3 / mistral_slides / ministral (sliding-window layers, `test_piecewise_sliding.FAMILIES`)."""
    if name == "qwen3":
        return build_family("qwen3", dtype=dtype, device=device)
    if name == "llama":
        return build("llama", dtype=dtype, device=device)
    return build_sliding(name, dtype=dtype, device=device)


def _pattern(kind, batch=3):
    """Prompts of `models.prompt` with a padding pattern."""
    if kind == "left":
        return prompt(batch=batch, left_pad=True)
    ids, mask = prompt(batch=batch)
    if kind == "right":  # right padding (stock warns): the generated tokens follow zeros
        mask[1, -2:] = 0
        ids[1, -2:] = PAD
        mask[2, -1:] = 0
        ids[2, -1:] = PAD
    elif kind == "middle":  # zeros inside the prompt
        mask[0, 2:4] = 0
    elif kind == "one_token":  # rows holding a single real token
        mask[0, :-1] = 0
        ids[0, :-1] = PAD
        mask[2, :-1] = 0
        ids[2, :-1] = PAD
    elif kind == "full_row":  # a row with no real token at all in the prompt
        ids, mask = prompt(batch=batch, left_pad=True)
        mask[1] = 0
    else:
        raise ValueError(kind)
    return ids, mask


class _ZeroCriterion(StoppingCriteria):
    """Never stops; at its `at`-th call runs `action` (a mid-call change, as a user's criterion may make)."""

    def __init__(self, at, action):
        self.at, self.action, self.calls = at, action, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@unittest.skipUnless(RELEASES, "the piecewise forward's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class PaddedMasksRedTeam(unittest.TestCase):

    def setUp(self):
        self.enterContext(emulated())

    def _check(self, model, ids, mask, **kwargs):
        with stock():
            ref, ref_after = _generate(model, ids, mask, None, **kwargs)
        out, after = _generate(model, ids, mask, True, **kwargs)
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
        return ref, out

    def _stock_then_flag(self, model, ids, mask, call):
        """Stock's run, then the flag's, each with the kwargs `call()` makes (it resets what the call's criteria
        change mid-call, and makes them afresh); their outputs equal. [(output, RNG state after), ...]."""
        with stock():
            results = [_generate(model, ids, mask, None, **call())]
        results.append(_generate(model, ids, mask, True, **call()))
        assert_same(self, results[0][0], results[1][0])
        return results

    def _graphed(self):
        forward = tas.last_path().forward or ""
        self.assertTrue(forward.startswith("graphed"), forward)
        return forward

    # -- padding patterns ------------------------------------------------------------------------------------------

    @parameterized.expand([(f"{name}_{kind}", name, kind) for name in ("qwen3", "gemma3", "mistral_slides")
                           for kind in ("left", "right", "middle", "one_token", "full_row")])
    def test_padding_patterns_equal_stock(self, _, name, kind):
        model = _model(name)
        ids, mask = _pattern(kind)
        self._check(model, ids, mask, max_new_tokens=10, do_sample=kind in ("one_token", "middle"),
                    eos_token_id=None)
        self._graphed()

    @parameterized.expand([(name,) for name in ("mistral_slides", "gemma3", "ministral")])
    def test_window_slides_past_all_padding_equal_stock(self, name):
        # windows of 4-5 over a prompt of 6 with up to 5 pads: mid-call the window holds no padding any more, where
        # stock's `sdpa_mask` skips the sliding mask (None); each replay calls the same function
        model = _model(name)
        for kind in ("left", "one_token"):
            ids, mask = _pattern(kind)
            self._check(model, ids, mask, max_new_tokens=20, do_sample=True, eos_token_id=None)
        if name != "ministral":  # found by the automatic proof: its first recording may wait for a confirmation
            self._graphed()

    # -- recordings across calls: batch sizes, padded / unpadded, mask dtypes ---------------------------------------

    @parameterized.expand([("qwen3",), ("gemma3",)])
    def test_batch_sizes_and_padded_unpadded_alternation_equal_stock(self, name):
        model = _model(name)
        for batch, padded in ((3, True), (2, True), (3, False), (1, True), (3, True), (5, True), (2, False)):
            ids, mask = prompt(batch=batch, left_pad=padded)
            if padded and batch == 1:
                ids[0, :2], mask[0, :2] = PAD, 0
            self._check(model, ids, mask, max_new_tokens=8, do_sample=batch % 2 == 1, eos_token_id=None)
            self._graphed()

    def test_many_batch_sizes_past_the_recording_cap_equal_stock(self):
        model = _model("qwen3")
        for batch in (1, 2, 3, 4, 5, 6, 7, 3, 1):
            ids, mask = prompt(batch=batch, left_pad=True)
            mask[0, 0] = 0
            self._check(model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)

    @parameterized.expand([("bool", torch.bool), ("float", torch.float32), ("int32", torch.int32)])
    def test_mask_dtypes_after_a_long_mask_recording_equal_stock(self, _, dtype):
        model = _model("qwen3")
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self._check(model, ids, mask.to(dtype), max_new_tokens=8, do_sample=False, eos_token_id=None)
        self._graphed()

    # -- dtypes, modes, sampling -----------------------------------------------------------------------------------

    @parameterized.expand([("qwen3",), ("gemma3",), ("mistral_slides",)])
    def test_bf16_padded_sampling_equal_stock(self, name):
        model = _model(name, dtype=torch.bfloat16)
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=14, do_sample=True, eos_token_id=None)
        self._graphed()

    def test_inference_mode_padded_equal_stock(self):
        model = _model("gemma3")
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        with torch.inference_mode():
            self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self._graphed()
        self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)

    @parameterized.expand([("qwen3",), ("gemma3",)])
    def test_num_return_sequences_padded_sampling_equal_stock(self, name):
        model = _model(name)
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=10, do_sample=True, num_return_sequences=2, eos_token_id=None)
        self._graphed()

    def test_inputs_embeds_prompt_padded_equal_stock(self):
        model = _model("qwen3")
        ids, mask = prompt(left_pad=True)
        embeds = model.get_input_embeddings()(ids).detach()
        kwargs = dict(inputs_embeds=embeds, attention_mask=mask, pad_token_id=PAD, max_new_tokens=8, do_sample=False,
                      eos_token_id=None, return_dict_in_generate=True, output_logits=True, output_scores=True)
        with stock():
            torch.manual_seed(7)
            ref = model.generate(**kwargs)
        torch.manual_seed(7)
        out = model.generate(**kwargs, async_stopping_criteria=True)
        assert_same(self, ref, out)
        self._graphed()

    # -- stops mid-call, returned caches, second turns -------------------------------------------------------------

    @parameterized.expand([(name,) for name in ("qwen3", "gemma3", "mistral_slides", "llama")])
    def test_eos_mid_call_returned_cache_then_padded_second_turn_equal_stock(self, name):
        model = _model(name)
        ids, mask = prompt(left_pad=True)
        with stock():
            free, _ = _generate(model, ids, mask, None, max_new_tokens=12, do_sample=False, eos_token_id=None)
        eos = pick_eos(free.sequences[:, ids.shape[1]:].tolist(), [3, 5, 7])
        self.assertTrue(eos, "no EOS stops the rows mid-call")
        ref, out = self._check(model, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
        self.assertLess(out.sequences.shape[1], ids.shape[1] + 12, "the call did not stop mid-call")
        # the second turn: the first call's sequences (their pads), the first call's mask grown, two more tokens
        grown = torch.cat([mask, torch.ones(3, ref.sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=-1)
        ids2 = torch.cat([ref.sequences, ids[:, -2:]], dim=-1)
        mask2 = torch.cat([grown, torch.ones(3, 2, dtype=mask.dtype)], dim=-1)
        with stock():
            ref2, _ = _generate(model, ids2, mask2, None, max_new_tokens=8, do_sample=True, eos_token_id=None,
                                **{cache_kwarg.name(): cache_kwarg.of_output(ref)})
        out2, _ = _generate(model, ids2, mask2, True, max_new_tokens=8, do_sample=True, eos_token_id=None,
                            **{cache_kwarg.name(): cache_kwarg.of_output(out)})
        assert_same(self, ref2, out2)

    # -- mid-call and between-call changes -------------------------------------------------------------------------

    @parameterized.expand([("qwen3",), ("gemma3",)])
    def test_set_attn_implementation_mid_call_there_and_back_equal_stock(self, name):
        model = _model(name)
        ids, mask = prompt(left_pad=True)
        def call():
            model.set_attn_implementation("sdpa")
            criteria = StoppingCriteriaList([
                _ZeroCriterion(3, lambda: model.set_attn_implementation("eager")),
                _ZeroCriterion(7, lambda: model.set_attn_implementation("sdpa")),
            ])
            return dict(max_new_tokens=12, do_sample=False, eos_token_id=None, stopping_criteria=criteria)

        for _ in range(2):  # the second call replays what the first recorded, under both implementations
            results = self._stock_then_flag(model, ids, mask, call)
            self.assertTrue(torch.equal(results[0][1], results[1][1]))
        model.set_attn_implementation("sdpa")

    def test_sliding_window_changed_between_and_within_calls_equal_stock(self):
        model = _model("mistral_slides")
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
        model.config.sliding_window = 3  # the same ("remade", "sdpa") key: the recording must not serve
        self._check(model, ids, mask, max_new_tokens=14, do_sample=False, eos_token_id=None)
        for at in (2, 6):
            def call(at=at):
                model.config.sliding_window = 5
                narrow = _ZeroCriterion(at, lambda: setattr(model.config, "sliding_window", 3))
                return dict(max_new_tokens=14, do_sample=False, eos_token_id=None,
                            stopping_criteria=StoppingCriteriaList([narrow]))

            self._stock_then_flag(model, ids, mask, call)

    def test_a_user_sdpa_mask_function_keeps_the_padded_step_eager_and_equal(self):
        from transformers import masking_utils

        model = _model("qwen3")
        ids, mask = prompt(left_pad=True)
        self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)  # recorded
        original = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

        def never_skips(*args, **kwargs):  # another mask than stock's at the padded decode steps it would skip
            kwargs["allow_is_causal_skip"] = False
            return original(*args, **kwargs)

        masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", never_skips)
        try:
            self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
            self.assertFalse((tas.last_path().forward or "").startswith("graphed"), tas.last_path().forward)
        finally:
            masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", original)
        self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self._graphed()

    def test_a_decoder_layer_hook_sees_stocks_masks(self):
        model = _model("qwen3")
        ids, mask = prompt(left_pad=True)
        seen = []

        def hook(module, args, kwargs):
            value = kwargs.get("attention_mask")
            seen.append(None if value is None else (tuple(value.shape), value.clone()))

        handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with stock():
                torch.manual_seed(7)
                ref = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6, do_sample=False)
            stock_seen, seen[:] = list(seen), []
            torch.manual_seed(7)
            out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=6, do_sample=False,
                                 async_stopping_criteria=True)
        finally:
            handle.remove()
        self.assertTrue(torch.equal(ref, out))
        self.assertEqual(len(stock_seen), len(seen))
        for a, b in zip(stock_seen, seen):
            self.assertEqual(a is None, b is None)
            if a is not None:
                self.assertEqual(a[0], b[0])
                self.assertTrue(torch.equal(a[1], b[1]))

    # -- the first padded step of the families with a grown 4D mask -----------------------------------------------

    def test_llama_first_padded_step_takes_the_grown_mask_and_is_graphed(self):
        # the first decode step is handed stock's 4D mask as the later ones are (`DecodeInputs.build`): it replays
        # the same recording, where it used to stay eager ("a padded 2D mask")
        model = _model("llama")
        ids, mask = prompt(left_pad=True)
        for _ in range(2):
            self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
            forward = self._graphed()
            self.assertNotIn("a padded 2D mask", forward)
            self.assertNotIn("eager", forward)

    def test_llama_with_a_config_window_in_a_padded_batch_equals_stock_and_is_graphed(self):
        # found by this red team: a Llama whose config carries `sliding_window` gets a cache of sliding layers
        # (`DynamicCache(config=...)`), and the dynamic loop's grown 4D mask (`dynamic_loop/wide_mask.py`), which
        # covers every position, met keys cut to the window: "The size of tensor a (4) must match the size of tensor
        # b (8)" where stock returns. The grown mask is for full-attention layers only; such a model's padded steps
        # have their masks made at each replay by stock's functions, every step graphed
        model = _model("llama")
        model.config.sliding_window = 4
        ids, mask = prompt(left_pad=True)
        for _ in range(2):
            self._check(model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self.assertRegex(self._graphed(), r"^graphed \(\d+ pieces\): 7 decode steps$")

    # -- assisted decoding: the draft's one-token steps over a padded batch of one ------------------------------------

    def test_assisted_padded_batch_of_one_equal_stock(self):
        model, assistant = build_family("qwen3"), build_family("qwen3", seed=3)
        ids, mask = prompt(batch=1)
        ids[0, :2], mask[0, :2] = PAD, 0
        for _ in range(2):
            self._check(model, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                        assistant_model=assistant)
        self.assertIn("draft forward graphed", tas.last_path().describe())


@unittest.skipUnless(torch.cuda.is_available() and RELEASES, "CUDA and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class PaddedReplaysOnCuda(unittest.TestCase):
    """On CUDA: a padded batch's replays equal stock, and make no blocking sync per step (each replay's mask calls
    are stock's, whose skip check reads the loop's mask summary on the host, not the device)."""

    @parameterized.expand([("qwen3",), ("gemma3",), ("mistral_slides",)])
    def test_a_padded_batch_replays_without_a_sync_per_step_and_equals_stock(self, name):
        from test_cuda import syncs_per_step

        model = _model(name, dtype=torch.bfloat16, device="cuda")
        ids, mask = prompt(batch=3, left_pad=True, device="cuda")
        kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
        with stock():
            ref, ref_after = _generate(model, ids, mask, None, **kwargs)
        out, after = _generate(model, ids, mask, True, **kwargs)
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
        self.assertRegex(tas.last_path().forward or "", r"^graphed \(\d+ pieces\): 11 decode steps$")
        with stock():
            stock_syncs = syncs_per_step(model, ids, mask, eos_token_id=None)
        flag_syncs = syncs_per_step(model, ids, mask, eos_token_id=None, async_stopping_criteria=True)
        self.assertGreaterEqual(stock_syncs, 1.0)  # the counter sees stock's per-step read
        self.assertEqual(flag_syncs, 0.0)


if __name__ == "__main__":
    unittest.main()
