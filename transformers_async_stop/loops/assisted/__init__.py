"""Assisted decoding (a draft model, greedy or speculative sampling) and prompt lookup with the flag: one blocking
read per verify round, none per drafted token.

- `loop.py`: the verify loop, ported per release (`loop.PORTS`), with the acceptance on the device and the round's
  verdict in one pinned copy (`acceptance.py`);
- `draft.py`: the assistant's own `generate()` as a deferred draft loop, and its per-call preamble without reads;
- `lookup.py`: prompt lookup on a host copy of the sequence.

This module is the entry: `_assisted_decoding` decides whether the call can take the deferred path, builds the
candidate generator as stock does, and either runs `loop.run` or hands the very same generator to the stock loop
(`_get_candidate_generator` gives back the one built, so its constructor, which 4.57 lets write into the assistant's
config, runs once). What stays stock, with one `StockPathWarning`: any release whose loop sources were not ported
(`targets.SHORTCUTS`), universal assisted decoding and the other candidate generators, stopping criteria other than
max length, max time and EOS, `synced_gpus`, encoder-decoder models, and prompt lookup with a logits processor that
can forbid candidates.
"""

from __future__ import annotations

from ...release_checks import cache_kwarg
from ...state.call_state import CALL
from ... import path_report
from ...config import _mark
from ...control.stock_path import runs_stock, warn_stock
from ...undo.module_state import why_stateful
from . import loop


def _why_stock(model, generation_config, synced_gpus, stopping_criteria, input_ids, kwargs) -> str | None:
    if loop.installed_port() is None:
        return "this transformers release's assisted decoding loop is not one the deferred path was ported from"
    if synced_gpus:
        return "assisted decoding with `synced_gpus=True` is not made async"
    assistant = kwargs.get("assistant_model")
    for checked in (model, assistant):
        reason = why_stateful(checked) if checked is not None else None
        if reason is not None:
            return reason
    if model.config.is_encoder_decoder or (assistant is not None and assistant.config.is_encoder_decoder):
        return "assisted decoding with an encoder-decoder model is not made async yet"
    name = loop.unfoldable(stopping_criteria)
    if name is not None:
        return (f"assisted decoding with the stopping criterion {name}, whose verdict cannot ride in the round's "
                "one read, is not made async yet")
    if input_ids.shape[0] != 1:
        return ""  # stock raises: batch size 1 only
    return None


class _Parked:
    """A candidate generator built by the deferred path's checks and handed to the stock loop."""

    __slots__ = ("generator",)

    def __init__(self, generator):
        self.generator = generator


def patched_get_candidate_generator(original, target):
    def _get_candidate_generator(self, *args, **kwargs):
        state = CALL.get()
        if state is not None and isinstance(state.assisted, _Parked):
            parked, state.assisted = state.assisted, None
            return parked.generator
        return original(self, *args, **kwargs)

    return _mark(_get_candidate_generator, original)


def _preamble(model, port, generation_config, model_kwargs) -> None:
    """Copied from transformers v4.57.6-v5.24.0 `_assisted_decoding` (its checks before the candidate generator,
    per `port`; 5.24 drops the `use_cache` check and the static-cache refusal). Differences: none."""
    from transformers import StaticCache

    if port.decode_compiled:
        past = cache_kwarg.get(model_kwargs)
        if past is None:
            raise RuntimeError("Assisted decoding requires a cache")
        past.activate_past_recording()
        return
    if not model_kwargs["use_cache"]:
        raise ValueError("assisted generate requires `use_cache=True`")
    past = model_kwargs.get("past_key_values")
    if port.static_by_type:
        static = type(past) is StaticCache
    else:
        static = past is not None and hasattr(past, "layers") and any(
            getattr(layer, "is_compileable", False) for layer in past.layers)
    if generation_config.cache_implementation in ["static", "hybrid", "sliding_window"] or static:
        raise ValueError("assisted generate is not supported with Static cache classes`")
    if port.record_past:
        if past is None:
            raise RuntimeError("assisted decoding requires a cache")
        past.activate_past_recording()


def patched_assisted_decoding(original, target):
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config,
                           synced_gpus=False, streamer=None, **kwargs):
        def stock():
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=streamer, **kwargs)

        state = CALL.get()
        if state is None or state.ctl is not None or runs_stock(
                generation_config, input_ids.device,
                lambda: _why_stock(self, generation_config, synced_gpus, stopping_criteria, input_ids, kwargs),
                "prompt lookup" if kwargs.get("assistant_model") is None else "assisted"):
            return stock()

        from transformers.generation import candidate_generator as cg_module

        port = loop.installed_port()
        inputs_tensor = kwargs.pop("inputs_tensor", None)
        assistant_model = kwargs.pop("assistant_model", None)
        assistant_tokenizer = kwargs.pop("assistant_tokenizer", None)
        tokenizer = kwargs.pop("tokenizer", None)
        model_kwargs = kwargs
        _preamble(self, port, generation_config, model_kwargs)
        generator = self._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            assistant_model=assistant_model, logits_processor=logits_processor, target_tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer, model_kwargs=model_kwargs,
        )
        kind = type(generator)
        if kind is cg_module.PromptLookupCandidateGenerator:
            from .lookup import why_not_on_host

            reason = why_not_on_host(generator)
        elif kind is cg_module.AssistedCandidateGenerator:
            reason = None
        else:
            reason = f"assisted decoding with {kind.__name__} is not made async"
        if reason is not None:
            path_report.stock(reason)
            warn_stock(reason, stacklevel=3)
            state.assisted = _Parked(generator)
            try:
                return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                synced_gpus=synced_gpus, streamer=streamer, inputs_tensor=inputs_tensor,
                                assistant_model=assistant_model, assistant_tokenizer=assistant_tokenizer,
                                tokenizer=tokenizer, **model_kwargs)
            finally:
                state.assisted = None
        return loop.run(self, port, generator, input_ids, logits_processor, stopping_criteria, generation_config,
                        streamer, model_kwargs)

    return _mark(_assisted_decoding, original)
