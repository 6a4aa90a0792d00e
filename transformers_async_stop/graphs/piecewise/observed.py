"""What a replay would not see or reproduce, asked of the model and the cache: hooks and instance-level forwards
(user code a replay skips), the parameters' kind and placement, and the cache's layers and update functions (which
every replay calls eagerly between its pieces). `eligibility.py` asks them before a recording and at each call;
`forward.py` asks `why_not_cache` at each step."""

from __future__ import annotations

import torch

from . import proven


def why_not_tensors(model) -> str | None:
    """Every parameter and buffer a plain (not DTensor, not meta, not quantized) tensor on one device."""
    devices = set()
    for tensor in _tensors(model):
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return f"a {type(tensor).__name__} parameter (tensor parallelism or quantization)"
        if tensor.is_meta:
            return "offloaded (meta) weights"
        devices.add(tensor.device)
    if len(devices) > 1:
        return "weights on several devices"
    return None


def why_global_hooks() -> str | None:
    hooks = torch.nn.modules.module
    if (hooks._global_forward_pre_hooks or hooks._global_forward_hooks or hooks._global_backward_hooks
            or getattr(hooks, "_global_backward_pre_hooks", None)):
        return "a global module hook"
    return None


def why_observed(model) -> str | None:
    """A hook or an instance-level forward anywhere would see (or change) what a replay skips."""
    why = why_global_hooks()
    if why is not None:
        return why
    for module in model.modules():
        if _has_hooks(module):
            return f"a hook on {type(module).__name__}"
        if "forward" in module.__dict__:
            return f"a wrapped forward on {type(module).__name__}"
    return None


def _has_hooks(module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def _tensors(model):
    yield from model.parameters()
    yield from model.buffers()


def why_not_cache(cache) -> str | None:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if type(cache) is not DynamicCache or getattr(cache, "is_compileable", False):
        return f"a {type(cache).__name__}"
    # full-attention and sliding-window layers: each one's update runs eagerly between the pieces (a sliding layer's
    # mask is answered on the host: `masks.host_mask`)
    if any(type(layer) is not DynamicLayer and type(layer) is not DynamicSlidingWindowLayer for layer in cache.layers):
        return "cache layers other than DynamicLayer and DynamicSlidingWindowLayer"
    if "update" in cache.__dict__:
        return "a cache with its own update"
    # each replay calls the cache's and its layers' `update` eagerly, between the pieces: user code there (patched on
    # the class, or set on a layer) could change what the rest of the step reads (red team Q6)
    if not (proven.transformers_own(DynamicCache.update) and proven.transformers_own(DynamicLayer.update)
            and proven.transformers_own(DynamicSlidingWindowLayer.update)):
        return "a cache update that is not transformers' own"
    if any("update" in layer.__dict__ for layer in cache.layers):
        return "a cache layer with its own update"
    return None
