"""The deferred verify loop of assisted decoding and prompt lookup: one blocking read per round.

Ported from each release's `GenerationMixin._assisted_decoding` (`Port`). A round drafts candidates, verifies them
with one target forward, and keeps the longest accepted prefix plus one token of the target's own. Stock reads the
device several times per round to decide what it keeps (`acceptance.py` lists where); here the decision is made on
the device and everything the host needs comes back in one pinned copy (`acceptance.RoundBox`): the accepted
length after the max-length and EOS cuts, whether the last kept token is an EOS, the kept tokens (for the
streamer, the host mirror and prompt lookup), and with scikit-learn the draft probabilities. From then on the
round is stock's host code with Python ints: the cache crop, `update_candidate_strategy`, the kwargs update and the
records.

The stop verdict is folded into that read, not lagged: the criteria allowed here (max length and time, decided on
the host; EOS, computed on the device before the copy) say the same thing at the same round as stock, so no round
runs that stock did not run and nothing of the verify loop is undone. Other criteria (stop strings, user criteria)
keep the call stock (`why_stock`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ...graphs import piecewise
from ...release_checks import cache_kwarg
from ...control.controller import RngGuard
from ...sync_free.masking import _tag, _tag_of
from ...release_checks.verified import matches
from ... import path_report
from . import acceptance
from .acceptance import HEADER, RoundBox
from .acceptance_graph import GraphedAcceptance
from .draft import DraftRun, outer_mask_summary
from .lookup import HostLookup, Mirror
from .room import Room

MAX_TIME = "MaxTimeCriteria.__call__"


@dataclass(frozen=True)
class Port:
    """What differs between the releases' `_assisted_decoding` loops (4.57 to 5.24)."""

    name: str  # the shortcut in `targets.SHORTCUTS` whose sources it was ported from
    first_iteration_arg: bool  # 5.0-5.2: `get_candidates(input_ids, is_first_iteration)`
    first_iteration_kwarg: bool  # 5.0+: `prepare_inputs_for_generation(..., is_first_iteration=...)`
    cache_position: bool  # 4.57-5.3 grow `cache_position`
    position_ids: bool  # 5.2+ grow `position_ids`
    next_sequence_length: bool  # 5.3+ pass `next_sequence_length` to `prepare_inputs_for_generation`
    static_by_type: bool  # 5.5+: the static-cache refusal tests `type(cache) is StaticCache`
    done_candidate: bool  # 4.57-5.17: `is_done_candidate and n_matches == candidate_length` gives one back
    budget: bool  # 5.14+: `valid_tokens[:, :max_length - cur_len]`
    eos_cut: bool  # 5.18+: cut after the first EOS among the kept tokens
    ensemble: bool  # 5.14+: `assistant_ensemble_weight`
    record_past: bool  # 5.14+: `activate_past_recording()`, relative `crop(-n)`
    crop_positive_only: bool  # 5.14: the relative crop only when n > 0
    cache_in_kwargs_only: bool  # 4.57 returns `model_kwargs.get("past_key_values")`, later releases any cache name
    decode_compiled: bool  # 5.24+: no static-cache refusal; rounds after the first verify through the compiled
    # forward (where `_valid_auto_compile_criteria`) under `_optimize_model_for_decode`; the cache must be croppable
    # after the prefill; the cache is `model_kwargs["cache"]` / `outputs.cache`


def _port(name: str, **changes) -> Port:
    """A port as 5.0's loop, with the fields that differ."""
    base = dict(first_iteration_arg=True, first_iteration_kwarg=True, cache_position=True, position_ids=False,
                next_sequence_length=False, static_by_type=False, done_candidate=True, budget=False, eos_cut=False,
                ensemble=False, record_past=False, crop_positive_only=False, cache_in_kwargs_only=False,
                decode_compiled=False)
    return Port(name, **{**base, **changes})


_LATER = dict(first_iteration_arg=False, cache_position=False, position_ids=True, next_sequence_length=True,
              static_by_type=True)  # 5.5-5.13
