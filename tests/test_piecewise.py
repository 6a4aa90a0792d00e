"""The dynamic-cache loop's decode forward replayed from CUDA graphs piece by piece (`piecewise/`).

CPU: which models and calls step aside, and the reason `last_path().forward` gives (device_map across devices, tensor
parallelism, a process group, hooks, quantized or offloaded weights, sliding windows, rope types with per-length
state, other attention implementations, unproven families, the environment switch); the host-side mask decisions;
the staleness fingerprint; the per-model store freed with the model.

CUDA (skipped without it): bit-exact against unpatched transformers for Llama, Mistral, Qwen2 and Qwen3 tiny models,
fp32 and bf16, batch 1 and a left-padded batch, greedy and sampling (sequences, scores, logits, the returned cache,
contiguous, and the RNG state after the call); a returned cache used again; graphs reused by a second call; staleness
(weights moved, a batch size, a hook, the attention implementation, weights replaced mid-call) recaptures or steps
aside, equal to stock.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import tempfile
import unittest
import weakref
from unittest import mock

import torch
from parameterized import parameterized
from transformers import Qwen3Config, Qwen3ForCausalLM, StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from family_models import build_family
from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, build, prompt, stock
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.sync_free import masking
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise import forward, proof, steps
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases
CUDA = torch.cuda.is_available() and RELEASES


def build_any(family: str, device="cpu", dtype=torch.float32, **overrides):
    if family != "qwen3":
        return build(family, device=device, dtype=dtype, **overrides)
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=128, vocab_size=VOCAB,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def on_the_cpu(family="llama"):
    """What a proven model on the CPU is refused for: the device on the releases whose sources were read; before them
    (4.57, 5.0) the unread sources, which are checked before the device."""
    if RELEASES:
        return "not CUDA (cpu)"
    return f"transformers' {family} sources are not the ones read"


def why(model, model_forward=None):
    with torch.no_grad():
        return proof.why_not_model(model, model_forward or model.__call__)


@mock.patch.dict(os.environ, ON)
class StepsAside(unittest.TestCase):
    """On the CPU every reason but the device's is told, so each case here is one the path refuses."""

    @parameterized.expand([("llama",), ("mistral",), ("qwen2",), ("qwen3",)])
    def test_a_proven_family_on_the_cpu_is_refused_only_for_the_device(self, family):
        self.assertEqual(why(build_any(family)), on_the_cpu(family))

    def test_the_environment_switch_turns_it_off(self):
        with mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "0"}):
            self.assertEqual(why(build("llama")), f"{proof.PIECEWISE_ENV}=0")

    def test_a_causal_lm_class_outside_transformers_steps_aside(self):
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        # a family no one read (GPT-NeoX: found, proven per recording; OPT, which this test used, is read by hand on
        # 5.18+) is found only among transformers' own classes
        class UserNeoX(GPTNeoXForCausalLM):
            pass

        config = GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               vocab_size=VOCAB, max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        self.assertEqual(why(UserNeoX(config).eval()),
                         "model family UserNeoX not proven (not a transformers causal LM class)")

    def test_eager_attention_is_refused_only_for_the_device(self):
        # each replay calls the module's `eager_attention_forward` (`piecewise/proof/attention.py`)
        self.assertEqual(why(build("llama", attn="eager")), on_the_cpu())

    @unittest.skipUnless(RELEASES, "the sliding layers' sources are read on 5.17-5.24")
    def test_a_sliding_window_takes_the_path(self):
        # its masks are answered on the host per layer (issue 36, tests/test_piecewise_sliding.py)
        self.assertEqual(why(build("mistral", sliding_window=4)), "not CUDA (cpu)")

    def test_a_rope_type_with_per_length_state_steps_aside(self):
        model = build("llama")
        model.model.rotary_emb.rope_type = "dynamic"
        self.assertIn("per-length state", why(model))

    def test_a_hook_steps_aside(self):
        model = build("llama")
        model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
        self.assertEqual(why(model), "a hook on LlamaMLP")

    def test_a_global_hook_steps_aside(self):
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
        try:
            self.assertEqual(why(build("llama")), "a global module hook")
        finally:
            handle.remove()

    def test_a_wrapped_forward_steps_aside(self):
        model = build("llama")
        model.model.norm.forward = model.model.norm.forward
        self.assertEqual(why(model), "a wrapped forward on LlamaRMSNorm")

    def test_a_compiled_forward_steps_aside(self):
        model = build("llama")
        self.assertEqual(why(model, lambda **kwargs: None), "a compiled forward")

    def test_a_device_map_across_devices_steps_aside(self):
        model = build("llama")
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
        self.assertEqual(why(model), "device_map across devices")

    def test_tensor_parallelism_steps_aside(self):
        model = build("llama")
        model._tp_size = 2  # what `from_pretrained(tp_plan=...)` sets
        self.assertEqual(why(model), "tensor parallelism")

    def test_a_process_group_steps_aside(self):
        import torch.distributed as dist

        with tempfile.TemporaryDirectory() as tmp:
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
            try:
                self.assertEqual(why(build("llama")), "a process group (distributed)")
            finally:
                dist.destroy_process_group()
        self.assertEqual(why(build("llama")), on_the_cpu())

    def test_quantized_weights_step_aside(self):
        model = build("llama")
        model.hf_quantizer = object()
        self.assertEqual(why(model), "quantized weights")

    def test_offloaded_weights_step_aside(self):
        model = build("llama")
        model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.empty(32, 16, device="meta"))
        self.assertEqual(why(model), "offloaded (meta) weights")

    def test_training_mode_steps_aside(self):
        self.assertEqual(why(build("llama").train()), "training mode")

    def test_gradients_enabled_step_aside(self):
        self.assertEqual(_why_with_grad(build("llama")), "gradients enabled")

    def test_a_class_forward_replaced_steps_aside(self):
        import transformers.models.llama.modeling_llama as modeling

        model = build("llama")
        self.assertEqual(why(model), on_the_cpu())  # the classes' methods as first seen
        original = modeling.LlamaMLP.forward
        modeling.LlamaMLP.forward = functools.wraps(original)(lambda self, x: original(self, x))
        try:
            # a `functools.wraps` wrapper has the original's source: the digests alone would take it
            self.assertEqual(why(model), "LlamaMLP.forward was replaced")
        finally:
            modeling.LlamaMLP.forward = original
        self.assertEqual(why(model), on_the_cpu())

    def test_a_module_function_rebound_steps_aside(self):
        import transformers.models.llama.modeling_llama as modeling

        model = build("llama")
        self.assertEqual(why(model), on_the_cpu())
        original = modeling.apply_rotary_pos_emb
        modeling.apply_rotary_pos_emb = functools.wraps(original)(lambda *args, **kwargs: original(*args, **kwargs))
        try:
            self.assertEqual(why(model), f"{modeling.__name__}.apply_rotary_pos_emb was replaced")
        finally:
            modeling.apply_rotary_pos_emb = original

    def test_a_class_forward_replaced_mid_call_is_seen_before_the_next_replay(self):
        import transformers.models.llama.modeling_llama as modeling

        model = build("llama")
        why(model)
        call = forward.PiecewiseForward(model, model.__call__, None)
        self.assertIsNone(call.watching.why_eager())
        original = modeling.LlamaForCausalLM.forward
        modeling.LlamaForCausalLM.forward = functools.wraps(original)(lambda *args, **kwargs: original(*args, **kwargs))
        try:
            self.assertEqual(call.watching.why_eager(), "LlamaForCausalLM.forward was replaced")
        finally:
            modeling.LlamaForCausalLM.forward = original
        self.assertIsNone(call.watching.why_eager())

    def test_a_hook_added_mid_call_is_seen_before_the_next_replay(self):
        model = build("llama")
        call = forward.PiecewiseForward(model, model.__call__, None)
        handle = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda *args: None)
        try:
            self.assertEqual(call.watching.why_eager(), "a hook was added")
        finally:
            handle.remove()
        self.assertIsNone(call.watching.why_eager())

    def test_an_unread_release_steps_aside(self):
        with _matches(lambda name: False):
            self.assertEqual(why(build("llama")), "transformers' llama sources are not the ones read")

    def test_a_family_found_on_a_release_whose_shared_sources_are_unread_steps_aside(self):
        from family_models import build_family

        matches = proof.admission.matches
        with _matches(lambda name: name != "piecewise shared sources" and matches(name)):
            self.assertEqual(why(build_family("olmo")),
                             "transformers' shared sources (masks, cache updates) are not the ones read")

    @unittest.skipUnless(RELEASES, "the shared sources are read on 5.17-5.24")
    def test_a_read_familys_sources_drifted_alone_are_proven_per_recording(self):
        # a newer release that changed only Llama's own sources: found and proven per recording (proof/verdict.py)
        matches = proof.admission.matches
        with _matches(lambda name: name != "piecewise forward (llama)" and matches(name)):
            model = build("llama")
            self.assertEqual(why(model), "not CUDA (cpu)")
            self.assertTrue(proof.family_of(model).auto)


