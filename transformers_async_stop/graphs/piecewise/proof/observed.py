"""What a replay would not see or reproduce, asked of the model and the cache: hooks and instance-level forwards
(user code a replay skips), the parameters' kind and placement, and the cache's layers and update functions (which
every replay calls eagerly between its pieces). `admission.py` asks them before a recording and at each call;
`forward.py` asks `why_not_cache` at each step."""

from __future__ import annotations

import torch

from . import default_deny


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


def why_observed(model, modules=None) -> str | None:
    """A hook or an instance-level forward anywhere a decode step runs would see (or change) what a replay skips.
    `modules`: those a decode step runs (`family.decoding_modules`: an encoder-decoder's encoder, which ran once
    before the decode steps as in stock, left out), None: every module."""
    why = why_global_hooks()
    if why is not None:
        return why
    for module in model.modules() if modules is None else modules:
        if _has_hooks(module):
            return f"a hook on {type(module).__name__}{_whose(module)}"
        if "forward" in module.__dict__:
            return f"a wrapped forward on {type(module).__name__}"
    return None


# transformers' own forward hook that `gradient_checkpointing_enable()` (and peft) leave on the input embeddings: it
# marks the embeddings' output as requiring gradients, for training; generate() runs without gradients
_INPUT_GRADS = "enable_input_require_grads.<locals>.make_inputs_require_grads"


def _whose(module) -> str:
    """How to remove a hook the user may not know of (a reason that says how to get the graphed forward)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    if any(getattr(hook, "__qualname__", "").endswith(_INPUT_GRADS) for hook in hooks):
        return (" (transformers' input-gradients hook, which gradient_checkpointing_enable() adds: "
                "model.disable_input_require_grads() removes it)")
    return ""


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
    if not (default_deny.transformers_own(DynamicCache.update) and default_deny.transformers_own(DynamicLayer.update)
            and default_deny.transformers_own(DynamicSlidingWindowLayer.update)):
        return "a cache update that is not transformers' own"
    if any("update" in layer.__dict__ for layer in cache.layers):
        return "a cache layer with its own update"
    return None
