"""Red team of the graphed decoders of BART, mBART, Marian and Pegasus (commit 58e44cd): the flag's output against
unpatched transformers (stock), CPU with the graphs emulated. What is new there and attacked here: the positions the
decoder makes from the cache's host length (handed to the position table's call at the recording, filled from that
length at each replay) and the cross-attention mask (`create_bidirectional_mask` of the encoder's mask, intercepted at
the recording, made again by stock's function at each replay); the encoder's `attention_mask` now taken by a step
(Whisper's too).

Each case compares sequences, scores, logits, the returned cache and the RNG state after the call (mid-call changes
are made by a logits processor at a given step, on a fresh model per run). Cases marked `expectedFailure` are holes
(docs/red-team/2026-11-29-bart-graphs.md): the marker goes once they are fixed.
"""

from __future__ import annotations

import os
import sys
import threading
import unittest
from unittest import mock

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.modeling_outputs import BaseModelOutput

import transformers_async_stop as tas
import test_dynamic_loop_encoder_decoder as encdec
from models import TRANSFORMERS_VERSION, assert_same, stock
from test_dynamic_loop_encoder_decoder import build, build_whisper, features
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches
from transformers_async_stop.testing.emulation import emulated

ON = {proof.PIECEWISE_ENV: "1"}
FAMILY_NAMES = ("bart", "mbart", "marian", "pegasus")
TAKEN = ((5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24) and matches("dynamic decode loop")
         and all(matches(f"piecewise forward ({name})") for name in FAMILY_NAMES))
WHISPER = TAKEN and matches("piecewise forward (whisper)")
PIECES = "graphed (5 pieces)"  # two decoder layers, two attention sites each
NEW = 6


def source(batch=2, length=7, seed=1):
    return torch.randint(3, 30, (batch, length), generator=torch.Generator().manual_seed(seed))


def padded(ids, row=0, count=3):
    mask = torch.ones_like(ids)
    mask[row, :count] = 0
    return mask


def configured(family, **changes):
    """A tiny model of `family` as `build` makes it, with config fields changed (a released config's values)."""
    torch.manual_seed(0)
    config_class, model_class = encdec._BART_SHAPED[family]
    values = {**encdec._BART_SIZES, **changes}
    if family == "marian":
        values.setdefault("decoder_start_token_id", encdec.PAD)
    return model_class(config_class(**values)).eval()


class AtStep(LogitsProcessor):
    """Runs `action()` once, when called for the `step`-th time (0-based: step 0 follows the prefill, so its action
    comes before the first decode step, which is the recording); scores unchanged."""

    def __init__(self, step, action):
        self.step, self.action, self.calls = step, action, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            self.action()
        self.calls += 1
        return scores


def gen(model, ids, flag, new=NEW, **kwargs):
    return model.generate(ids, max_new_tokens=new, return_dict_in_generate=True, output_scores=True,
                          output_logits=True, **kwargs, **flag)


