"""The `_sample` loop of a static cache, flag on, with the inputs kept in place and the tail replayed.

Copied from transformers v5.17.0-v5.23.0 `GenerationMixin._sample` (one source over that range; `targets.SHORTCUTS`
"static decode loop"). Differences:
- after the first decode step's inputs (stock's `prepare_inputs_for_generation`), the inputs are advanced on the
  device by the tail (`inputs.StepInputs`); `_update_model_kwargs_for_generation` runs for the prefill only, since
  nothing but the next inputs reads what it updates;
- the logits copy, processors, token selection, EOS check and sequence write are the `Tail` (one CUDA graph replay
  where it can be captured);
- `input_ids` is a preallocated sequence, handed to eager criteria as the first `length` columns (a contiguous copy
  if the batch has several rows) and returned as a fresh tensor;
- the stop is read one step late (`AsyncStop`): the verdict of step t is read after step t+1's forward is queued;
  if it says "all finished", step t+1 runs no processor, criterion or streamer call and its forward is undone in a
  returned cache; its random draws are given back.
"""

from __future__ import annotations

import torch

from ..cache_rollback import rollback_one_step, why_not_rollbackable
from .inputs import StepInputs
from .tail import Tail, prefix


def run(model, input_ids, stopping_criteria, generation_config, streamer, model_kwargs, ctl, plan):
    """`_sample` for a call `plan_loop` accepted; `plan` holds its processors and criteria."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    pad_token_id = generation_config._pad_token_tensor
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    scores = () if plan.scores else None
    raw_logits = () if plan.logits else None
    batch_size, length = input_ids.shape
    unfinished_sequences = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)
    seq = input_ids.new_empty((batch_size, max(stopping_criteria.max_length, length)))
    seq[:, :length].copy_(input_ids)

    model_forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    outputs = model._prefill(input_ids, generation_config, model_kwargs,
                             is_first_iteration=not generation_config.is_assistant)
    cache = model_kwargs.get("past_key_values")
    cache_returned = ctl.cache_returned
    model_inputs, first = None, True
    tail = Tail(plan, seq, length, unfinished_sequences, pad_token_id)
    step_inputs = None  # the first decode step makes them; None afterwards: stock rebuilds the inputs every step
    try:
        with model._optimize_model_for_decode():
            while True:
                if outputs is None:  # a decode step (the prefill's outputs are the first step's)
                    if model_inputs is None:
                        model_inputs = model.prepare_inputs_for_generation(
                            prefix(seq, length), next_sequence_length=1, **model_kwargs)
                    outputs = model_forward(**model_inputs, return_dict=True)
                if step_inputs is None:
                    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                                             is_encoder_decoder=False)
                if ctl.join():
                    break  # the step the flag-off run never made: its forward is undone below
                next_token_logits = tail.load(outputs.logits)
                outputs = None
                step_scores = tail.run(length, advance=step_inputs is not None)
                if scores is not None:
                    scores += (step_scores.clone(),)
                if raw_logits is not None:
                    raw_logits += (next_token_logits.clone(),)
                length += 1
                if plan.eager or plan.max_length:
                    _eager_criteria(plan, ctl, seq, scores, unfinished_sequences, length)
                if ctl.record(unfinished_sequences, tail.tokens, length):
                    break
                if first:
                    first = False
                    model_inputs, step_inputs = StepInputs.build(model, prefix(seq, length), model_kwargs, cache)
                    tail.inputs = step_inputs
                elif step_inputs is None:
                    model_inputs = None
    except BaseException:
        if ctl.overran and cache_returned and why_not_rollbackable(cache) is None:
            rollback_one_step(cache, ctl.kept_cache_length)
        raise
    finally:
        tail.close()

    steps_to_undo = ctl.finish()
    if steps_to_undo and cache_returned and why_not_rollbackable(cache) is None:
        rollback_one_step(cache, ctl.kept_cache_length)
    sequences = seq[:, :length].clone(memory_format=torch.contiguous_format)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=raw_logits, attentions=None,
                                         hidden_states=None, past_key_values=cache)
    return sequences


def _eager_criteria(plan, ctl, seq, scores, unfinished_sequences, length) -> None:
    """Stock's `StoppingCriteriaList.__call__` for the criteria the tail does not evaluate, folded into
    `unfinished_sequences` in place (stock: `unfinished & ~is_done`, the same values). As on the deferred path
    (`SideStreamCriteria`), the first per-row bool result seeds the reduction instead of stock's all-False tensor."""
    is_done = input_ids = None
    for criterion in plan.max_length:
        if length < criterion.max_length and (criterion.max_position_embeddings is None
                                              or length <= criterion.max_position_embeddings):
            continue  # it can only say "not yet", and cannot warn; `AsyncStop.record` stops at max_length
        input_ids = prefix(seq, length) if input_ids is None else input_ids
        is_done = _or(is_done, criterion(input_ids, scores), input_ids)
    for criterion in plan.eager:
        input_ids = prefix(seq, length) if input_ids is None else input_ids
        done = criterion(input_ids, scores)
        if not isinstance(done, torch.Tensor):
            ctl.warn_host_verdict(criterion)
        is_done = _or(is_done, done, input_ids)
    if is_done is not None:
        unfinished_sequences.bitwise_and_(~is_done)


def _or(is_done, done, input_ids):
    if is_done is None:
        if isinstance(done, torch.Tensor) and done.dtype == torch.bool and done.shape == (input_ids.shape[0],):
            return done
        is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return is_done | done
