"""The `_sample` loop of a static cache, flag on, with the inputs kept in place and the tail replayed.

Copied from transformers v5.17.0-v5.24.0 `GenerationMixin._sample` (one source over that range; `targets.SHORTCUTS`
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
from torch.utils.hooks import RemovableHandle

from ...release_checks import cache_kwarg
from ... import path_report
from ...sync_free import static_mask
from ...undo.module_state import hooked
from ...undo.cache_rollback import capacity, rollback_one_step, why_not_rollbackable
from ...control.step_lists import fold_criteria
from .inputs import StepInputs
from .live_inputs import why_fresh
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
    unfinished_sequences = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)  # `tail.unfinished`
    # wide enough for every token the cache lets stock make (one per position it has, plus the last one's): a
    # criterion may raise `max_length` mid-call, and stock follows it (the tail writes into this buffer in place)
    room = capacity(cache_kwarg.get(model_kwargs))
    seq = input_ids.new_empty((batch_size, max(stopping_criteria.max_length, length + (room or 0) + 1)))
    seq[:, :length].copy_(input_ids)

    model_forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    outputs = model._prefill(input_ids, generation_config, model_kwargs,
                             is_first_iteration=not generation_config.is_assistant)
    cache = cache_kwarg.get(model_kwargs)
    model_inputs, first = None, True
    tail = Tail(plan, seq, length, unfinished_sequences, pad_token_id)
    tail.held = (input_ids, length)  # the first step's processors get generate()'s own ids
    step_inputs = None  # the first decode step makes them; None afterwards: stock rebuilds the inputs every step
    behind = 0  # `_update_model_kwargs_for_generation` calls skipped while the inputs are advanced in place
    seen = _fingerprint(model, ctl)
    left = None  # why the call left its plan of in-place inputs mid-call
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
                else:
                    behind += 1
                if ctl.join():
                    break  # the step the flag-off run never made: its forward is undone below
                next_token_logits = tail.load(outputs.logits)
                outputs = None
                step_scores = tail.run(length, advance=step_inputs is not None)
                # stock keeps the very tensors it made; a captured tail rewrites its buffers at every replay
                kept_scores, kept_logits = tail.keep(step_scores, next_token_logits, scores is not None,
                                                     raw_logits is not None)
                if scores is not None:
                    scores += (kept_scores,)
                if raw_logits is not None:
                    raw_logits += (kept_logits,)
                length += 1
                if plan.criteria:
                    is_done = fold_criteria(plan.criteria, length, lambda: tail.sequence(length), scores, ctl, {})
                    tail.settle(length)  # a criterion's in-place edit of the sequence lands in it, as in stock
                    if step_inputs is not None:
                        step_inputs.refresh()  # the mask from the cache's counter as the criteria left it
                    if is_done is not None:
                        tail.fold(is_done)  # stock: `unfinished & ~is_done`
                if ctl.record(tail.verdict(), tail.tokens, length):
                    break
                now = _fingerprint(model, ctl)
                if now != seen:
                    # user code registered a hook or changed the attention implementation: stock's own per-step
                    # inputs and mask from now on, with the kwargs updates the in-place inputs skipped
                    seen, first = now, False
                    left = left or "a hook or the attention implementation changed mid-call: stock's per-step inputs"
                    static_mask.release(cache)
                    if step_inputs is not None:
                        for _ in range(behind):
                            model_kwargs = model._update_model_kwargs_for_generation({}, model_kwargs,
                                                                                     is_encoder_decoder=False)
                        step_inputs = tail.inputs = None
                    model_inputs = None
                elif first:
                    first = False
                    # a hook, an instance forward or a user module may keep the inputs it is given: stock gives new
                    # ones every step (`live_inputs`)
                    why = "a forward hook is registered: stock's per-step inputs" if _hooked(model) else why_fresh(model)
                    if why is not None:
                        left = why
                        model_inputs = None
                    else:
                        model_inputs, step_inputs = StepInputs.build(model, prefix(seq, length), model_kwargs, cache,
                                                                       ctl.cache_end())
                        tail.inputs = step_inputs
                elif step_inputs is None:
                    model_inputs = None
    except BaseException:
        if ctl.overran:
            _give_back_extra_forward(ctl, cache)
        raise
    finally:
        path_report.static_loop(bool(tail.graphs), len(tail.graphs), left or tail.left)
        tail.close()

    if ctl.finish():
        _give_back_extra_forward(ctl, cache)
    held = tail.held
    # stock returns its last `input_ids` itself: where user code was handed the sequence at the final length (a
    # criterion that keeps it), it is that very tensor (its edits were settled into `seq`); otherwise a fresh copy
    sequences = held[0] if held is not None and held[1] == length else seq[:, :length].clone(
        memory_format=torch.contiguous_format)
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=raw_logits, attentions=None,
                                         hidden_states=None, **cache_kwarg.output_field(cache))
    return sequences


def _fingerprint(model, ctl) -> tuple:
    """What stock reads at every step and the in-place inputs fix for the call, as cheap host values: the count of
    hooks ever registered (any module, any kind: a new forward hook must get stock's fresh inputs), the hooks the
    controller's hook watch found put in a module's table without a handle (which the count misses) and
    the attention implementation (the mask plan is made for one)."""
    config = model.config
    return (RemovableHandle.next_id, getattr(ctl.hooks, "unhandled", 0), getattr(config, "_attn_implementation", None),
            getattr(config.get_text_config(), "_attn_implementation", None))


def _hooked(model) -> bool:
    """Whether a user forward hook is registered on the model or any of its modules (or globally): it gets the
    step's input tensors (the mask and positions reach every layer), and may keep them (module_state.hooked)."""
    return hooked(model)


def _give_back_extra_forward(ctl, cache) -> None:
    """A returned cache loses the position the extra step's forward wrote (an unreturned one is reset on reuse)."""
    if ctl.cache_returned and why_not_rollbackable(cache) is None:
        rollback_one_step(cache, ctl.extra_position())