_RECORDING = dict(_LATER, budget=True, ensemble=True, record_past=True)  # 5.14+

PORTS = (
    _port("assisted decoding loop (4.57)", first_iteration_arg=False, first_iteration_kwarg=False,
          cache_in_kwargs_only=True),
    _port("assisted decoding loop (5.0-5.1)"),
    _port("assisted decoding loop (5.2)", position_ids=True),
    _port("assisted decoding loop (5.3)", first_iteration_arg=False, position_ids=True, next_sequence_length=True),
    _port("assisted decoding loop (5.4)", **dict(_LATER, static_by_type=False)),
    _port("assisted decoding loop (5.5-5.13)", **_LATER),
    _port("assisted decoding loop (5.14)", **dict(_RECORDING, crop_positive_only=True)),
    _port("assisted decoding loop (5.15-5.17)", **_RECORDING),
    _port("assisted decoding loop (5.18-5.23)", **dict(_RECORDING, done_candidate=False, eos_cut=True)),
    _port("assisted decoding loop (5.24)",
          **dict(_RECORDING, done_candidate=False, eos_cut=True, decode_compiled=True)),
)


def installed_port() -> Port | None:
    """The port whose upstream sources are the installed ones (`verified.matches`), if any."""
    for port in PORTS:
        if matches(port.name):
            return port
    return None


def unfoldable(stopping_criteria) -> str | None:
    """A criterion whose verdict cannot ride in the round's one read, if any (its name)."""
    for criterion in stopping_criteria:
        kind = type(criterion)
        if kind is MaxLengthCriteria and matches("MaxLengthCriteria.__call__"):
            continue
        if kind is EosTokenCriteria and matches("EosTokenCriteria.__call__"):
            continue
        if kind is MaxTimeCriteria and matches(MAX_TIME):
            continue
        return kind.__name__
    return None


class FoldedCriteria:
    """The call's stopping criteria, evaluated where stock evaluates them, without a device read.

    Copied from transformers v4.57.6-v5.24.0 `MaxLengthCriteria`, `MaxTimeCriteria` and `EosTokenCriteria`
    `__call__` (checked by `verified.matches`). Differences: max length and time are decided on the host; the EOS
    test runs on the device before the round's copy (`acceptance.last_is_eos`). A max-length criterion past the
    model's `max_position_embeddings` is still called, for its one-time warning.
    """

    def __init__(self, stopping_criteria):
        self.lengths = [c for c in stopping_criteria if type(c) is MaxLengthCriteria]
        self.timers = [c for c in stopping_criteria if type(c) is MaxTimeCriteria]
        self.eos_ids = [c.eos_token_id for c in stopping_criteria if type(c) is EosTokenCriteria]

    def on_host(self, input_ids, scores) -> bool:
        length = input_ids.shape[-1]
        stop = False
        for criterion in self.lengths:
            if length >= criterion.max_length:
                stop = True
            elif criterion.max_position_embeddings is not None and length >= criterion.max_position_embeddings:
                criterion(input_ids, scores)  # the warning only; its device answer is "not done", as computed here
        for criterion in self.timers:
            stop = stop or time.time() - criterion.initial_timestamp > criterion.max_time
        return stop


