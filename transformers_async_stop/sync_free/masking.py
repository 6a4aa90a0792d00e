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

Under torch.compile or export every wrapper here that can run inside a forward returns the original's answer before
it looks at a tensor attribute or the call state (`call_state.compiling`), so importing the package changes no traced graph. Nothing
here allocates per step: the stand-in is one CPU buffer per call, updated in place.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from . import static_mask
from ..undo.cache_rollback import loop_cache
from .kwargs_update import KwargsUpdate
from ..state.call_state import CALL, compiling
from ..config import _mark, force_deferred

_TAG = "_transformers_async_stop_mask"


class MaskSummary:
    """Host-side description of a generate() attention mask: the prompt part, then ones.

    `columns` is a (2, prompt_length) CPU bool tensor: row 0 = column is all True, row 1 = column has a True.
    """

    __slots__ = ("columns", "prompt_length", "batch_size", "padded", "_buffer", "_valid", "_view", "_view_length")

    def __init__(self, mask: torch.Tensor):
        as_bool = mask.to(torch.bool)
        # the one device read of the call: 2 x prompt_length booleans
        self.columns = torch.stack((as_bool.all(0), as_bool.any(0))).cpu()
        self.padded = not bool(self.columns[0].all())  # some row has a zero (read here, with the call's one read)
        self.prompt_length = mask.shape[-1]
        self.batch_size = mask.shape[0]
        self._buffer = None  # the stand-in's storage, (2, capacity), grown rarely
        self._valid = 0  # columns of `_buffer` that hold the prompt or ones; zeros after
        # the last view handed out, reused while the total length stays (a static cache); a dynamic cache grows it
        self._view, self._view_length = None, -1

    def stand_in(self, valid_length: int, total_length: int) -> torch.Tensor | None:
        """(2, total_length) CPU stand-in: prompt columns, ones up to valid_length, zero padding after."""
        if valid_length < self.prompt_length:
            return None
        buffer = self._buffer
        width = max(valid_length, total_length)
        if buffer is None or buffer.shape[1] < width:
            # a call grows the mask by one column per step: allocate with room for many steps at once
            capacity = max(width, 2 * (0 if buffer is None else buffer.shape[1]), self.prompt_length + 128)
            buffer = self._buffer = torch.zeros((2, capacity), dtype=torch.bool, device="cpu")
            buffer[:, : self.prompt_length] = self.columns
            self._valid, self._view_length = self.prompt_length, -1
        if valid_length != self._valid:
            low, high = sorted((self._valid, valid_length))
            buffer[:, low:high] = valid_length > self._valid
            self._valid = valid_length
        if self._view_length != total_length:
            self._view, self._view_length = buffer[:, :total_length], total_length
        return self._view


def _tag(tensor, summary: MaskSummary, valid_length: int) -> None:
    try:
        setattr(tensor, _TAG, (summary, valid_length))
    except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes: they stay on the stock path
        pass


def _tag_of(tensor):
    if not isinstance(tensor, torch.Tensor):
        return None
    tag = getattr(tensor, _TAG, None)
    if tag is not None:
        return tag
    base = tensor._base
    if base is not None and base.shape == tensor.shape:
        # a same-shape view (GPT-2 does `attention_mask.view(batch_size, -1)`) has the same content
        tag = getattr(base, _TAG, None)
        if tag is not None:
            return tag
    state = CALL.get()
    fed = state.fed_mask() if state is not None and state.fed_mask is not None else None
    if (fed is not None and fed.device != tensor.device and fed.shape == tensor.shape
            and fed.dtype == tensor.dtype):
        return getattr(fed, _TAG, None)  # the fed mask, moved by accelerate to its main device
    return None


_LEAN_KWARGS = frozenset(("is_encoder_decoder", "num_new_tokens"))


def _worth_it(tensor: torch.Tensor) -> bool:
    # Reading a CPU tensor costs nothing; keep the stock path there unless the deferred path is forced (tests).
    return tensor.device.type != "cpu" or force_deferred()


def patched_update_model_kwargs(original, target):
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        before = model_kwargs.get("attention_mask")
        state = CALL.get()
        lean = state.ctl.kwargs_update if state is not None and state.ctl is not None else None
        if lean is not None and not args and kwargs.get("num_new_tokens", 1) == 1 and kwargs.keys() <= _LEAN_KWARGS:
            updated = lean(outputs, model_kwargs, kwargs.get("is_encoder_decoder", False))
        else:
            updated = original(self, outputs, model_kwargs, *args, **kwargs)
        if state is None or not isinstance(updated, dict):
            return updated
        ctl = state.ctl
        if ctl is not None and not ctl.planned:
            ctl.planned = True  # after the first forward: the loop's cache exists now
            cache = loop_cache(updated)
            # 4.57-5.3 create `cache_position` inside the decoding method: after the prefill's update it is where the
            # first decode step writes (a static layer of those releases writes there)
            position = updated.get("cache_position")
            if isinstance(position, torch.Tensor) and position.numel() == 1:
                ctl.next_position = position
            ctl.see_cache(cache)
            if cache is not None and static_mask.register(self, cache, ctl.device):
                ctl.cleanups.append(lambda: static_mask.release(cache))
            ctl.kwargs_update = KwargsUpdate.for_model(self)
        after = updated.get("attention_mask")
        if (
            isinstance(before, torch.Tensor)
            and isinstance(after, torch.Tensor)
            and after is not before
            and before.dim() == 2
            and after.dim() == 2
            and after.shape[0] == before.shape[0]
            and after.shape[-1] > before.shape[-1]
            and not self.config.is_encoder_decoder
            and _worth_it(after)
        ):
            tag = _tag_of(before)
            summary = tag[0] if tag is not None else MaskSummary(before)
            # stock appends `new_ones` columns: the grown mask is the old one followed by ones
            _tag(after, summary, after.shape[-1])
            state.fed_mask = weakref.ref(after)
        return updated

    return _mark(_update_model_kwargs_for_generation, original)


def _mask_param_index(original) -> int | None:
    params = list(inspect.signature(original).parameters)
    return params.index("attention_mask") if "attention_mask" in params else None


def patched_preprocess_mask_arguments(original, target):
    index = _mask_param_index(original)

    def _preprocess_mask_arguments(*args, **kwargs):
        result = original(*args, **kwargs)
        if compiling():
            return result
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
        if compiling():
            return result
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
        if compiling():
            return original(padding_mask, *args, **kwargs)
        tag = _tag_of(padding_mask)
        if tag is not None:
            summary, valid_length = tag
            if padding_mask.dim() == 2 and padding_mask.shape[0] == summary.batch_size:
                stand_in = summary.stand_in(valid_length, padding_mask.shape[-1])
                if stand_in is not None:
                    try:
                        return original(stand_in, *args, **kwargs)
                    except RuntimeError:  # e.g. a device tensor offset that cannot index a CPU stand-in: stock
                        pass
        return original(padding_mask, *args, **kwargs)

    return _mark(_ignore_mask_sdpa, original)
