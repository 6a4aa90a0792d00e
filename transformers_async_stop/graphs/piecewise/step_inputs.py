"""The per-step input checks of the piecewise forward (`forward.PiecewiseForward`): which of a step's inputs a
replay takes, the attention's mask as stock's forward would make it, and the step's recording key; or why the step
runs eagerly. A decoder-only step (`_step`) and an encoder-decoder's decoder step (Whisper's: `_encoder_decoder_step`).
"""

from __future__ import annotations

import torch

from ...release_checks import cache_kwarg
from . import mask_kind, settings, steps
from .proof import attention
from .proof.observed import why_not_cache

# the step's inputs a recording takes; the cache's keyword is the running release's (`cache_kwarg.name()`)
_INPUTS = frozenset(("input_ids", "position_ids", "attention_mask", "use_cache", "logits_to_keep", "return_dict"))
# an encoder-decoder's decoder step (Whisper's, BART's, T5's): the decoder's ids (its positions are the piecewise
# forward's, stock's own values: `_encoder_decoder_step`), its mask where None, the encoder's outputs and
# `attention_mask` (from which each replay makes the cross-attention mask as stock's decoder makes it:
# `recording.Recording.replay`), the cache
_ENCODER_DECODER_INPUTS = frozenset(("decoder_input_ids", "decoder_attention_mask", "encoder_outputs", "use_cache",
                                     "return_dict", "attention_mask"))