@unittest.skipUnless(TAKEN, "the BART rows' releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class BartGraphsRedTeam(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())

    def both(self, fn, seed=3):
        """`fn(flag_kwargs)` run under stock and with the flag: equal results and RNG state after."""
        with stock():
            torch.manual_seed(seed)
            ref = fn({}), torch.rand(3)
        torch.manual_seed(seed)
        out = fn(dict(async_stopping_criteria=True)), torch.rand(3)
        assert_same(self, ref[0], out[0])
        self.assertTrue(torch.equal(ref[1], out[1]), "RNG state after generate() differs")
        if os.environ.get("RT_DEBUG"):
            print(self.id(), tas.last_path().forward)
        return out[0]

    def graphed(self, replays=None):
        forward = tas.last_path().forward
        self.assertTrue(forward.startswith(PIECES), forward)
        if replays is not None:
            self.assertEqual(forward, f"{PIECES}: {replays} decode steps")

    def mid_call(self, family, step, action, mask=True, **kwargs):
        """Both runs on a fresh model each, `action(model)` run by a processor at `step`."""
        ids = source()

        def fn(flag):
            model = build(family)
            processors = LogitsProcessorList([AtStep(step, lambda: action(model))])
            return gen(model, ids, flag, attention_mask=padded(ids) if mask else None,
                       logits_processor=processors, **kwargs)
        return self.both(fn)

    # ---- the recording key: what changes between calls on one model ----

    def test_batch_source_length_and_encoder_mask_changing_across_calls_equal_stock_and_stay_graphed(self):
        # neither the encoder's length nor whether it has a mask is in the key: the cross mask is made at each replay
        model = build("bart")

        def fn(flag):
            outs = []
            for batch, length, kind in ((2, 7, None), (2, 9, "padded"), (3, 5, "ones"), (2, 7, "padded"),
                                        (2, 11, None), (1, 4, "ones")):
                ids = source(batch, length, seed=length)
                mask = None if kind is None else padded(ids) if kind == "padded" else torch.ones_like(ids)
                outs.append(gen(model, ids, flag, attention_mask=mask))
                if flag:
                    self.graphed(NEW - 1)
            return outs
        self.both(fn)

    def test_encoder_masks_of_bool_float_and_int32_equal_stock(self):
        model = build("marian")
        ids = source()
        mask = padded(ids)
        self.both(lambda flag: [gen(model, ids, flag, attention_mask=mask.to(dtype))
                                for dtype in (torch.bool, torch.float32, torch.int32)])
        self.graphed(NEW - 1)

    def test_sampling_with_num_return_sequences_and_eos_in_some_rows_equal_stock(self):
        # the encoder's outputs and mask are expanded per returned sequence; rows stop at different steps
        model = build("mbart")
        ids = source()
        self.both(lambda flag: gen(model, ids, flag, new=8, attention_mask=padded(ids), do_sample=True,
                                   num_return_sequences=3, eos_token_id=[15, 27], pad_token_id=0))
        self.graphed()

    def test_bf16_sampling_batch_2_then_1_equal_stock(self):
        model = build("marian").to(torch.bfloat16)
        ids = source()
        self.both(lambda flag: [gen(model, ids, flag, attention_mask=padded(ids), do_sample=True),
                                gen(model, ids[:1], flag, attention_mask=padded(ids)[:1], do_sample=True)])
        self.graphed()

    def test_encoder_inputs_embeds_equal_stock(self):
        model = build("bart")
        ids = source()
        with torch.no_grad():
            embeds = model.model.encoder.embed_tokens(ids)
        self.both(lambda flag: gen(model, None, flag, inputs_embeds=embeds, attention_mask=padded(ids)))
        self.graphed(NEW - 1)

    def test_a_longer_decoder_prompt_equals_stock(self):
        model = build("bart")
        ids = source()
        prompt = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
        self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids), decoder_input_ids=prompt))
        self.graphed(NEW - 1)

    def test_a_continued_cache_with_another_mask_then_another_source_equals_stock(self):
        # stock keeps the first call's cross-attention cache (is_updated) whatever the later calls' encoder gives;
        # the cross mask of each later step is made from that step's own mask
        model = build("bart")
        ids = source()

        def fn(flag):
            first = gen(model, ids, flag, new=4, attention_mask=padded(ids))
            second = gen(model, ids, flag, new=5, attention_mask=padded(ids, row=1, count=2),
                         decoder_input_ids=first.sequences, **{cache_kwarg.name(): cache_kwarg.of_output(first)})
            third = gen(model, source(2, 9, seed=5), flag, new=5, decoder_input_ids=second.sequences,
                        **{cache_kwarg.name(): cache_kwarg.of_output(second)})
            return first, second, third
        self.both(fn)
        self.graphed(4)

    def test_one_cache_reused_by_a_call_that_starts_its_tokens_over_equals_stock(self):
        # the second call starts from the decoder's start token on a cache already 6 long: stock's positions come
        # from the cache's length, not the ids' (the positions buffer is filled from that length); then a returned
        # cache cropped and continued
        model = build("bart")
        ids = source()

        def fn(flag):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            first = gen(model, ids, flag, attention_mask=padded(ids), **{cache_kwarg.name(): cache})
            second = gen(model, source(seed=9), flag, attention_mask=padded(ids), **{cache_kwarg.name(): cache})
            cropped = cache_kwarg.of_output(gen(model, ids, flag, new=4, attention_mask=padded(ids)))
            cropped.crop(-2)  # 4 positions (the start token and 3 of the 4 new ones) less 2
            third = gen(model, ids, flag, new=4, attention_mask=padded(ids), decoder_input_ids=first.sequences[:, :4],
                        **{cache_kwarg.name(): cropped})
            return first, second, cache, third, cropped
        self.both(fn)
        self.graphed(3)

    def test_inference_mode_on_off_on_equals_stock(self):
        model = build("pegasus")
        ids = source()

        def fn(flag):
            outs = []
            for inference in (True, False, True):
                with torch.inference_mode(inference):
                    outs.append(gen(model, ids, flag, attention_mask=padded(ids)))
            return outs
        self.both(fn)
        self.graphed(NEW - 1)

    def test_threads_on_one_model_equal_stock(self):
        model = build("bart")

        def fn(flag):
            results = {}

            def work(index):
                ids = source(seed=index)
                results[index] = gen(model, ids, flag, attention_mask=padded(ids))
            threads = [threading.Thread(target=work, args=(index,)) for index in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return [(results[i].sequences, results[i].scores, results[i].logits) for i in range(3)]
        self.both(fn)

    def test_a_streamer_gets_stocks_tokens(self):
        model = build("marian")
        ids = source(1)

        class Streamer:
            def __init__(self):
                self.got = []

            def put(self, value):
                self.got.append(value.clone())

            def end(self):
                self.got.append("end")

        def fn(flag):
            streamer = Streamer()
            return gen(model, ids, flag, attention_mask=padded(ids), streamer=streamer), streamer.got
        self.both(fn)
        self.graphed(NEW - 1)

    def test_generation_past_the_position_table_raises_as_stock_with_the_same_cache(self):
        # the learned table holds 64 positions: stock's 65th decoder position raises IndexError in the table's
        # embedding; the tokens streamed, the user's cache and the RNG state after the raise equal stock's
        model = build("bart")
        ids = source(1)

        def fn(flag):
            streamed = []
            streamer = type("S", (), {"put": lambda self, v: streamed.append(v.clone()), "end": lambda self: None})()
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            with self.assertRaises(IndexError):
                model.generate(ids, attention_mask=padded(ids), max_new_tokens=70, do_sample=True, streamer=streamer,
                               **{cache_kwarg.name(): cache}, **flag)
            return streamed, cache
        self.both(fn)

    # ---- mid-call changes of what the recording read ----

    def test_the_position_tables_offset_changed_mid_call_equals_stock(self):
        self.mid_call("bart", 2, lambda model: setattr(model.model.decoder.embed_positions, "offset", 1))

    def test_embed_scale_changed_mid_call_equals_stock(self):
        # BART's on its word embedding, Marian's on the decoder (a float multiplied inside piece 0)
        self.mid_call("bart", 2, lambda model: setattr(model.model.decoder.embed_tokens, "embed_scale", 3.0))
        self.mid_call("marian", 2, lambda model: setattr(model.model.decoder, "embed_scale", 3.0))

    def test_final_logits_bias_edited_in_place_then_replaced_mid_call_equals_stock(self):
        def edit(model):
            model.final_logits_bias.add_(torch.arange(model.final_logits_bias.shape[-1], dtype=torch.float32))

        def replace(model):
            model.register_buffer("final_logits_bias", torch.randn_like(model.final_logits_bias))

        ids = source()

        def fn(flag):
            model = build("bart")
            processors = LogitsProcessorList([AtStep(1, lambda: edit(model)), AtStep(3, lambda: replace(model))])
            return gen(model, ids, flag, attention_mask=padded(ids), logits_processor=processors)
        self.both(fn)
        self.graphed()

    def test_the_position_table_replaced_by_a_new_module_mid_call_records_it_again(self):
        # the recording hands the positions to the table it found by identity: after the swap the step records again
        # with the new table, whose rows are the old ones reversed
        def swap(model):
            old = model.model.decoder.embed_positions
            new = type(old)(old.weight.shape[0] - old.offset, old.weight.shape[1]).eval()
            with torch.no_grad():
                new.weight.copy_(old.weight.flip(0))
            model.model.decoder.embed_positions = new

        self.mid_call("bart", 2, swap)
        self.graphed(NEW - 1)

    def test_a_sinusoidal_table_replaced_mid_call_equals_stock(self):
        def swap(model):
            old = model.model.decoder.embed_positions
            new = type(old)(old.weight.shape[0], old.weight.shape[1]).eval()
            with torch.no_grad():
                new.weight.copy_(old.weight.flip(0))
            model.model.decoder.embed_positions = new

        self.mid_call("marian", 2, swap)
        self.graphed(NEW - 1)

    def test_the_decoder_given_the_encoders_position_table_mid_call_equals_stock(self):
        self.mid_call("mbart", 2, lambda model: setattr(model.model.decoder, "embed_positions",
                                                        model.model.encoder.embed_positions))
        self.graphed(NEW - 1)

    def test_two_models_sharing_one_position_table_alternating_equal_stock(self):
        a, b = build("bart"), build("bart")
        with torch.no_grad():
            for parameter in b.parameters():
                parameter.mul_(1.2)
        b.model.decoder.embed_positions = a.model.decoder.embed_positions
        ids = source()
        self.both(lambda flag: [gen(model, ids, flag, attention_mask=padded(ids)) for model in (a, b, a, b)])
        self.graphed(NEW - 1)

    def test_eager_attention_mid_call_and_back_equals_stock(self):
        ids = source()

        def fn(flag):
            model = build("pegasus")

            def to(impl):
                return lambda: setattr(model.config, "_attn_implementation", impl)
            processors = LogitsProcessorList([AtStep(1, to("eager")), AtStep(3, to("sdpa"))])
            return gen(model, ids, flag, attention_mask=padded(ids), logits_processor=processors)
        self.both(fn)
        self.graphed()

    def test_user_encoder_outputs_replaced_mid_call_equal_stock(self):
        # the replay reads the step's `encoder_outputs.last_hidden_state` (the cross mask's states, the output's field)
        ids = source()

        def fn(flag):
            model = build("pegasus")
            with torch.no_grad():
                encoder = BaseModelOutput(
                    last_hidden_state=model.model.encoder(input_ids=ids, attention_mask=padded(ids)).last_hidden_state)

            def swap():
                encoder.last_hidden_state = encoder.last_hidden_state * 2
            return gen(model, ids, flag, attention_mask=padded(ids), encoder_outputs=encoder,
                       logits_processor=LogitsProcessorList([AtStep(2, swap)]))
        self.both(fn)
        self.graphed(NEW - 1)

    # ---- exceptions ----

    def test_a_criterion_raising_mid_call_then_a_later_call_equal_stock(self):
        model = build("bart")
        ids = source()

        class RaiseAt(StoppingCriteria):
            def __init__(self):
                self.calls = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    raise ValueError("criterion")
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        def fn(flag):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            with self.assertRaisesRegex(ValueError, "criterion"):
                gen(model, ids, flag, attention_mask=padded(ids), stopping_criteria=StoppingCriteriaList([RaiseAt()]),
                    **{cache_kwarg.name(): cache})
            return cache, gen(model, ids, flag, attention_mask=padded(ids))
        self.both(fn)
        self.graphed(NEW - 1)

    def test_a_keyboard_interrupt_inside_the_recording_restores_the_swaps_and_a_later_call_equals_stock(self):
        # Ctrl-C arriving inside the recording, in the position table's interception or in the cross mask's remake
        # (simulated by a trace function raising at the call of the recorder's own function)
        import transformers.models.bart.modeling_bart as modeling

        table, function = modeling.BartLearnedPositionalEmbedding.forward, modeling.create_bidirectional_mask
        ids = source()
        for target in ("positions", "cross_mask_call"):
            model = build("bart")
            fired = []

            def tracer(frame, event, arg, target=target, fired=fired):
                if event == "call" and frame.f_code.co_name == target and not fired:
                    fired.append(target)
                    raise KeyboardInterrupt(target)

            sys.settrace(tracer)
            try:
                with self.assertRaises(KeyboardInterrupt):
                    gen(model, ids, dict(async_stopping_criteria=True), attention_mask=padded(ids))
            finally:
                sys.settrace(None)
            self.assertEqual(fired, [target])
            self.assertIs(modeling.BartLearnedPositionalEmbedding.forward, table)
            self.assertIs(modeling.create_bidirectional_mask, function)
            self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids)))
            self.graphed(NEW - 1)

    def test_a_cross_mask_stock_raises_on_at_a_replay_leaves_the_cache_as_stock(self):
        # the encoder mask resized in place to one dimension: stock's create_bidirectional_mask raises IndexError
        # before any layer runs, as the replay's remake does (before the first cache update)
        self._raising_cross_mask(step=2)
        self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)

    def test_a_cross_mask_stock_raises_on_at_the_recording_step_leaves_the_cache_as_stock(self):
        # hole 1 (fixed): stock's decoder makes the cross-attention mask before its first layer; the recording makes it
        # at the first cross-attention (`_Recorder.cross_attention`), after layer 0's self-attention has updated the
        # cache. When stock's function raised at that step, the flag raised the same exception with one more position
        # in layer 0 of the caller's self-attention cache (2 against stock's 1 here); the recorder now restores the
        # cache as the step began before the exception goes on
        self._raising_cross_mask(step=0)

    def _raising_cross_mask(self, step):
        ids = source()

        def fn(flag):
            model = build("bart")
            mask = padded(ids)
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            with self.assertRaisesRegex(IndexError, "too many indices"):
                gen(model, ids, flag, attention_mask=mask, logits_processor=LogitsProcessorList(
                    [AtStep(step, lambda: mask.resize_(ids.numel()))]), **{cache_kwarg.name(): cache})
            return [layer.keys.shape for layer in cache.self_attention_cache.layers], cache
        self.both(fn)

    # ---- what stays eager ----

    def test_released_configs_scale_embedding_swish_and_relu_are_graphed(self):
        # Marian's released configs: swish, scale_embedding; Pegasus': relu, scale_embedding; mBART's scale_embedding
        ids = source()
        for family, changes in (("marian", dict(scale_embedding=True, activation_function="swish")),
                                ("pegasus", dict(scale_embedding=True, activation_function="relu")),
                                ("mbart", dict(scale_embedding=True))):
            model = configured(family, **changes)
            self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids)))
            self.graphed(NEW - 1)

    def test_a_hook_on_the_encoder_keeps_the_decoder_graphed(self):
        # speed hole 2 (fixed): no decode step runs the encoder (`Family.skipped`: "model.encoder", its modules are
        # left out of default-deny), yet a forward hook on it (a user capturing the encoder's output) kept every decode
        # step eager: "eager: a hook on BartEncoder". The admission and the per-step checks now read the modules a
        # decode step runs (`family.decoding_modules`)
        model = build("bart")
        seen = []
        model.model.encoder.register_forward_hook(lambda module, args, output: seen.append(output.last_hidden_state))
        ids = source()
        self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids)))
        self.assertEqual(len(seen), 2)  # the hook ran once per call (the prefill's encoder), in both runs
        self.graphed(NEW - 1)

    def test_a_wrapped_encoder_forward_or_an_encoder_in_training_mode_keeps_the_decoder_graphed(self):
        # the same for a wrapped encoder forward ("a wrapped forward on BartEncoder") and the encoder alone in training
        # mode (its dropout at 0: stock's and the flag's prefill draw the same) ("training mode")
        ids = source()
        for change in ("wrapped", "training"):
            model = build("bart")
            encoder = model.model.encoder
            if change == "wrapped":
                calls = []
                original = encoder.forward

                def forward(*args, **kwargs):
                    calls.append(1)
                    return original(*args, **kwargs)

                encoder.forward = forward
            else:
                model.config.dropout = 0.0
                encoder.dropout = 0.0
                encoder.train()
            self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids)))
            self.graphed(NEW - 1)
            if change == "wrapped":
                self.assertEqual(len(calls), 2)

    def test_a_hook_on_a_decoder_module_still_keeps_it_eager_named(self):
        # the other side of the fix: the decoder's modules are still read (a module shared with the encoder too)
        model = build("bart")
        model.model.decoder.layers[0].fc1.register_forward_hook(lambda *args: None)
        ids = source()
        self.both(lambda flag: gen(model, ids, flag, attention_mask=padded(ids)))
        self.assertEqual(tas.last_path().forward, "eager: a hook on Linear")


@unittest.skipUnless(WHISPER, "the Whisper row's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class WhisperEncoderMask(unittest.TestCase):
    """Whisper's steps now take the encoder's `attention_mask` too (unused by its decoder: it takes no encoder mask)."""

    def setUp(self):
        self.enterContext(emulated())

    def test_an_encoder_attention_mask_given_then_none_then_bool_equals_stock_and_stays_graphed(self):
        model = build_whisper()
        feats = features(2)
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, 15:] = 0

        def fn(flag):
            outs = []
            for given in (mask, None, mask.bool()):
                kwargs = {} if given is None else dict(attention_mask=given)
                outs.append(model.generate(feats, max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
                                           **kwargs, **flag))
                if flag:
                    self.assertTrue(tas.last_path().forward.startswith(PIECES), tas.last_path().forward)
            return outs
        with stock():
            torch.manual_seed(3)
            ref = fn({}), torch.rand(3)
        torch.manual_seed(3)
        out = fn(dict(async_stopping_criteria=True)), torch.rand(3)
        assert_same(self, ref[0], out[0])
        self.assertTrue(torch.equal(ref[1], out[1]))


if __name__ == "__main__":
    unittest.main()
