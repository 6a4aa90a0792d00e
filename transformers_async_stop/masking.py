"""Sync-free SDPA mask-skip checks during `generate()`.

`masking_utils._ignore_causal_mask_sdpa` asks "is every entry of the padding mask True?" each forward
(`padding_mask.all()` in 5.0, `fast_all(padding_mask)` in 5.17+). On CUDA that is a blocking read of a device
tensor, every decode step, whenever a 2D mask is present (always in 5.0-5.17; with left padding in 5.18+).

During `generate()` the answer is already known on the host: the decode-time mask is the prompt mask followed by
columns of ones (`_update_model_kwargs_for_generation` appends them), optionally right-padded with zeros to
`kv_length` (`prepare_padding_mask`). So we keep, per `generate()` call, a host copy of the prompt mask reduced to
two rows (per column: all rows true / any row true; one device read per call, at the end of prefill), tag every
mask derived from it with that summary, and hand the stock check a small CPU stand-in with exactly the same
column structure. Every reduction the stock check performs (`.all()`, `fast_all`, slicing, `~`) gives the same
answer on the stand-in, so the decision is unchanged and no device tensor is read.

A mask we did not tag (a plain forward, a mask a model built itself, an encoder mask) goes to the stock check
untouched, so outside `generate()` behaviour is exactly stock. One kind of copy is recognised: a model dispatched by
accelerate moves its inputs to its main device at every forward (`AlignDevicesHook`), which makes a new, untagged
tensor. During `generate()`, a mask with the same shape and dtype as the one `generate()` is feeding, on another
device, is that copy and shares its tag.
"""

from __future__ import annotations

import contextvars
import inspect
import weakref

import torch

from .config import _mark, force_deferred
from .stop_check import ACTIVE

_TAG = "_transformers_async_stop_mask"


class FedMask:
    """Per `generate()` call: the tagged mask it feeds the model now, to recognise copies moved to another device."""

    __slots__ = ("latest",)

    def __init__(self):
        self.latest = None  # weakref to the tensor, so the holder never keeps a mask alive


FED: contextvars.ContextVar[FedMask | None] = contextvars.ContextVar("transformers_async_stop_fed_mask",
                                                                    default=None)


class MaskSummary:
    """Host-side description of a generate() attention mask: the prompt part, then ones.

    `columns` is a (2, prompt_length) CPU bool tensor: row 0 = column is all True, row 1 = column has a True.
    """

    __slots__ = ("columns", "prompt_length", "batch_size")

    def __init__(self, mask: torch.Tensor):
        as_bool = mask.to(torch.bool)
        # the one device read of the call: 2 x prompt_length booleans
        self.columns = torch.stack((as_bool.all(0), as_bool.any(0))).cpu()
        self.prompt_length = mask.shape[-1]
        self.batch_size = mask.shape[0]

    def stand_in(self, valid_length: int, total_length: int) -> torch.Tensor:
        """(2, total_length) CPU stand-in: prompt columns, ones up to valid_length, zero padding after."""
        grown = valid_length - self.prompt_length
        padded = total_length - valid_length
        parts = [self.columns]
        if grown > 0:
            parts.append(torch.ones((2, grown), dtype=torch.bool))
        if padded > 0:
            parts.append(torch.zeros((2, padded), dtype=torch.bool))
        return torch.cat(parts, dim=1) if len(parts) > 1 else self.columns


def _tag(tensor, summary: MaskSummary, valid_length: int) -> None:
    try:
        setattr(tensor, _TAG, (summary, valid_length))
    except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes: they stay on the stock path
        pass


