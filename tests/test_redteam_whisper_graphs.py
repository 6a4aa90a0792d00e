"""Red team of Whisper's graphed decoder forward (commit 47635ac): the flag's output against unpatched transformers
(stock) for WhisperForConditionalGeneration, CPU with the graphs emulated."""

from __future__ import annotations

import os
import threading
import unittest
from unittest import mock

import torch
from transformers.modeling_outputs import BaseModelOutput
from transformers import DynamicCache, EncoderDecoderCache, LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, assert_same, stock
from test_dynamic_loop_encoder_decoder import build_whisper, features
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
TAKEN = ((5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24) and matches("piecewise forward (whisper)")
         and matches("dynamic decode loop"))
PIECES = "graphed (5 pieces)"


class AtStep(LogitsProcessor):
    """Runs `action()` once, when called for the `step`-th time (0-based); scores unchanged."""

    def __init__(self, step, action):
        self.step, self.action, self.calls = step, action, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            self.action()
        self.calls += 1
        return scores


def gen(model, feats, flag, seed=7, new=8, **kwargs):
    torch.manual_seed(seed)
    flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
    out = model.generate(feats, max_new_tokens=new, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, **kwargs, **flag_kwargs)
    return out, torch.rand(3)


@unittest.skipUnless(TAKEN, "the Whisper row's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class WhisperGraphsRedTeam(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def same(self, ref, out):
        assert_same(self, ref[0], out[0])
        self.assertTrue(torch.equal(ref[1], out[1]), "RNG state after generate() differs")

    def run_both(self, build, feats, seed=7, **kwargs):
        """`build()` -> (model, extra generate kwargs), called once per run (a fresh model: mid-call changes)."""
        model, extra = build()
        with stock():
            ref = gen(model, feats, None, seed, **kwargs, **extra)
        model, extra = build()
        out = gen(model, feats, True, seed, **kwargs, **extra)
        self.same(ref, out)
        if os.environ.get("RT_DEBUG"):
            print(self.id(), tas.last_path().forward)
        return out, tas.last_path()

    def test_batch_1_then_2_then_1_equals_stock_and_replays(self):
        model = build_whisper()
        for batch in (1, 2, 1, 2):
            with stock():
                ref = gen(model, features(batch), None)
            out = gen(model, features(batch), True)
            self.same(ref, out)
            self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)

    def test_two_models_of_the_class_alternating_equal_stock(self):
        a = build_whisper()
        b = build_whisper()
        with torch.no_grad():
            for p in b.parameters():
                p.mul_(1.3)
        for model in (a, b, a, b):
            with stock():
                ref = gen(model, features(2), None)
            out = gen(model, features(2), True)
            self.same(ref, out)
            self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)

    def test_decoder_weight_replaced_mid_call_equals_stock(self):
        def build():
            model = build_whisper()

            def swap():
                fc = model.model.decoder.layers[1].fc2
                fc.weight = torch.nn.Parameter(fc.weight.detach() * -1.5)
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, swap)]))
        self.run_both(build, features(2))

    def test_decoder_weight_edited_in_place_mid_call_equals_stock(self):
        def build():
            model = build_whisper()

            def edit():
                with torch.no_grad():
                    model.model.decoder.layers[0].encoder_attn.q_proj.weight.mul_(-2.0)
                    model.model.decoder.embed_positions.weight.mul_(3.0)
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, edit)]))
        self.run_both(build, features(2))

    def test_embed_positions_replaced_mid_call_equals_stock(self):
        def build():
            model = build_whisper()

            def swap():
                old = model.model.decoder.embed_positions
                new = type(old)(old.weight.shape[0], old.weight.shape[1])
                with torch.no_grad():
                    new.weight.copy_(old.weight.flip(0))
                model.model.decoder.embed_positions = new
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, swap)]))
        self.run_both(build, features(2))

    def test_attention_scaling_changed_mid_call_equals_stock(self):
        def build():
            model = build_whisper()

            def edit():
                model.model.decoder.layers[0].self_attn.scaling = 0.9
                model.model.decoder.layers[1].encoder_attn.scaling = 2.0
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, edit)]))
        self.run_both(build, features(2))

    def test_encoder_weight_replaced_and_hook_added_mid_call_equals_stock(self):
        def build():
            model = build_whisper()

            def edit():
                enc = model.model.encoder
                enc.layers[0].fc1.weight = torch.nn.Parameter(enc.layers[0].fc1.weight.detach() * 2)
                enc.register_forward_hook(lambda *a: None)
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, edit)]))
        self.run_both(build, features(2))

    def test_attention_implementation_switched_mid_call_and_back_equals_stock(self):
        def build():
            model = build_whisper()

            def to(impl):
                return lambda: setattr(model.config, "_attn_implementation", impl)
            return model, dict(logits_processor=LogitsProcessorList([AtStep(2, to("eager")), AtStep(4, to("sdpa"))]))
        self.run_both(build, features(2))

    def test_config_decoder_layers_changed_mid_call_equals_stock(self):
        def build():
            model = build_whisper()
            return model, dict(logits_processor=LogitsProcessorList(
                [AtStep(3, lambda: setattr(model.config, "decoder_layers", 1))]))
        self.run_both(build, features(2))

    def test_train_mode_with_dropout_mid_call_equals_stock(self):
        def build():
            model = build_whisper()
            model.model.decoder.dropout = 0.3
            return model, dict(logits_processor=LogitsProcessorList([AtStep(3, model.train)]))
        self.run_both(build, features(2))

    def _user_cache_build(self, action_of):
        def build():
            model = build_whisper()
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            return model, {cache_kwarg.name(): cache,
                           "logits_processor": LogitsProcessorList([AtStep(3, lambda: action_of(cache, model))])}
        return build

    def test_cross_cache_tensors_replaced_mid_call_equals_stock(self):
        def act(cache, model):
            for layer in cache.cross_attention_cache.layers:
                layer.keys = layer.keys * 1.7
                layer.values = layer.values.flip(-2).contiguous()
        self.run_both(self._user_cache_build(act), features(2))

    def test_cross_cache_edited_in_place_mid_call_equals_stock(self):
        def act(cache, model):
            for layer in cache.cross_attention_cache.layers:
                layer.keys.mul_(-1.0)
        self.run_both(self._user_cache_build(act), features(2))

    def test_cross_cache_shortened_mid_call_equals_stock(self):
        def act(cache, model):
            for layer in cache.cross_attention_cache.layers:
                layer.keys = layer.keys[:, :, :4]
                layer.values = layer.values[:, :, :4]
        self.run_both(self._user_cache_build(act), features(2))

    def test_is_updated_flipped_mid_call_equals_stock(self):
        def act(cache, model):
            cache.is_updated[1] = False
        self.run_both(self._user_cache_build(act), features(2))

    def test_cross_attention_cache_object_replaced_mid_call_equals_stock(self):
        def act(cache, model):
            new = DynamicCache()
            for i, layer in enumerate(cache.cross_attention_cache.layers):
                new.update(layer.keys * 0.5, layer.values * 2.0, i)
            cache.cross_attention_cache = new
        self.run_both(self._user_cache_build(act), features(2))

    def test_self_attention_cache_object_replaced_mid_call_equals_stock(self):
        def act(cache, model):
            new = DynamicCache()
            for i, layer in enumerate(cache.self_attention_cache.layers):
                new.update(layer.keys.clone(), layer.values.clone() * 1.1, i)
            cache.self_attention_cache = new
        self.run_both(self._user_cache_build(act), features(2))

    def both(self, fn, seed=3):
        """`fn(flag_kwargs)` run under stock and with the flag: equal results and RNG state after."""
        with stock():
            torch.manual_seed(seed)
            ref = fn({}), torch.rand(3)
        torch.manual_seed(seed)
        out = fn(dict(async_stopping_criteria=True)), torch.rand(3)
        self.same(ref, out)
        return out[0]

    def test_user_encoder_outputs_of_changing_length_across_calls_equal_stock_and_replay(self):
        # the cross cache's length is not in the recording key: the cross-attention runs eagerly at each replay
        model = build_whisper()

        def fn(flag):
            outs = []
            for length in (10, 7, 10, 13):
                hidden = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length))
                outs.append(model.generate(features(2), language="en", encoder_outputs=BaseModelOutput(
                    last_hidden_state=hidden), max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                    **flag))
                if flag:
                    self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)
            return outs
        self.both(fn)

    def test_long_prompt_ids_near_the_position_table_end_equal_stock(self):
        model = build_whisper()
        self.both(lambda flag: model.generate(features(2), prompt_ids=torch.arange(10, 26), max_new_tokens=18,
                                              return_dict_in_generate=True, output_scores=True, **flag))
        self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)

    def test_temperature_fallback_equals_stock(self):
        model = build_whisper()
        self.both(lambda flag: model.generate(features(2), temperature=(0.0, 0.5, 1.0), logprob_threshold=-0.1,
                                              max_new_tokens=8, return_dict_in_generate=True, output_scores=True,
                                              **flag))

    def test_beam_search_stays_stock(self):
        model = build_whisper()
        self.both(lambda flag: model.generate(features(2), num_beams=3, max_new_tokens=8,
                                              return_dict_in_generate=True, output_scores=True, **flag))

    def test_inference_mode_alternating_equals_stock(self):
        model = build_whisper()

        def fn(flag):
            outs = []
            for inference in (True, False, True):
                with torch.inference_mode(inference):
                    outs.append(model.generate(features(2), max_new_tokens=8, return_dict_in_generate=True,
                                               output_scores=True, **flag))
            return outs
        self.both(fn)

    def test_bf16_sampling_batch_2_2_1_equals_stock(self):
        model = build_whisper().to(torch.bfloat16)
        self.both(lambda flag: [model.generate(features(b).to(torch.bfloat16), max_new_tokens=8, do_sample=True,
                                               return_dict_in_generate=True, output_scores=True, **flag)
                                for b in (2, 2, 1)])

    def test_nested_generate_on_the_same_model_in_a_processor_equals_stock(self):
        model = build_whisper()

        def fn(flag):
            inner = []

            def nested():
                inner.append(model.generate(features(1), max_new_tokens=5, **flag))
                inner.append(model.generate(features(2), max_new_tokens=5, **flag))
            out = model.generate(features(2), max_new_tokens=8, logits_processor=LogitsProcessorList(
                [AtStep(3, nested)]), return_dict_in_generate=True, output_scores=True, output_logits=True, **flag)
            return out, inner
        self.both(fn)

    def test_a_user_cache_reused_with_other_features_equals_stock(self):
        # the second call's cross cache is the first's (is_updated): stock ignores the new features, as the flag must
        model = build_whisper()

        def fn(flag):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            first = model.generate(features(2), max_new_tokens=5, return_dict_in_generate=True,
                                   **{cache_kwarg.name(): cache}, **flag)
            second = model.generate(features(2) * 2, decoder_input_ids=first.sequences, max_new_tokens=4,
                                    return_dict_in_generate=True, output_scores=True, **{cache_kwarg.name(): cache},
                                    **flag)
            return first, second, cache
        self.both(fn)

    def test_threads_on_two_models_equal_stock(self):
        a, b = build_whisper(), build_whisper()

        def fn(flag):
            results = {}

            def work(index, model):
                results[index] = model.generate(features(2), max_new_tokens=8, return_dict_in_generate=True,
                                                output_scores=True, **flag)
            threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate((a, b, a))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return [(results[i].sequences, results[i].scores) for i in range(3)]
        self.both(fn)