@contextlib.contextmanager
def _matches(answer):
    """`verified.matches` answered by `answer` where the proof's first stage asks it (the family, the admission)."""
    with mock.patch.object(proof.family, "matches", answer), mock.patch.object(proof.admission, "matches", answer):
        yield


def _why_with_grad(model):
    with torch.enable_grad():
        return proof.why_not_model(model, model.__call__)


@unittest.skipUnless(RELEASES, "the dynamic-cache loop runs on transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class ReportedOnTheCpu(unittest.TestCase):
    def test_the_cpu_keeps_the_eager_forward_and_says_why(self):
        model = build("llama")
        ids, mask = prompt(batch=2, left_pad=True)
        kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD)
        with stock():
            ref = model.generate(ids, attention_mask=mask, **kwargs)
        out = model.generate(ids, attention_mask=mask, async_stopping_criteria=True, **kwargs)
        self.assertTrue(torch.equal(ref, out))
        self.assertEqual(tas.last_path().describe(), "deferred, dynamic loop, forward eager: not CUDA (cpu)")
        self.assertEqual(tas.last_path().forward, "eager: not CUDA (cpu)")

    def test_off_by_default_says_how_to_turn_it_on(self):
        with mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: ""}), \
                mock.patch.object(proof.admission, "DEFAULT_ON", False):
            self.assertIn("=1 turns it on", why(build("llama")))

    def test_an_assistant_on_the_cpu_keeps_its_eager_forward(self):
        # the draft's own decision and report: tests/test_piecewise_draft.py
        model = build("llama")
        config = mock.Mock(is_assistant=True)
        self.assertIsNone(piecewise.forward_for(model, model.__call__, config))