def _tag_of(tensor):
    if not isinstance(tensor, torch.Tensor):
        return None
    tag = getattr(tensor, _TAG, None)
    base = tensor._base
    if tag is None and base is not None and base.shape == tensor.shape:
        # a same-shape view (GPT-2 does `attention_mask.view(batch_size, -1)`) has the same content
        tag = getattr(base, _TAG, None)
    if tag is None:
        fed = FED.get()
        source = fed.latest() if fed is not None and fed.latest is not None else None
        if (source is not None and source.device != tensor.device and source.shape == tensor.shape
                and source.dtype == tensor.dtype):
            tag = getattr(source, _TAG, None)  # the fed mask, moved by accelerate to its main device
    return tag


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _worth_it(tensor: torch.Tensor) -> bool:
    # Reading a CPU tensor costs nothing; keep the stock path there unless the deferred path is forced (tests).
    return tensor.device.type != "cpu" or force_deferred()


def patched_update_model_kwargs(original, target):
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        before = model_kwargs.get("attention_mask")
        updated = original(self, outputs, model_kwargs, *args, **kwargs)
        ctl = ACTIVE.get()
        if ctl is not None and isinstance(updated, dict):
            ctl.see_cache(updated.get("past_key_values"))
        after = updated.get("attention_mask") if isinstance(updated, dict) else None
        if (
            isinstance(before, torch.Tensor)
            and isinstance(after, torch.Tensor)
            and after is not before
            and before.dim() == 2
            and after.dim() == 2
            and after.shape[0] == before.shape[0]
            and after.shape[-1] > before.shape[-1]
            and not self.config.is_encoder_decoder
            and not _compiling()
            and _worth_it(after)
        ):
            tag = _tag_of(before)
            summary = tag[0] if tag is not None else MaskSummary(before)
            # stock appends `new_ones` columns: the grown mask is the old one followed by ones
            _tag(after, summary, after.shape[-1])
            fed = FED.get()
            if fed is not None:
                fed.latest = weakref.ref(after)
        return updated

    return _mark(_update_model_kwargs_for_generation, original)


def _mask_param_index(original) -> int | None:
    params = list(inspect.signature(original).parameters)
    return params.index("attention_mask") if "attention_mask" in params else None


def patched_preprocess_mask_arguments(original, target):
    index = _mask_param_index(original)

    def _preprocess_mask_arguments(*args, **kwargs):
        result = original(*args, **kwargs)
        mask = kwargs.get("attention_mask", args[index] if index is not None and len(args) > index else None)
        tag = _tag_of(mask)
        if tag is not None and isinstance(result, tuple) and len(result) > 1:
            converted = result[1]
            # the bool copy made by `.to(device, dtype=torch.bool)` has the same content
            if isinstance(converted, torch.Tensor) and converted.shape == mask.shape and converted is not mask:
                _tag(converted, *tag)
        return result

    return _mark(_preprocess_mask_arguments, original)


def patched_prepare_padding_mask(original, target):
    def prepare_padding_mask(attention_mask, kv_length, kv_offset, *args, **kwargs):
        result = original(attention_mask, kv_length, kv_offset, *args, **kwargs)
        tag = _tag_of(attention_mask)
        if tag is not None and isinstance(result, torch.Tensor) and result is not attention_mask:
            summary, valid_length = tag
            # right-padded with zeros to kv_length + kv_offset: the valid part keeps its length
            if result.shape[-1] >= attention_mask.shape[-1]:
                _tag(result, summary, valid_length)
        return result

    return _mark(prepare_padding_mask, original)


def patched_ignore_mask(original, target):
    """Shared by `_ignore_causal_mask_sdpa` and `_ignore_bidirectional_mask_sdpa`: same first argument."""

    def _ignore_mask_sdpa(padding_mask, *args, **kwargs):
        tag = _tag_of(padding_mask)
        if tag is not None and not _compiling():
            summary, valid_length = tag
            if padding_mask.dim() == 2 and padding_mask.shape[0] == summary.batch_size:
                stand_in = summary.stand_in(valid_length, padding_mask.shape[-1])
                try:
                    return original(stand_in, *args, **kwargs)
                except RuntimeError:  # e.g. a device tensor offset that cannot index a CPU stand-in: stock path
                    pass
        return original(padding_mask, *args, **kwargs)

    return _mark(_ignore_mask_sdpa, original)
