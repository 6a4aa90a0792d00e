"""Undoing the one extra decode step in a cache the caller will see.

Stock transformers can crop a `DynamicCache` (`Cache.crop(-n)` removes n positions in every 5.x release). It cannot
crop a `StaticCache` (no `crop`, `is_croppable` is False), which is exactly the cache that makes the flag pay off
(CUDA graphs). A static layer's extra step wrote one position of its preallocated keys/values and, from 5.4,
advanced the device counter `cumulative_length`; before, it wrote where `cache_position` said and the length is
derived from which positions are non-zero. Zeroing that position and stepping the counter back restores the
flag-off state bit for bit (the buffers start as zeros and the flag-off run never wrote there). The position is the
cache's own, never the sequence length: multi-turn callers feed only the tokens the cache lacks, or embeddings.

Sliding-window and recurrent layers overwrite state they cannot give back. 5.17+ can record that state
(`activate_past_recording`) and `DeferredStopCheck` relies on it; on older releases such a cache, when returned
to the caller, is reported as not rollbackable and the call runs the stock path. The dynamic-cache loop keeps a
dynamic cache's sliding-window layers as they were before each step instead (`StepSnapshot`: no tensor copied).
"""

from __future__ import annotations

import operator

import torch


def _layers(cache):
    inner = getattr(cache, "self_attention_cache", None)  # EncoderDecoderCache: the decoder's own cache
    cache = inner if inner is not None else cache
    return getattr(cache, "layers", None), cache


def _is_static_full(layer) -> bool:
    return (
        getattr(layer, "is_compileable", False)
        and not getattr(layer, "is_sliding", True)
        and hasattr(layer, "max_cache_len")
        and hasattr(layer, "keys")
    )


def _is_dynamic_full(layer) -> bool:
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def why_not_rollbackable(cache) -> str | None:
    """None if one decode step can be undone exactly in `cache`, else the reason (for the warning)."""
    if cache is None:
        return None
    layers, _ = _layers(cache)
    if layers is None:
        return f"{type(cache).__name__} has no `.layers`"
    for layer in layers:
        if not (_is_static_full(layer) or _is_dynamic_full(layer)):
            return f"{type(cache).__name__} holds a {type(layer).__name__}, which cannot give back an overwritten step"
    if len({_is_static_full(layer) for layer in layers}) > 1:
        return f"{type(cache).__name__} mixes static and dynamic layers"
    return None


def rollback_one_step(cache, position) -> None:
    """Give back the one position the extra step's forward wrote, so the cache holds what the flag-off run left.

    Where that position is comes from the cache, never from the sequence length: a caller may feed only the tokens
    the cache lacks, or `inputs_embeds`, and then the two differ. A layer with its own device counter (5.4+) wrote
    where the counter pointed: the counter steps back and that slot is cleared, on the device. A layer that writes
    where `cache_position` says (4.57-5.3) wrote at `position`, the extra step's cache position (a one-element device
    tensor, `AsyncStop.extra_position`). Either way no value is read on the host.
    """
    layers, inner = _layers(cache)
    if layers and not _is_static_full(layers[0]):
        # every release: a negative `crop` removes that many positions from every (dynamic) layer
        inner.crop(-1)
        _contiguous(layers)
        return
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() < 3:
            continue  # never initialised: the extra step could not have written here
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.sub_(1)
            slot = counter.reshape(1)
        elif isinstance(counter, int) and counter > 0:
            layer.cumulative_length = counter - 1
            slot = torch.tensor([counter - 1], device=keys.device)
        elif position is not None:
            slot = position.to(keys.device)
        else:
            continue
        # the buffers start as zeros and the flag-off run never wrote this slot
        keys.index_fill_(keys.dim() - 2, slot, 0)
        layer.values.index_fill_(layer.values.dim() - 2, slot, 0)


def contiguous_after_crop(cache) -> None:
    """`_contiguous` for every layer of `cache` (after a crop made elsewhere: stop_check.py)."""
    layers, _ = _layers(cache)
    _contiguous(layers)


def _contiguous(layers) -> None:
    """A cropped `DynamicLayer` holds a slice of its tensors (`keys[..., :-1, :]`, strided as one position more);
    stock's are the contiguous `torch.cat` of its last step. Copy them into contiguous tensors of the same values
    (once per call), so `keys.view(...)`, `torch.save` and whatever reads strides see stock's. Sliding-window layers
    keep a slice in stock too and are left as they are."""
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            continue
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                setattr(layer, name, tensor.contiguous())


def _is_dynamic_sliding(layer) -> bool:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return type(layer) is DynamicSlidingWindowLayer


def holds_sliding_layers(cache) -> bool:
    """Whether `cache` holds a `DynamicSlidingWindowLayer` (its extra step may have dropped a token: `StepSnapshot`)."""
    layers, _ = _layers(cache)
    return any(map(_is_dynamic_sliding, layers or ()))