class MaskDecisions(unittest.TestCase):
    """What stock's `create_causal_mask` hands the attention, decided on the host (`steps.attention_mask`)."""

    def setUp(self):
        from transformers import DynamicCache

        model = build("llama")
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.ones(2, 4, dtype=torch.long), use_cache=True, **{_cache_name(): self.cache})

    def test_no_mask_gives_none(self):
        self.assertEqual(steps.attention_mask(None, 2, self.cache), (None, None))

    def test_the_grown_4d_mask_is_handed_on_as_it_is(self):
        mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
        self.assertIs(steps.attention_mask(mask, 2, self.cache)[0], mask)

    def test_a_4d_mask_of_another_length_is_left_to_the_model(self):
        self.assertIsNotNone(steps.attention_mask(torch.ones(2, 1, 1, 4, dtype=torch.bool), 2, self.cache)[1])

    def test_an_untagged_2d_mask_is_left_to_the_model(self):
        self.assertIsNotNone(steps.attention_mask(torch.ones(2, 5, dtype=torch.long), 2, self.cache)[1])

    def test_a_tagged_2d_mask_without_padding_gives_none(self):
        mask = torch.ones(2, 5, dtype=torch.long)
        masking._tag(mask, masking.MaskSummary(mask[:, :4]), 5)
        self.assertEqual(steps.attention_mask(mask, 2, self.cache), (None, None))

    def test_a_tagged_padded_2d_mask_is_left_to_the_model(self):
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[0, 0] = 0
        masking._tag(mask, masking.MaskSummary(mask[:, :4]), 5)
        self.assertIn("padded", steps.attention_mask(mask, 2, self.cache)[1])


