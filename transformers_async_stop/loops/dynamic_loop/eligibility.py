"""Which `_sample` calls the dynamic-cache loop takes, and what it runs in them: decided once per call.

The loop is taken where it reproduces stock exactly, and nowhere else: a decoder-only model that keeps transformers'
own `prepare_inputs_for_generation` (or Phi-3's own, read: `_OWN_INPUTS`) and `_update_model_kwargs_for_generation`
and is not remote code, or an encoder-decoder of the families read (BART, mBART, Marian, Pegasus, Blenderbot,
BlenderbotSmall, T5, Whisper with its own preparation, read: `encoder_decoder.py`) with a plain `EncoderDecoderCache` of two `DynamicCache`s of
full-attention layers; for a decoder-only model a plain
`DynamicCache` (not compileable: stock builds no 4D mask in the input preparation) of full-attention and
sliding-window layers (`DynamicLayer`, `DynamicSlidingWindowLayer`; an assistant's draft: the former only), one new
token per step, no
per-step attentions or hidden states, one device and one process (no `device_map` split, no `synced_gpus` or tensor
parallelism), no processor that needs keyword arguments (stock raises there: the deferred path does too), and an
installed transformers whose sources are the ones this loop was read against (`targets.SHORTCUTS`: "dynamic decode
loop", with the processor and criteria lists' own shortcuts). Every other call runs the deferred path of
`generation.py`. A static cache goes to `static_loop` first.

An assistant's draft loop inside a deferred assisted call (`assisted/draft.py`) is taken too: its controller is the
call's `DraftStop`, its criteria the draft's own (`DraftRun.criteria`), and its prefill is stock's with the
assistant's `is_first_iteration` (on a filled cache, each round after the first, `prefill.py`'s port of it, through
the piecewise forward).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ...control.step_lists import _plan_criterion, is_user_criterion, plan_processors
from ...release_checks.verified import matches
from ...release_checks import cache_kwarg
from ...release_checks.input_drops import own_prepare
from .encoder_decoder import family_of as encoder_decoder_family
from .encoder_decoder import own_prepare_read, why_not_cache

DYNAMIC_LOOP_ENV = "TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP"


def _off() -> bool:
    return os.environ.get(DYNAMIC_LOOP_ENV, "").strip().lower() in ("0", "false", "no", "off")


@dataclasses.dataclass
class DynamicPlan:
    """What one `_sample` call of the dynamic-cache loop runs."""

    encoder_decoder: bool  # the model's `config.is_encoder_decoder`, read once (stock reads it at every step)
    processors: list  # callables (input_ids, scores) -> scores, in order (`_plan_processor`)
    criteria: list  # planned `(criterion, kind)` pairs, folded after each step (`fold_criteria`)
    user_criteria: bool  # one of them is not transformers' own: it may edit the last token in place
    do_sample: bool
    has_eos: bool  # stock's `has_eos_stopping_criteria`: finished rows get the pad token
    scores: bool  # return the processed scores of each step
    logits: bool  # return the raw logits of each step


def plan_loop(model, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs):
    """The call's `DynamicPlan`, or None where the deferred path of `generation.py` runs instead."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    from transformers.generation.utils import GenerationMixin

    if _off() or synced_gpus:
        return None
    if not model_kwargs.get("use_cache", True):
        return None
    # an encoder-decoder: the families read, with their `EncoderDecoderCache` (`encoder_decoder.py`)
    encoder_decoder = bool(model.config.is_encoder_decoder)
    if encoder_decoder and (generation_config.is_assistant or encoder_decoder_family(model) is None):
        return None  # (an encoder-decoder's assisted decoding runs stock: its draft loop is not ported)
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1 or torch.distributed.is_initialized():
        return None  # a model split over devices or processes
    if generation_config.return_dict_in_generate and (generation_config.output_attentions
                                                      or generation_config.output_hidden_states):
        return None
    kind = type(model)
    own_inputs = own_inputs_read(model) if not encoder_decoder else own_prepare_read(model)
    if ((kind.prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation and not own_inputs)
            or kind._update_model_kwargs_for_generation is not GenerationMixin._update_model_kwargs_for_generation):
        return None
    if _is_remote_code(model):
        return None  # stock adds a `cache_position` for remote code every step
    cache = cache_kwarg.get(model_kwargs)
    if encoder_decoder:
        if why_not_cache(cache) is not None:
            return None
        cache = cache.self_attention_cache  # the decoder's own: the one each step grows, and the undo crops
    elif type(cache) is not DynamicCache or getattr(cache, "is_compileable", False):
        return None
    # full-attention and sliding-window layers: the extra step's undo is a crop of the former, and puts a returned
    # cache's layers back as they were before that step where it holds the latter (`cache_rollback.StepSnapshot`,
    # whose reading of the sliding layer is pinned by "dynamic decode loop (sliding layers)"). An assistant's draft
    # loop keeps full-attention layers only (`DraftStop` reads each verdict of a sliding cache at once, and the
    # assisted loop records that cache's past). An empty user cache may have no layer yet (it makes `DynamicLayer`s
    # lazily)
    layers = getattr(cache, "layers", ()) or ()
    if any(type(layer) is not DynamicLayer for layer in layers):
        if (generation_config.is_assistant
                or any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)
                or not matches("dynamic decode loop (sliding layers)")):
            return None
    if not (matches("dynamic decode loop") and matches("LogitsProcessorList.__call__")
            and matches("StoppingCriteriaList.__call__")):
        return None

    processors = plan_processors(logits_processor)
    if processors is None:
        return None
    rdig = generation_config.return_dict_in_generate
    return DynamicPlan(
        encoder_decoder=encoder_decoder,
        processors=processors, criteria=[(c, _plan_criterion(c)) for c in stopping_criteria],
        user_criteria=any(is_user_criterion(c) for c in stopping_criteria),
        do_sample=bool(generation_config.do_sample),
        has_eos=any(hasattr(c, "eos_token_id") for c in stopping_criteria),
        scores=bool(rdig and generation_config.output_scores), logits=bool(rdig and generation_config.output_logits),
    )


# causal LMs whose own `prepare_inputs_for_generation` the loop takes: (modeling module, class). The loop then calls
# it at every step (`inputs.DecodeInputs.build` hands none of the steps to its own input making). Phi-3's drops the
# cache once the sequence passes `original_max_position_embeddings` (its long/short rope switch): the step after it
# prefills the whole sequence into a new cache, as stock does (`targets/piecewise_rows.py`, "dynamic decode loop (phi3
# inputs)"). Past that length each verdict is read at once (`input_drops.py`, `AsyncStop.record`), so no undone extra
# step is the refill
_OWN_INPUTS = {"phi3": ("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM")}


def own_inputs_read(model) -> bool:
    """The model's class keeps the `prepare_inputs_for_generation` of one of `_OWN_INPUTS`, as read."""
    for family, (module, name) in _OWN_INPUTS.items():
        own = own_prepare(module, name)
        if own is not None and type(model).prepare_inputs_for_generation is own:
            return matches(f"dynamic decode loop ({family} inputs)")
    return False


def _is_remote_code(model) -> bool:
    is_remote = getattr(model, "is_remote_code", None)
    try:
        return bool(is_remote()) if callable(is_remote) else False
    except Exception:  # a model whose check fails is treated as remote code: the deferred path runs
        return True
