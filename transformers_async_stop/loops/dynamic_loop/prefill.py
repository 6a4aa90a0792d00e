"""An assistant's prefill on a filled cache, through the forward the loop holds for its decode steps (flag on, 5.17+).

In assisted decoding the assistant drafts by running its own `generate()` every round. After the first round its
cache already holds the sequence but the last two tokens (the candidate generator crops it to `len - 2`), so its
`_prefill` is a forward of two tokens on a filled cache, once per round. Stock runs it through `self(...)`; here it
goes through the forward the loop runs its decode steps with (`piecewise.forward_for`: replayed from CUDA graphs
where that is proven exact, the model's own forward otherwise, with the reason in `last_path().forward`).

Copied from transformers v5.17.0-v5.24.0 `GenerationMixin._prefill`, its unchunked branch
(`generation_config.prefill_chunk_size is None`), in the three forms those releases have (`FORMS`; `targets`
"dynamic loop draft prefill (<form>)", one row each, pins the source each form was read against):
- 5.17: the cache is `past_key_values`; the ids are sliced to the new tokens where a mask as long as them is passed;
- 5.18-5.23: also where no mask is passed and the generation config's `_mask_length` is the ids' length;
- 5.24: the cache is `cache`, and a cache of linear layers only is not sliced.
Differences: the forward is the loop's piecewise forward (`forward(**model_inputs, return_dict=True)` where stock
calls `self(**model_inputs, return_dict=True)`). Taken only where all of this holds, and stock's `model._prefill` is
called otherwise:
- the call is an assistant's (`generation_config.is_assistant`) and the loop holds a piecewise forward;
- the prefill is not chunked (`prefill_chunk_size is None`);
- the model's class keeps `GenerationMixin._prefill` (not its own, and not one rebound on the instance), and its
  installed source is one of the forms' (a release not read, or a source that differs, keeps stock's);
- the cache is filled (the first round's prefill, of the whole prompt on an empty cache, stays stock's).
"""

from __future__ import annotations

import dataclasses

from ...release_checks.verified import matches


@dataclasses.dataclass(frozen=True)
class Form:
    """One form of `_prefill`'s unchunked branch."""

    name: str  # the release range: its `targets` row is "dynamic loop draft prefill (<name>)"
    cache_key: str  # the cache's keyword in `model_kwargs`
    mask_length: bool  # without a mask, the generation config's `_mask_length` stands for its length (5.18+)
    linear: bool  # a cache of linear layers only is not sliced (5.24+)

    @property
    def shortcut(self) -> str:
        return f"dynamic loop draft prefill ({self.name})"


FORMS = (
    Form("5.17", "past_key_values", mask_length=False, linear=False),
    Form("5.18-5.23", "past_key_values", mask_length=True, linear=False),
    Form("5.24", "cache", mask_length=True, linear=True),
)


def installed_form() -> Form | None:
    """The form whose `_prefill` source is the installed one (`verified.matches`), if any."""
    for form in FORMS:
        if matches(form.shortcut):
            return form
    return None


def run(model, input_ids, generation_config, model_kwargs, graphed):
    """The loop's prefill: the port for an assistant's prefill on a filled cache (`graphed`: the loop's piecewise
    forward, None where it has none), stock's `model._prefill` for every other."""
    is_first_iteration = not generation_config.is_assistant
    form = _form_for(model, generation_config, model_kwargs, graphed)
    if form is None:
        return model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)
    return prefill(model, input_ids, generation_config, model_kwargs, is_first_iteration, graphed, form)


def _form_for(model, generation_config, model_kwargs, graphed) -> Form | None:
    from transformers.generation.utils import GenerationMixin

    if graphed is None or not generation_config.is_assistant or generation_config.prefill_chunk_size is not None:
        return None
    if type(model)._prefill is not GenerationMixin._prefill or "_prefill" in vars(model):
        return None  # a model's own prefill, or one rebound on the instance: stock calls that one
    form = installed_form()
    if form is None:
        return None
    # the loop runs on a plain `DynamicCache` (`eligibility.plan_loop`): its length is a host int, read as stock
    # reads it below
    cache = model_kwargs.get(form.cache_key)
    if cache is None or cache.get_seq_length() == 0:
        return None
    return form


def prefill(model, input_ids, generation_config, model_kwargs, is_first_iteration, forward, form):
    """`_prefill`'s unchunked branch in `form`, the forward being `forward` (see the module docstring)."""
    # When restarting from previous cache, the `input_ids` are either the FULL sequence, including previous inputs,
    # or only the new tokens but in this case the attention_mask still contains the FULL sequence (because otherwise
    # we may lose some early padding tokens information). So slice inputs according to that if needed
    # When restarting from `inputs_embeds`, it's always the FULL sequence, and we always need to slice
    next_sequence_length = None
    inputs_embeds = model_kwargs.get("inputs_embeds")
    cache = model_kwargs.get(form.cache_key)
    use_inputs_embeds = False
    if not model.config.is_encoder_decoder and inputs_embeds is not None and is_first_iteration:
        use_inputs_embeds = True
    if cache is not None and not (form.linear and all(cache.is_linear)):
        past_length = cache.get_seq_length()
        # It will be sliced as inputs_embeds = inputs_embeds[:, -next_sequence_length:, :] in
        # `prepare_inputs_for_generation`
        if use_inputs_embeds:
            next_sequence_length = model_kwargs["inputs_embeds"].shape[1] - past_length
        else:
            attention_mask_key = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
            attention_mask = model_kwargs.get(attention_mask_key)
            if form.mask_length:
                mask_length = (
                    attention_mask.shape[1]
                    if attention_mask is not None
                    else getattr(generation_config, "_mask_length", -1)
                )
                sliced = mask_length == input_ids.shape[1]
            else:
                sliced = attention_mask is not None and input_ids.shape[1] == attention_mask.shape[1]
            # In this case we need to slice - if it's smaller than the mask, only the new inputs were passed -> no
            # need to do anything
            if sliced:
                # inputs will be sliced as `input_ids[:, -next_sequence_length :]` in `prepare_inputs_for_generation`
                next_sequence_length = input_ids.shape[1] - past_length

    # Usual prefill
    model_inputs = model.prepare_inputs_for_generation(
        input_ids,
        next_sequence_length=next_sequence_length,
        is_first_iteration=is_first_iteration,
        **model_kwargs,
    )
    return forward(**model_inputs, return_dict=True)
