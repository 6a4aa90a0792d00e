"""The `_sample` loop of a dynamic cache, flag on: per step only what varies per step.

Copied from transformers v5.17.0-v5.24.0 `GenerationMixin._sample` (one source over that range; `targets.SHORTCUTS`
"dynamic decode loop"). Differences:
- after the first decode step (stock's `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation`),
  the forward's inputs are made from the previous step's (`inputs.DecodeInputs`): no generic input preparation,
  kwargs update, or `generation_config` reads per step;
- the processors are the call's plan (`step_lists._plan_processor`: signatures read once, the minimum-length EOS
  mask made once), the criteria are folded with the deferred path's shortcuts (`step_lists.fold_criteria`), both
  called directly instead of through their list wrappers;
- the stop is read one step late (`AsyncStop`), exactly as the static-cache loop reads it: the verdict of step t is
  read after step t+1's forward is queued; if it says "all finished", step t+1 runs no processor, criterion or
  streamer call and its forward is undone in a returned cache; its random draws are given back;
- `_has_unfinished_sequences` and the stop-check object are not called: the controller is the stop check;
- an assistant's prefill on a filled cache runs `prefill.py`'s port of `_prefill` with the decode steps' forward;
- a returned cache with sliding-window layers has its layers' attributes kept (shallow copies) before each decode
  step's forward: the extra step's undo puts them back (`cache_rollback.StepSnapshot`);
- an encoder-decoder's `config.is_encoder_decoder` is read once per call (`DynamicPlan.encoder_decoder`), and its
  result is stock's `GenerateEncoderDecoderOutput` without attentions or hidden states (`encoder_decoder.py`; the
  loop is not taken where they are asked for). The extra step's undo crops the self-attention cache alone: the
  cross-attention cache is written at the prefill only.
The sequence (`torch.cat` per step), the logits copy, the token selection and the recorded scores and logits are
stock's own lines.
"""

from __future__ import annotations

import torch

from ...release_checks import cache_kwarg
from ... import path_report
from ...graphs import piecewise
from ...undo.cache_rollback import StepSnapshot, holds_sliding_layers, rollback_one_step, why_not_rollbackable
from ...control.step_lists import fold_criteria
from . import prefill
from .encoder_decoder import output as encoder_decoder_output
from .inputs import DecodeInputs
from .kv_lengths import meter_for