class Staleness(unittest.TestCase):
    """The fingerprint a replay is checked against (`forward.ModelGraphs.changed`)."""

    def setUp(self):
        self.model = build("llama")
        self.graphs = forward.ModelGraphs()
        proof.hand_over(self.graphs, self.model)

    def test_an_unchanged_model_is_not_stale(self):
        self.assertFalse(self.graphs.changed())

    def test_an_in_place_weight_edit_is_not_stale(self):
        with torch.no_grad():
            self.model.lm_head.weight.add_(1)  # the graphs read the same memory: a replay sees the new values
        self.assertFalse(self.graphs.changed())

    def test_moved_weights_are_stale(self):
        self.model.model.layers[0].mlp.up_proj.weight.data = self.model.model.layers[0].mlp.up_proj.weight.data.clone()
        self.assertTrue(self.graphs.changed())

    def test_a_replaced_parameter_is_stale(self):
        self.model.model.norm.weight = torch.nn.Parameter(self.model.model.norm.weight.detach().clone())
        self.assertTrue(self.graphs.changed())

    def test_a_replaced_module_is_stale(self):
        self.model.model.layers[1].mlp = type(self.model.model.layers[1].mlp)(self.model.config)
        self.assertTrue(self.graphs.changed())

    def test_a_dtype_change_is_stale(self):
        self.model.to(torch.float64)
        self.assertTrue(self.graphs.changed())


