"""The forward's inputs of a dynamic-cache decode step, made from the previous step's without the generic machinery.

Copied from transformers v5.17.0-v5.24.0 `GenerationMixin.prepare_inputs_for_generation` and
`_update_model_kwargs_for_generation`, as they act on a decode step (one new token) of a decoder-only model whose
cache is not compileable. Per step stock appends `last + 1` to the position ids and a column of ones to the 2D
attention mask (when generate() kept one), then builds a new input dict: the last token sliced and cloned, the last
position sliced and cloned, the grown 2D mask, the cache object and every other keyword unchanged. The model builds
its 4D mask itself, inside its forward, from that 2D mask (or from none), exactly as in stock.

Here the first decode step's inputs come from the real `prepare_inputs_for_generation`, and each later step's are:
- `input_ids`: the step's token as a (batch, 1) view of the token vector (stock: `input_ids[:, -1:].clone()`, the
  same values, shape, dtype and strides);
- `position_ids`: the previous step's plus one (stock: a cat of `last + 1`, then a slice and a clone of it);
- `attention_mask`: the previous one with the call's one column of ones appended (stock: `new_ones` and a cat), tagged
  for the sync-free SDPA check (`masking.py`) as the patched `_update_model_kwargs_for_generation` tags it; for a
  padded batch of a model `wide_mask.applies` to, the 4D mask the model would build from it, grown by a column of
  True instead (`wide_mask.py`);
- every other entry: the object stock passes again (the cache, `use_cache`, `logits_to_keep`...).
The positions come from the tensor stock advances (generate()'s position ids, made from the mask or from the cache's
length); nothing here reads the device or derives a position from a host length.

An encoder-decoder's decoder (`encoder_decoder.py`) is advanced the same way under stock's names for it
(`ENCODER_DECODER`): `decoder_input_ids`, `decoder_position_ids` and `decoder_attention_mask` (where generate() was
given them), the encoder's `attention_mask` and `encoder_outputs` passed on as the objects `model_kwargs` holds (stock's
update never replaces them), no grown 4D mask.

Any input this does not know how to advance (another tensor such as `token_type_ids`, a mask stock did not pass
through unchanged, inputs moved to another device, a remote-code `cache_position`) leaves the loop on stock's own
`prepare_inputs_for_generation` and `_update_model_kwargs_for_generation` every step.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ...release_checks import cache_kwarg
from ...sync_free import masking
from ...state.call_state import CALL
from ..static_loop.inputs import _holds_tensor
from . import encoder_decoder, wide_mask


@dataclasses.dataclass(frozen=True)
class Keys:
    """The names stock gives the advanced inputs (`prepare_inputs_for_generation`,
    `_update_model_kwargs_for_generation`): a decoder-only model's, or an encoder-decoder's decoder's (whose
    `attention_mask` is the encoder's: passed on as the object `model_kwargs` holds, as `encoder_outputs` is)."""

    ids: str
    positions: str
    mask: str
    passed: tuple  # entries holding tensors that stock passes unchanged: the very objects of `model_kwargs`


DECODER_ONLY = Keys("input_ids", "position_ids", "attention_mask", ())
ENCODER_DECODER = Keys("decoder_input_ids", "decoder_position_ids", "decoder_attention_mask",
                       ("attention_mask", "encoder_outputs"))