class StepInputs:
    """`PiecewiseForward`'s step checks (a mixin: they read the forward's model, device, role and state)."""

    def _step(self, inputs):
        """(the attention's mask, the recording key, None), or (None, None, why this step runs eagerly). For a
        forward of K > 1 tokens the "mask" is the step's own (2D or None), from which each replay makes stock's."""
        if self.encoder_decoder:
            return self._encoder_decoder_step(inputs)
        cache = cache_kwarg.get(inputs)
        if (not _INPUTS.issuperset(name for name in inputs if name != cache_kwarg.name())
                or inputs.get("return_dict", True) is not True):
            if "tokenizer" in inputs:
                # generate(tokenizer=..., stop_strings=...) hands the tokenizer on to every forward, which passes it
                # down to the attention functions; the recording takes tensors and scalars only
                return None, None, ("the forward is handed `tokenizer` (generate() passes it on with stop_strings): "
                                    "pass stopping_criteria=[StopStringCriteria(tokenizer, stop_strings)] instead of "
                                    "tokenizer= and stop_strings= for the graphed forward")
            return None, None, "inputs the recording does not take"
        if "return_dict" not in inputs and getattr(self.model.config, "return_dict", True) is not True:
            # the verify call passes none: stock's forward then returns a tuple (`can_return_tuple`), a replay an
            # output object
            return None, None, "config.return_dict is off"
        ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
        if positions is None:
            # its forward takes no `position_ids` (Whisper's decoder): it finds the positions itself, from the cache
            return None, None, "a forward without position_ids (the model finds the positions itself)"
        keep = inputs.get("logits_to_keep", 0)
        if not (steps.row(ids, self.device) and steps.row(positions, self.device) and positions.shape == ids.shape
                and (ids.shape[1] == 1 or self.wide)):
            return None, None, "not a one-token decode step"
        width = ids.shape[1]
        if self.wide and ids.shape[0] != 1:
            return None, None, f"a {self.role} batch other than 1"
        if inputs.get("use_cache", True) is not True or type(keep) is not int:
            return None, None, "inputs the recording does not take"
        why = why_not_cache(cache)
        if why is not None:
            return None, None, why
        if len(cache.layers) != len(self.modules) or not cache.layers[0].is_initialized:
            return None, None, "a cache not filled by this model's prefill"
        self.impl = impl = getattr(self.model.config, "_attn_implementation", None)
        mask, kind, why = mask_kind.of_step(inputs.get("attention_mask"), ids.shape[0], cache, self.model.config, impl,
                                            width, self.remakes_padded)
        if why is not None:
            return None, None, why
        # autocast of the model's device (`is_autocast_enabled()` alone is CUDA's: a CPU model's recording under CPU
        # autocast, emulated, would have replayed its casts in a call without it)
        if torch.is_grad_enabled() or torch.is_autocast_enabled() or torch.is_autocast_enabled(self.device.type):
            return None, None, "gradients or autocast enabled"
        return mask, self._key(ids, width, positions.dtype, kind, keep), None

    def _encoder_decoder_step(self, inputs):
        """`_step` for the decoder of an encoder-decoder model (Whisper's): one token, the decoder's ids, no decoder
        mask, the encoder's outputs given (the encoder does not run), a plain `EncoderDecoderCache` filled by the
        prefill (every layer's cross-attention written: `is_updated`), SDPA. The positions are the self-attention
        cache's host length (`step_length`): stock's decoder makes them from that very value."""
        from transformers.modeling_outputs import BaseModelOutput

        cache = cache_kwarg.get(inputs)
        if not _ENCODER_DECODER_INPUTS.issuperset(name for name in inputs if name != cache_kwarg.name()):
            if "decoder_position_ids" in inputs:
                return None, None, "an encoder-decoder step handed its decoder's positions"
            return None, None, "inputs the recording does not take"
        if inputs.get("return_dict", True) is not True or (
                "return_dict" not in inputs and getattr(self.model.config, "return_dict", True) is not True):
            return None, None, "inputs the recording does not take"
        if inputs.get("decoder_attention_mask") is not None:
            return None, None, "a decoder attention mask"
        ids, encoder = inputs.get("decoder_input_ids"), inputs.get("encoder_outputs")
        if not (steps.row(ids, self.device) and ids.shape[1] == 1):
            return None, None, "not a one-token decode step"
        if not _encoder_outputs(encoder, BaseModelOutput):
            return None, None, "no encoder outputs (the encoder would run)"
        if inputs.get("use_cache", True) is not True:
            return None, None, "inputs the recording does not take"
        from transformers.cache_utils import EncoderDecoderCache

        if type(cache) is not EncoderDecoderCache or "update" in vars(cache):
            return None, None, f"a {type(cache).__name__}"
        why = why_not_cache(cache.self_attention_cache) or why_not_cache(cache.cross_attention_cache)
        if why is not None:
            return None, None, why
        layers = len(self.modules) // 2
        own, cross = cache.self_attention_cache.layers, cache.cross_attention_cache.layers
        if (len(own) != layers or len(cross) != layers or not all(layer.is_initialized for layer in own)
                or not all(layer.is_initialized for layer in cross)
                or not all(cache.is_updated.get(index) is True for index in range(layers))):
            return None, None, "a cache not filled by this model's prefill"
        self.impl = impl = getattr(self.model.config, "_attn_implementation", None)
        if impl != "sdpa":
            return None, None, f"an encoder-decoder's attention implementation {impl!r} (its masks made in the forward)"
        if torch.is_grad_enabled() or torch.is_autocast_enabled() or torch.is_autocast_enabled(self.device.type):
            return None, None, "gradients or autocast enabled"
        # stock's decoder reads it as `cache.get_seq_length()` (the self-attention cache's), on the host
        self.step_length = cache.get_seq_length()
        # no mask: SDPA's own causal path for one query (`steps.attention_mask`), the kind True
        key = self._key(ids, 1, torch.long, True, 0)
        cut, _ = attention.cut_of(type(self.modules[0]))
        if cut is None or cut.bias is None:
            # no piece of Whisper's or BART's family reads the encoder's length (their cross-attentions, its mask
            # included, run eagerly at every replay on the step's own tensors): one recording serves every source length
            return None, key, None
        # the encoder's length, before the dtype (last, `_record`): a cut with a position bias (T5's) bakes it into a
        # piece (its cross-attention bias, zeros of that length)
        return None, key[:-1] + (("encoder length", encoder.last_hidden_state.shape[1]),) + key[-1:], None

    def _key(self, ids, width, positions_dtype, kind, keep):
        """The recording key of a step (see `_step`)."""
        return (ids.shape[0], width, ids.dtype, positions_dtype, self.device,
                # how the replay gets its masks (`mask_kind.of_step`)
                kind, keep,
                # every torch setting that can change a kernel's choice or its numerics (`settings.py`)
                settings.read(),
                # buffers recorded under inference mode are inference tensors: a replay outside it cannot write them
                # (the CUDA usage fuzzer: seeds 422, 775, 1447, 1899), and the reverse would hand inference-mode
                # callers normal tensors where stock gives inference ones
                torch.is_inference_mode_enabled(),
                # factory calls without a device inside the pieces were recorded on this default device
                steps.default_device(),
                # the model's dtype, last (`_record` puts the one of the embedding module as it watches it then)
                self.embeddings.weight.dtype)


def _encoder_outputs(encoder, plain_type) -> bool:
    """The encoder's outputs as a replay hands them on (`recording.ENCODER_FIELDS`, read by attribute): stock's
    `BaseModelOutput` (`plain_type`), or another output holding its last hidden state alone (T5's stack returns a
    `BaseModelOutputWithPastAndCrossAttentions`, which stock's forward wraps as `BaseModelOutput(encoder_outputs[0],
    encoder_outputs[1] if ..., ...)`: by position, so the same fields only where no other is set)."""
    from transformers.utils import ModelOutput

    from .recording import ENCODER_FIELDS

    if type(encoder) is not plain_type and not (
            isinstance(encoder, ModelOutput) and list(encoder.keys()) == ["last_hidden_state"]
            # the fields a replay's output reads from it exist, None as in the `BaseModelOutput` stock makes
            and all(getattr(encoder, source, False) is None for source in ENCODER_FIELDS.values()
                    if source != "last_hidden_state")):
        return False
    return isinstance(encoder.last_hidden_state, torch.Tensor)