class AttentionSwap(unittest.TestCase):
    """The recording's registry swap (`graphs._swapped_attention`): other callers pass through, nothing survives."""

    def test_the_registry_is_restored_after_an_error_and_other_callers_pass_through(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from transformers_async_stop.graphs.piecewise import graphs

        model = build("llama")
        ids = torch.tensor([[3, 4, 5]])
        before = ALL_ATTENTION_FUNCTIONS["sdpa"]
        had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
        with torch.no_grad():
            ref = model(ids).logits
            with self.assertRaises(KeyboardInterrupt), graphs._swapped_attention("sdpa"):
                self.assertIsNot(ALL_ATTENTION_FUNCTIONS["sdpa"], before)
                self.assertTrue(torch.equal(model(ids).logits, ref))  # no recording under way: the original runs
                raise KeyboardInterrupt
        self.assertIs(ALL_ATTENTION_FUNCTIONS["sdpa"], before)
        self.assertEqual("sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping, had_local)


class CacheUpdateCall(unittest.TestCase):
    """The recording takes the model's own `cache.update` call (5.24 adds `kwargs=` the layer ignores), and no other
    argument (`graphs._plain_update`)."""

    @unittest.skipIf(TRANSFORMERS_VERSION < (5, 17), "the piecewise forward runs on 5.17+; older layers pass "
                     "cache_kwargs (sin, cos, cache_position) to update, which it refuses")
    def test_the_models_own_update_call_is_taken(self):
        from transformers import DynamicCache

        from transformers_async_stop.graphs.piecewise import graphs

        for family in ("llama", "mistral", "qwen2", "qwen3"):
            model = build_any(family)
            cache = DynamicCache(config=model.config)
            calls = []
            update = cache.update
            cache.update = lambda *args, **kwargs: calls.append((args[3:], kwargs)) or update(*args, **kwargs)
            with torch.no_grad():
                model(torch.tensor([[3, 4, 5]]), use_cache=True, **{_cache_name(): cache})
            self.assertEqual(len(calls), model.config.num_hidden_layers)
            for extra, kwargs in calls:
                self.assertTrue(graphs._plain_update(extra, kwargs), (family, extra, kwargs))

    def test_other_update_arguments_are_refused(self):
        from transformers_async_stop.graphs.piecewise import graphs

        self.assertFalse(graphs._plain_update((), {"cache_kwargs": {"sin": 1}}))
        self.assertFalse(graphs._plain_update(({},), {}))
        self.assertFalse(graphs._plain_update((), {"kwargs": {}, "other": 1}))
        self.assertFalse(graphs._plain_update((), {"kwargs": None}))


def _cache_name():
    return cache_kwarg.name()  # `past_key_values` up to 5.23, `cache` from 5.24


class Store(unittest.TestCase):
    def test_a_models_recordings_are_freed_with_it(self):
        model = build("llama")
        graphs = weakref.ref(forward.graphs_of(model))
        self.assertIs(forward.graphs_of(model), graphs())
        del model
        gc.collect()
        self.assertIsNone(graphs())


# --- CUDA -------------------------------------------------------------------------------------------------------
def _generate(model, ids, mask, flag, seed=7, **kwargs):
    torch.manual_seed(seed)
    extra = {} if flag is None else {"async_stopping_criteria": flag}
    out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, **extra, **kwargs)
    return out, torch.rand(4, device=ids.device)


def _check_against_stock(test, model, ids, mask, **kwargs):
    with stock():
        ref, ref_after = _generate(model, ids, mask, None, **kwargs)
    out, after = _generate(model, ids, mask, True, **kwargs)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    for layer in cache_kwarg.of_output(out).layers:
        test.assertTrue(layer.keys.is_contiguous() and layer.values.is_contiguous())
    return out


class _GraphedForwardCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated (`testing/emulation.py`)."""

    DEVICE = "cuda"

    @parameterized.expand([
        (f"{family}_{dtype_name}_{'padded' if padded else 'b1'}_{'sample' if sample else 'greedy'}",
         family, dtype, padded, sample)
        for family in ("llama", "mistral", "qwen2", "qwen3")
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        for padded in (False, True)
        for sample in (False, True)
    ])
    def test_the_graphed_forward_equals_stock(self, _, family, dtype, padded, sample):
        model = build_any(family, device=self.DEVICE, dtype=dtype)
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=12, do_sample=sample, eos_token_id=None)
        # Qwen3 padded: the loop grows no 4D mask for it (`dynamic_loop/wide_mask.py`), and each replay makes the
        # mask from the padded 2D one with stock's functions; Llama, Mistral and Qwen2 padded: the grown 4D mask from
        # the first decode step on. Every step graphed either way
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        if padded:
            self.assertIn("11 decode steps", tas.last_path().forward)
            self.assertNotIn("eager", tas.last_path().forward)

    def test_a_returned_cache_used_again_equals_stock(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
        with stock():
            first = model.generate(ids, attention_mask=mask, pad_token_id=PAD, return_dict_in_generate=True, **kwargs)
            ids2 = torch.cat([first.sequences, ids[:, :2]], dim=-1)
            ref = model.generate(ids2, attention_mask=torch.ones_like(ids2),
                                 **{_cache_name(): cache_kwarg.of_output(first)},
                                 pad_token_id=PAD, return_dict_in_generate=True, **kwargs)
        on1 = model.generate(ids, attention_mask=mask, pad_token_id=PAD, return_dict_in_generate=True,
                             async_stopping_criteria=True, **kwargs)
        on = model.generate(ids2, attention_mask=torch.ones_like(ids2), **{_cache_name(): cache_kwarg.of_output(on1)},
                            pad_token_id=PAD, return_dict_in_generate=True, async_stopping_criteria=True, **kwargs)
        assert_same(self, ref, on)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    @parameterized.expand([("llama",), ("qwen2",), ("phi",)])
    def test_calls_inside_and_outside_inference_mode_alternate(self, family):
        # a recording made under inference mode holds inference tensors; a later call outside it raised "Inplace
        # update to inference tensor outside InferenceMode" at the replay (CUDA usage fuzzer, seeds 422, 775, 1447,
        # 1899): each mode now records its own graphs. Qwen2 (read by hand) and Phi (found) have biased projections:
        # a recording must run the kernels eager runs under inference mode too (a linear with a bias)
        model = build_family(family, device=self.DEVICE) if family == "phi" else build_any(family, device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        for inference in (True, False, True):
            with torch.inference_mode() if inference else torch.no_grad():
                _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
            self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        self.assertEqual(len(forward.graphs_of(model).recordings), 2)

    def test_a_second_call_reuses_the_graphs(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        recordings = dict(forward.graphs_of(model).recordings)
        self.assertEqual(len(recordings), 1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        self.assertEqual(dict(forward.graphs_of(model).recordings), recordings)

    def test_moved_weights_are_recaptured(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        before = list(forward.graphs_of(model).recordings.values())
        model.to(torch.bfloat16)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        after = list(forward.graphs_of(model).recordings.values())
        self.assertEqual(len(after), 1)
        self.assertIsNot(after[0], before[0])

    def test_a_new_batch_size_records_its_own_graphs(self):
        model = build("llama", device=self.DEVICE)
        for batch in (1, 2, 1):
            ids, mask = prompt(batch=batch, device=self.DEVICE)
            _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=True, eos_token_id=None)
        self.assertEqual(len(forward.graphs_of(model).recordings), 2)

    def test_a_hook_added_between_calls_keeps_the_eager_forward(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        handle = model.model.layers[0].register_forward_hook(lambda *args: None)
        try:
            _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
            self.assertEqual(tas.last_path().forward, "eager: a hook on LlamaDecoderLayer")
        finally:
            handle.remove()

    def test_another_attention_implementation_set_between_calls_records_under_it(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        model.set_attn_implementation("eager")
        _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    def test_weights_moved_mid_call_are_recaptured(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_with_fresh_criterion(self, model, ids, mask, lambda: _MoveWeightsAt(model, ids.shape[1] + 3))
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        self.assertEqual(len(forward.graphs_of(model).recordings), 1)

    def test_a_hook_added_mid_call_sends_the_rest_eager(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        _check_with_fresh_criterion(self, model, ids, mask, lambda: _HookAt(model, ids.shape[1] + 2))
        self.assertIn("a hook was added", tas.last_path().forward)

    def test_two_threads_generating_at_once_keep_the_eager_forward(self):
        import threading

        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        with stock():
            ref = model.generate(ids, attention_mask=mask, **kwargs)
        entered, release, seen = threading.Event(), threading.Event(), {}

        class Hold(StoppingCriteria):  # keeps the other thread inside generate() until this one has run
            def __call__(self, input_ids, scores, **kw):
                entered.set()
                release.wait(30)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def other():
            seen["other"] = model.generate(ids, attention_mask=mask, async_stopping_criteria=True,
                                           stopping_criteria=StoppingCriteriaList([Hold()]), **kwargs)

        thread = threading.Thread(target=other)
        thread.start()
        try:
            self.assertTrue(entered.wait(30))
            out = model.generate(ids, attention_mask=mask, async_stopping_criteria=True, **kwargs)
            self.assertEqual(tas.last_path().forward, "eager: another thread is inside generate()")
        finally:
            release.set()
            thread.join(60)
        self.assertTrue(torch.equal(ref, out))
        self.assertTrue(torch.equal(ref, seen["other"]))

    def test_the_switch_off_keeps_the_eager_forward(self):
        model = build("llama", device=self.DEVICE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        with mock.patch.dict(os.environ, {proof.PIECEWISE_ENV: "0"}):
            _check_against_stock(self, model, ids, mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        self.assertEqual(tas.last_path().forward, f"eager: {proof.PIECEWISE_ENV}=0")


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class OnCuda(_GraphedForwardCases, unittest.TestCase):
    DEVICE = "cuda"


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class EmulatedOnCpu(_GraphedForwardCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops replayed without Python:
    what the recording bakes in, and every per-step check around the replays, run in CI (no GPU there)."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


def _check_with_fresh_criterion(test, model, ids, mask, make):
    """Stock and the flag, each with its own criterion from `make()` (removed after its run)."""
    outputs = []
    for flag in (None, True):
        criterion = make()
        try:
            outputs.append(_generate(model, ids, mask, flag, max_new_tokens=8, do_sample=True, eos_token_id=None,
                                     stopping_criteria=StoppingCriteriaList([criterion])))
        finally:
            criterion.remove()
    (ref, ref_after), (out, after) = outputs
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")


class _AtLength(StoppingCriteria):
    """Does `act()` once, when the sequence reaches `length` tokens; never stops."""

    def __init__(self, model, length):
        self.model, self.length, self.handles = model, length, []

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.act()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def remove(self):
        for handle in self.handles:
            handle.remove()


class _MoveWeightsAt(_AtLength):
    """Moves every weight to new memory (same values): a replay of the old graphs would read the old memory."""

    def act(self):
        for param in self.model.parameters():
            param.data = param.data.clone()


class _HookAt(_AtLength):
    """Adds a forward hook that doubles the first MLP's output: stock's later steps see it."""

    def act(self):
        self.handles.append(self.model.model.layers[0].mlp.register_forward_hook(
            lambda module, args, output: output * 2))


if __name__ == "__main__":
    unittest.main()