def run(model, input_ids, generation_config, streamer, model_kwargs, ctl, plan):
    """`_sample` for a call `plan_loop` accepted; `plan` holds its processors and criteria."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if not generation_config.is_assistant:
        path_report.dynamic_loop()
    pad_token_id = generation_config._pad_token_tensor
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    scores = () if plan.scores else None
    raw_logits = () if plan.logits else None
    processors, criteria, do_sample, has_eos = plan.processors, plan.criteria, plan.do_sample, plan.has_eos
    user_criteria, encoder_decoder = plan.user_criteria, plan.encoder_decoder
    unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    model_forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    # the decode steps' forward: replayed from CUDA graphs piece by piece where `piecewise` proves it exact. An
    # assistant's is made here: its two-token prefill of each assisted round after the first goes through it too
    # (`prefill.py`); any other call's is made inside `_optimize_model_for_decode` below, the state its decode steps
    # run in (a MoE switched to `batched_mm` there: made outside, its recordings' snapshot would differ at every
    # call's start, and the model be proven again in full each time; tests/test_found_family_recordings.py)
    graphed = piecewise.forward_for(model, model_forward, generation_config) if generation_config.is_assistant \
        else None
    forward = graphed or model_forward
    # stock's `_prefill`, except an assistant's two-token prefill of each assisted round after the first
    outputs = prefill.run(model, input_ids, generation_config, model_kwargs, graphed)
    meter = meter_for(model, input_ids) if not generation_config.is_assistant else None
    step_inputs = None  # made at the first decode step; None while stock prepares the inputs
    first = True
    # a returned cache with sliding-window layers: its layers as they were before each decode step's forward, the
    # extra step's exact undo (`cache_rollback.StepSnapshot`); None where the crop undoes it, or nothing needs undoing
    snapshot = None
    try:
        with model._optimize_model_for_decode():
            if not generation_config.is_assistant:
                graphed = piecewise.forward_for(model, model_forward, generation_config)
                forward = graphed or model_forward
            while True:
                if outputs is None:  # a decode step (the prefill's outputs are the first step's)
                    if step_inputs is not None:
                        model_inputs = step_inputs.next(column)
                    elif first:
                        first = False
                        model_inputs, step_inputs = DecodeInputs.build(model, input_ids, model_kwargs,
                                                                       model_forward)
                        if graphed is not None and step_inputs is not None and step_inputs.watch is not None:
                            graphed.remakes_padded = False  # a grown 4D mask from this step on (`wide_mask`)
                    else:
                        model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1,
                                                                           **model_kwargs)
                    if ctl.cache_returned:
                        cache = cache_kwarg.get(model_inputs)
                        if snapshot is None or snapshot.cache is not cache:
                            snapshot = StepSnapshot(cache) if holds_sliding_layers(cache) else None
                        if snapshot is not None:
                            snapshot.save()
                    if meter is not None:
                        meter.step(input_ids.shape[1])  # the step's key/value length: the cache's and this token
                    outputs = forward(**model_inputs, return_dict=True)
                if step_inputs is None:
                    # the prefill's, and every step's where the inputs are stock's: the patched update also plans
                    # the controller's cache (`masking.patched_update_model_kwargs`)
                    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                             is_encoder_decoder=encoder_decoder)
                if ctl.join():
                    break  # the step the flag-off run never made: its forward is undone below
                next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
                outputs = None  # stock: `del outputs`, so the prefill's logits can go
                next_token_scores = next_token_logits
                for processor in processors:
                    next_token_scores = processor(input_ids, next_token_scores)
                if scores is not None:
                    scores += (next_token_scores,)
                if raw_logits is not None:
                    raw_logits += (next_token_logits,)
                if do_sample:
                    probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(next_token_scores, dim=-1)
                if has_eos:
                    next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
                column = next_tokens[:, None]  # also the next forward's `input_ids` (`DecodeInputs.next`)
                input_ids = torch.cat([input_ids, column], dim=-1)
                length = input_ids.shape[1]
                if criteria:
                    is_done = fold_criteria(criteria, length, lambda: input_ids, scores, ctl, {})
                    if is_done is not None:
                        unfinished_sequences = unfinished_sequences & ~is_done
                    if user_criteria:
                        # a user criterion may have edited the last token in place: stock's next forward gets
                        # `input_ids[:, -1:].clone()` as the criteria left it (a copy on the device, no read)
                        column = input_ids[:, -1:].clone()
                if ctl.record(unfinished_sequences, next_tokens, length):
                    break
    except BaseException:
        if ctl.overran:
            _give_back_extra_forward(ctl, model_kwargs, snapshot)
        raise
    finally:
        if meter is not None:
            path_report.attention_lengths(meter.text())
    if ctl.finish():
        _give_back_extra_forward(ctl, model_kwargs, snapshot)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        if encoder_decoder:
            return encoder_decoder_output(input_ids, scores, raw_logits, cache_kwarg.get(model_kwargs))
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, attentions=None,
                                         hidden_states=None, **cache_kwarg.output_field(cache_kwarg.get(model_kwargs)))
    return input_ids


def _give_back_extra_forward(ctl, model_kwargs, snapshot=None) -> None:
    """A returned cache loses the position the extra step's forward wrote (an unreturned one is dropped); one with
    sliding-window layers gets back the layers it had before that forward (`StepSnapshot`)."""
    cache = cache_kwarg.get(model_kwargs)
    if not ctl.cache_returned or cache is None:
        return
    if snapshot is not None and snapshot.restore(cache):
        return
    if why_not_rollbackable(cache) is None:
        rollback_one_step(cache, ctl.extra_position())