class StepSnapshot:
    """The layers of a dynamic cache with sliding-window layers, as they were before the latest decode step's forward:
    the dynamic-cache loop's exact undo of its one extra step (`loops/dynamic_loop/loop.py`).

    A `DynamicSlidingWindowLayer` keeps the last `sliding_window - 1` positions. Once it holds that many, the extra
    step's `update` drops the oldest one (`full[:, :, -sliding_window + 1:]` of the concatenation), which no crop can
    give back (its `crop` refuses a full window without a recorded past). Its `update` (as a `DynamicLayer`'s) never
    writes into a tensor it held: it binds new ones (`torch.cat`, then a slice of it) to `keys` / `values` and counts
    `cumulative_length` up; lazy initialisation binds the rest (5.17.0-5.24.0, digests in
    `targets/piecewise_rows.py` "dynamic decode loop (sliding layers)"). So the layers' attribute dicts as they were
    before the step (a shallow copy each, per step: no tensor is copied) hold exactly the objects the flag-off run's
    cache holds after its last step: the same tensors (values, shapes, strides: stock's slices stay slices), and the same
    counters. Every layer of such a cache is kept this way, its full-attention `DynamicLayer`s too (their previous
    tensors are the contiguous concatenations stock holds, with no crop and copy). The step's position is the cache's,
    never read from the sequence."""

    __slots__ = ("cache", "layers", "saved")

    def __init__(self, cache):
        layers, _ = _layers(cache)
        self.cache = cache
        self.layers = list(layers)
        self.saved = None

    def save(self) -> None:
        """Before a decode step's forward: each layer's attributes as they are now (shallow copies)."""
        self.saved = list(map(dict.copy, map(vars, self.layers)))

    def restore(self, cache) -> bool:
        """After the extra step's forward: each layer as it was before it. False (nothing done) where `cache` is not
        the one saved, or its layers are not the ones saved (a callback replaced them)."""
        layers, _ = _layers(cache)
        if (self.saved is None or cache is not self.cache or layers is None or len(layers) != len(self.layers)
                or any(map(operator.is_not, layers, self.layers))):
            return False
        for layer, saved in zip(self.layers, self.saved):
            state = vars(layer)
            state.clear()
            state.update(saved)
        self.saved = None
        return True


def holds_static_layers(cache) -> bool:
    """Whether `cache` (one `why_not_rollbackable` accepts) is made of full-attention static layers."""
    layers, _ = _layers(cache)
    return bool(layers) and _is_static_full(layers[0])


def clear_cropped_slots(cache, steps: int) -> None:
    """After `cache.crop(-steps)`: clear the slots the crop gave back in every static layer.

    5.24 makes static layers croppable (`StaticLayer`, `StaticSlidingWindowLayer` while it never went past its
    window, `StaticIndexedLayer`), and their `crop()` only moves the counters back: the undone steps' keys and values
    stay in the preallocated buffers, where the flag-off run never wrote (zeros there). The slots are the ones the
    counters point at after the crop, on the device; no value is read on the host.
    """
    if steps <= 0:
        return
    layers, _ = _layers(cache)
    for layer in layers or ():
        keys, counter = getattr(layer, "keys", None), getattr(layer, "cumulative_length", None)
        if not (getattr(layer, "is_compileable", False) and hasattr(layer, "max_cache_len")
                and isinstance(keys, torch.Tensor) and keys.dim() >= 3 and isinstance(counter, torch.Tensor)):
            continue  # not a static layer, or never initialised
        written = getattr(layer, "cumulative_length_int", None)
        if isinstance(written, int) and written + steps > keys.shape[-2]:
            continue  # a sliding layer past its window: not croppable, never deferred (`cache_blocks_deferral`)
        slots = counter.reshape(1) + torch.arange(steps, device=counter.device, dtype=counter.dtype)
        keys.index_fill_(keys.dim() - 2, slots.to(keys.device), 0)
        layer.values.index_fill_(layer.values.dim() - 2, slots.to(layer.values.device), 0)
        indexer, indexed = getattr(layer, "indexer_keys", None), getattr(layer, "indexer_cumulative_length", None)
        if isinstance(indexer, torch.Tensor) and isinstance(indexed, torch.Tensor):
            index = indexed.reshape(1) + torch.arange(steps, device=indexed.device, dtype=indexed.dtype)
            indexer.index_fill_(1, index.to(indexer.device), 0)


def cache_end(cache, next_position):
    """Where the forward after the prefill writes, as the cache itself counts: the first full static layer's device
    counter (a one-element view), or, for layers that write where `cache_position` says, the first decode step's
    `cache_position` (`next_position`). None where neither is known."""
    layers, _ = _layers(cache)
    for layer in layers or ():
        if _is_static_full(layer):
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                return counter.reshape(1)
            if isinstance(counter, int):
                return counter
            break
    if isinstance(next_position, torch.Tensor) and next_position.numel() == 1:
        return next_position
    return None


def capacity(cache) -> int | None:
    """Positions every full-attention layer of `cache` can hold, if it has a fixed size (None: it grows)."""
    layers, _ = _layers(cache)
    sizes = [layer.max_cache_len for layer in layers or () if _is_static_full(layer)]
    return min(sizes) if sizes else None


def loop_cache(model_kwargs):
    """The decoding loop's cache, under whichever name the model keeps it (`past_key_values`, `cache_params`...)."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    for name in ALL_CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is not None:
            return cache
    return None


def cache_blocks_deferral(cache, loop_undoes_steps: bool) -> str | None:
    """Why a cache the caller will see cannot take the deferred path (None: it can)."""
    reason = why_not_rollbackable(cache)
    if reason is None or (loop_undoes_steps and getattr(cache, "is_croppable", False)):
        return None  # 5.17+ records a croppable cache's past (`activate_past_recording`) and crops it back
    return f"the returned cache cannot be rolled back by one step ({reason})"