class DecodeInputs:
    """The decode-step inputs of one loop; `next(tokens)` turns step t's into step t+1's."""

    __slots__ = ("inputs", "positions", "mask", "ones", "summary", "state", "wide", "wide_ones", "watch", "keys")

    def __init__(self, inputs: dict, positions, mask, keys: Keys = DECODER_ONLY):
        self.inputs = inputs
        self.keys = keys
        self.positions = positions
        self.mask = mask  # the 2D mask stock would pass (stale while `wide` is grown instead)
        self.ones = None if mask is None else mask.new_ones((mask.shape[0], 1))  # stock: `new_ones` every step
        # the grown mask carries the prompt mask's summary, as `masking.patched_update_model_kwargs` would tag it (it
        # tags no decoder mask of an encoder-decoder)
        tag = masking._tag_of(mask) if mask is not None and keys is DECODER_ONLY else None
        self.summary = tag[0] if tag is not None and masking._worth_it(mask) else None
        self.state = CALL.get()
        # the 4D mask handed to the forward instead of the 2D one (`wide_mask.py`): made at the first step it applies;
        # `wide_ones` is set where it applies (`build`)
        self.wide = self.wide_ones = self.watch = None

    @classmethod
    def build(cls, model, input_ids: torch.Tensor, model_kwargs: dict,
              model_forward=None) -> tuple[dict, "DecodeInputs | None"]:
        """The first decode step's inputs, from stock's `prepare_inputs_for_generation`, and the `DecodeInputs` that
        advances them (None: stock rebuilds them every step)."""
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
        if not encoder_decoder.prepares_generically(model, model_kwargs):
            # a model's own (`eligibility._OWN_INPUTS`, Whisper's with a decoder mask): called at every step, as
            # stock does
            return inputs, None
        keys = ENCODER_DECODER if model.config.is_encoder_decoder else DECODER_ONLY
        for key, value in inputs.items():
            if key in (keys.ids, keys.positions, keys.mask) or key == cache_kwarg.name():
                continue
            if key in keys.passed and value is model_kwargs.get(key):
                continue  # the object stock passes again at every step (its update never replaces it)
            if _holds_tensor(value):
                return inputs, None
        if cache_kwarg.get(inputs) is not cache_kwarg.get(model_kwargs):
            return inputs, None
        ids, positions, mask = inputs.get(keys.ids), inputs.get(keys.positions), inputs.get(keys.mask)
        if not _one_column(ids) or ids.device != input_ids.device:
            return inputs, None  # sliced differently, or moved to the model's device
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.shape[-1] != 1
                                      or positions.device != ids.device):
            return inputs, None
        if mask is not None and (mask is not model_kwargs.get(keys.mask) or mask.dim() != 2
                                 or mask.device != ids.device):
            return inputs, None
        made = cls(inputs, positions, mask, keys)
        cache = cache_kwarg.get(inputs)
        # the grown 4D mask is a decoder-only model's (Llama, Mistral, Qwen2: `wide_mask.applies`)
        made.watch = None if model_forward is None or keys is not DECODER_ONLY else wide_mask.applies(
            model, model_forward, cache, made.summary)
        if made.watch is not None:
            made.wide_ones = torch.ones((mask.shape[0], 1, 1, 1), dtype=torch.bool, device=mask.device)
            if cache.get_seq_length() + 1 == mask.shape[-1]:
                # the first decode step takes stock's 4D mask too, so that it replays the recording the later steps
                # replay (a padded 2D mask would keep it eager: "a padded 2D mask"); `self.mask` stays the 2D mask
                # stock passes, for a later step that hands the 2D mask again
                made.wide = inputs["attention_mask"] = wide_mask.first(mask)
        return inputs, made

    def next(self, column: torch.Tensor) -> dict:
        """Step t+1's inputs, given step t's tokens as the (batch, 1) column stock appended to `input_ids`."""
        inputs, keys = self.inputs, self.keys
        inputs[keys.ids] = column
        if self.positions is not None:
            self.positions = inputs[keys.positions] = self.positions + 1
        if self.wide_ones is not None and self._grow_wide():
            return inputs
        if self.mask is not None:
            self.mask = inputs[keys.mask] = torch.cat([self.mask, self.ones], dim=-1)
            if self.summary is not None:
                masking._tag(self.mask, self.summary, self.mask.shape[-1])
                if self.state is not None:
                    self.state.fed_mask = weakref.ref(self.mask)
        return inputs

    def _grow_wide(self) -> bool:
        """Hand the forward the grown 4D mask; False (the 2D mask again, from now on) once the cache and the mask no
        longer grow together."""
        wide, grown = self.wide, None
        if not self.watch.holds():
            wide = None  # a callback changed what the grown mask relies on (`wide_mask.Watch`)
        elif wide is None:  # the first grown step: stock's 2D mask with its new column, as stock's 4D mask
            grown = torch.cat([self.mask, self.ones], dim=-1)
            wide = wide_mask.first(grown)
        else:
            wide = torch.cat([wide, self.wide_ones], dim=-1)
        if wide is not None and cache_kwarg.get(self.inputs).get_seq_length() + 1 == wide.shape[-1]:
            self.wide = self.inputs["attention_mask"] = wide
            if grown is not None:
                self.mask = grown
            return True
        # a callback changed the cache's length, or something else the grown mask relies on: from here on the model
        # builds its mask from the 2D one, as stock.
        # `self.mask` is brought up to the last 4D mask handed out (stock's 2D mask of that step: ones appended)
        if self.wide is not None and self.wide.shape[-1] > self.mask.shape[-1]:
            self.mask = torch.cat([self.mask, self.ones.expand(-1, self.wide.shape[-1] - self.mask.shape[-1])], dim=-1)
        self.wide = self.wide_ones = None
        return False


def _one_column(tensor) -> bool:
    return (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] == 1
            and tensor.dtype == torch.long and tensor.is_contiguous())