def run(model, port: Port, candidate_generator, input_ids, logits_processor, stopping_criteria, generation_config,
        streamer, model_kwargs):
    """Copied from transformers `GenerationMixin._assisted_decoding`: v4.57.6, v5.0.0 (= v5.1.0), v5.2.0, v5.3.0,
    v5.4.0, v5.5.4-v5.13.1 (v5.8 adds only the MTP generator's branches), v5.14.1, v5.17.0 (= v5.15.1-v5.16.1), v5.23.0
    (= v5.18.0-v5.22.2 but for one annotation) and v5.24.0 (5.23's loop with the cache renamed `cache`, decode rounds
    through the compiled forward, and a croppable-cache check after the prefill), per `port`, from the candidate generator on (the caller made it as
    stock does). Differences:
    - acceptance on the device (`acceptance.select` / `speculative` / `accepted_length`; a greedy round's replayed
      from one CUDA graph per width, `acceptance_graph.py`), then one read per round
      (`RoundBox`): `n_matches` is a Python int from there on, so the cache crop, `update_candidate_strategy`,
      `_update_model_kwargs_for_generation` and the records get ints, as in stock's 5.23 loop;
    - the streamer gets the kept tokens from that read (stock: `valid_tokens.cpu()`, same values and shape);
    - the loop condition and the end-of-round criteria are folded into the same read (`FoldedCriteria`);
    - prompt lookup runs on the host mirror (`lookup.HostLookup`), the assistant's generate() as a deferred draft
      (`draft.DraftRun`);
    - the candidate mask is tagged with the call's mask summary, so the verify forward's SDPA check reads the
      host (`masking.py`);
    - the verify forward of the rounds after the first replays from CUDA graphs where `piecewise.forward_for` proves
      it exact (it runs `model` / `model_forward` otherwise, as stock);
    - `synced_gpus` and encoder-decoder models are not ported: such calls run stock (`why_stock`).
    """
    from transformers.generation import candidate_generator as cg_module
    from transformers.generation.utils import ALL_CACHE_NAMES, GenerateDecoderOnlyOutput, _split_model_outputs

    device = input_ids.device
    do_sample = generation_config.do_sample
    output_attentions = generation_config.output_attentions
    output_hidden_states = generation_config.output_hidden_states
    output_scores = generation_config.output_scores
    output_logits = generation_config.output_logits
    return_dict_in_generate = generation_config.return_dict_in_generate

    scores = () if (return_dict_in_generate and output_scores) else None
    raw_logits = () if (return_dict_in_generate and output_logits) else None
    decoder_attentions = () if (return_dict_in_generate and output_attentions) else None
    decoder_hidden_states = () if (return_dict_in_generate and output_hidden_states) else None

    cur_len = input_ids.shape[1]
    if port.cache_position:
        model_kwargs = model._get_initial_cache_position(cur_len, device, model_kwargs)

    folded = FoldedCriteria(stopping_criteria)
    eos_cut = getattr(generation_config, "_eos_token_tensor", None) if port.eos_cut else None
    ensemble_weight = generation_config.assistant_ensemble_weight if port.ensemble else None
    box = RoundBox(device)
    graphed = GraphedAcceptance(device, eos_cut, folded.eos_ids, port.budget, path_report._current())
    rng = RngGuard(device)
    mirror = Mirror(input_ids, foreign=_foreign(logits_processor))  # the one read of the prompt per call
    # a static cache (5.24+) is never written past its end: each round's reach is checked before its forward
    room = Room(cache_kwarg.get(model_kwargs) if port.record_past else None)
    lookup = draft = None
    if type(candidate_generator) is cg_module.PromptLookupCandidateGenerator:
        lookup = HostLookup(candidate_generator, mirror, device)
        get_candidates = lookup.get_candidates
    else:
        draft = DraftRun(candidate_generator, mirror, outer_mask_summary(model_kwargs))
        draft.install()
        get_candidates = candidate_generator.get_candidates
    mask_key = "attention_mask"
    model_forward = model.__call__
    if port.decode_compiled and model._valid_auto_compile_criteria(model_kwargs, generation_config):
        model_forward = model.get_compiled_call(generation_config.compile_config)
    # the verify forward of the rounds after the first: replayed from CUDA graphs, K tokens wide, where `piecewise`
    # proves it exact (the releases of the package's own dynamic-cache loop); the first round's is the prefill
    verify = None
    if matches("dynamic decode loop"):
        verify = piecewise.forward_for(model, model_forward, generation_config, verify=True)

    try:
        is_first_iteration = True
        stop = False
        zero = None
        while not stop:
            cur_len = input_ids.shape[1]

            # 1. candidates
            args = (is_first_iteration,) if port.first_iteration_arg else ()
            candidate_input_ids, candidate_logits = get_candidates(input_ids, *args)
            candidate_input_ids = candidate_input_ids.to(model.device)
            if candidate_logits is not None:
                candidate_logits = candidate_logits.to(model.device)
            candidate_length = candidate_input_ids.shape[1] - input_ids.shape[1]
            is_done_candidate = stopping_criteria(candidate_input_ids, None) if port.done_candidate else None

            # 2. verify
            candidate_kwargs = copy.copy(model_kwargs)
            candidate_kwargs = cg_module._prepare_attention_mask(
                candidate_kwargs, candidate_input_ids.shape[1], model.config.is_encoder_decoder)
            _tag_grown(model_kwargs.get(mask_key), candidate_kwargs.get(mask_key))
            candidate_kwargs = cg_module._prepare_token_type_ids(candidate_kwargs, candidate_input_ids.shape[1])
            if port.position_ids and (position_ids := candidate_kwargs.get("position_ids")) is not None \
                    and candidate_length > 0:
                new_length = candidate_length + position_ids.shape[-1]
                candidate_kwargs = cg_module._prepare_position_ids(
                    candidate_kwargs, new_length, model.config.is_encoder_decoder)
            if port.cache_position and "cache_position" in candidate_kwargs:
                candidate_kwargs["cache_position"] = torch.cat(
                    (candidate_kwargs["cache_position"],
                     torch.arange(cur_len, cur_len + candidate_length, device=device, dtype=torch.long)),
                    dim=0,
                )
            extra = {}
            if port.next_sequence_length:
                extra["next_sequence_length"] = candidate_length + 1 if not is_first_iteration else None
            if port.first_iteration_kwarg:
                extra["is_first_iteration"] = is_first_iteration
            model_inputs = model.prepare_inputs_for_generation(candidate_input_ids, **extra, **candidate_kwargs)
            if "logits_to_keep" in model_inputs:
                model_inputs["logits_to_keep"] = candidate_length + 1
            room.check(model_inputs)
            if is_first_iteration:
                outputs = model(**model_inputs)
            elif not port.decode_compiled:
                outputs = (verify or model)(**model_inputs)
            else:
                with model._optimize_model_for_decode():
                    outputs = (verify or model_forward)(**model_inputs)
            if port.decode_compiled and is_first_iteration and not cache_kwarg.of_output(outputs).is_croppable:
                raise ValueError("Assisted decoding requires a cache that can be cropped to restore the states after "
                                 "draft verification")

            new_logits = outputs.logits[:, -candidate_length - 1:].to(dtype=torch.float32, device=device)
            next_token_logits = new_logits.clone()
            if len(logits_processor) > 0:
                for i in range(candidate_length + 1):
                    new_logits[:, i, :] = logits_processor(candidate_input_ids[:, : cur_len + i], new_logits[:, i, :])

            # 3. acceptance, on the device: a greedy round's replayed from the graph of its width
            candidate_new_tokens = candidate_input_ids[:, cur_len:]
            skipped = None
            probs = draft.take_probs() if draft is not None else None
            budget = generation_config.max_length - cur_len if port.budget else None
            why = graphed.why_not(do_sample, candidate_logits, ensemble_weight, is_done_candidate, probs, input_ids)
            replayed = graphed.run(new_logits, candidate_new_tokens, input_ids, budget, is_done_candidate) \
                if why is None else graphed.note_eager(why)
            if replayed is not None:
                tokens, packed = replayed
                box.send_packed(packed)
            elif do_sample and candidate_logits is not None:
                tokens, n_matches, skipped = acceptance.speculative(
                    candidate_new_tokens, candidate_logits, candidate_length, new_logits, ensemble_weight,
                    is_done_candidate, rng)
                is_done = None  # `speculative` applied it
            else:
                tokens, n_matches = acceptance.select(new_logits, candidate_new_tokens, candidate_logits,
                                                      candidate_length, do_sample, ensemble_weight)
                is_done = is_done_candidate
            if replayed is None:
                length = acceptance.accepted_length(n_matches, tokens, is_done, budget, eos_cut)
                eos_stop = acceptance.last_is_eos(input_ids, tokens, length, folded.eos_ids) if folded.eos_ids else None
                if zero is None:
                    zero = length.new_zeros(())  # copied into the round's box, never written: one per call
                box.send([length, zero if eos_stop is None else eos_stop, zero if skipped is None else skipped],
                         tokens[0], None if probs is None else acceptance.probabilities_as_int64(probs))

            # 4. the round's one read; stock's host code from here on, with ints
            values = box.receive()
            kept, eos_stop, skipped = int(values[0]), bool(values[1]), bool(values[2])
            if skipped:
                rng.restore()  # 4.57-5.17 speculative: stock drew nothing in this branch
            n_matches = kept - 1
            new_tokens = torch.from_numpy(values[HEADER:HEADER + kept].copy()).unsqueeze(0)
            valid_tokens = tokens[:, :kept]
            input_ids = torch.cat((input_ids, valid_tokens), dim=-1)
            mirror.extend(new_tokens, input_ids)
            if streamer is not None:
                streamer.put(new_tokens)
            new_cur_len = input_ids.shape[1]

            if port.record_past:
                if not port.crop_positive_only or candidate_length - n_matches > 0:
                    cache_kwarg.of_output(outputs).crop(-(candidate_length - n_matches))
                room.advance(model_inputs, candidate_length - n_matches)
            else:
                cache_kwarg.of_output(outputs).crop(new_cur_len - 1)

            if probs is not None:
                start = HEADER + tokens.shape[1]
                candidate_generator.probs.extend(acceptance.int64_as_probabilities(values[start:start + probs.numel()]))
            candidate_generator.update_candidate_strategy(input_ids, new_logits, n_matches)

            model_kwargs = model._update_model_kwargs_for_generation(
                outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder, num_new_tokens=n_matches + 1)

            if return_dict_in_generate:
                newly_added_length = n_matches + 1
                if output_scores:
                    scores += tuple(new_logits[:, i, :] for i in range(newly_added_length))
                if output_logits:
                    raw_logits += tuple(next_token_logits[:, i, :] for i in range(newly_added_length))
                newly_added_length = new_cur_len if is_first_iteration else newly_added_length
                if output_attentions and outputs.attentions[0] is not None:
                    decoder_attentions = _split_model_outputs(
                        decoder_attentions, outputs.attentions, cur_len, newly_added_length, is_decoder_attention=True)
                if output_hidden_states:
                    decoder_hidden_states = _split_model_outputs(
                        decoder_hidden_states, outputs.hidden_states, cur_len, newly_added_length)

            stop = folded.on_host(input_ids, scores) or eos_stop
            is_first_iteration = False
    finally:
        graphed.close()
        if draft is not None:
            draft.uninstall()

    if streamer is not None:
        streamer.end()

    if (
        type(candidate_generator) is cg_module.AssistedCandidateGenerator
        and candidate_generator.assistant_model.generation_config.num_assistant_tokens_schedule == "heuristic"
    ):
        candidate_generator.assistant_model.generation_config.num_assistant_tokens = (
            candidate_generator.num_assistant_tokens
        )
    if not return_dict_in_generate:
        return input_ids
    if port.cache_in_kwargs_only:
        cache = model_kwargs.get("past_key_values")
    else:
        cache = next((model_kwargs[name] for name in ALL_CACHE_NAMES if name in model_kwargs), None)
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                     attentions=decoder_attentions, hidden_states=decoder_hidden_states,
                                     **cache_kwarg.output_field(cache))


def _foreign(processors) -> bool:
    """Is the sequence handed to code outside transformers (a user's logits processor, which may write it in
    place)? transformers' own processors only read it. The draft's processors are the same list."""
    return any(not type(p).__module__.startswith("transformers.") for p in processors or ())


def _tag_grown(before, after) -> None:
    """The verify's candidate mask is the call's mask followed by ones: it shares the call's mask summary."""
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or after is before:
        return
    tag = _tag_of(before)
    if tag is not None and after.dim() == 2 and after.shape[-1] >= before.shape[-1]:
        _tag(after, tag[0], after.shape[-1])
