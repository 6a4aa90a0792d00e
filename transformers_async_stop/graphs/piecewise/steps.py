"""The per-step input checks of the piecewise forward (`forward.PiecewiseForward._step`): the ids and positions, the
attention's mask as stock's forward would make it, and the torch modes and threads that keep a step eager."""

from __future__ import annotations

import threading

import torch
from transformers import masking_utils

from ...state import concurrency
from ...sync_free import masking


# torch's mode stacks (private: read by name, and a torch without them keeps the eager forward, `why_mode`)
_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
try:
    from torch.overrides import _get_current_function_mode_stack as _function_modes
    from torch.utils._device import DeviceContext as _DeviceContext
except ImportError:
    _function_modes = _DeviceContext = None


def why_mode() -> str | None:
    """A torch function or dispatch mode active around the forward (a profiler's, a debugger's, a counting mode) sees
    every op of stock's forward, and nothing of a replay: the step runs eagerly. `torch.set_default_device` keeps one
    mode on for good (a `DeviceContext`): it only gives factory calls without a device their device, and it is part
    of the recording key (`_default_device`), so it keeps the path."""
    if None in (_FUNCTION_MODES, _DISPATCH_MODES, _function_modes, _DeviceContext):
        return "torch's mode stacks cannot be read"
    if _DISPATCH_MODES():
        return "a torch dispatch mode is active"
    if _FUNCTION_MODES() and any(type(mode) is not _DeviceContext for mode in _function_modes()):
        return "a torch function mode is active"
    return None


def own_sdpa_mask() -> bool:
    """The mask function registered for "sdpa" is transformers' own `sdpa_mask`."""
    registry = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    own = getattr(masking_utils, "sdpa_mask", None)
    return registry is not None and own is not None and registry.get("sdpa") is own


def own_mask(impl: str) -> bool:
    """The mask function registered for `impl` (which stock's mask functions call, and so does every replay of an
    implementation other than SDPA: `masks.mask_call`) is transformers' own code."""
    from .proof.default_deny import transformers_own

    registry = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    return registry is not None and impl in registry and transformers_own(registry[impl])


def default_device():
    """The default device `torch.set_default_device` put on the mode stack, None without one (a recording key).
    Reached only after `why_mode` found the stacks readable and holding no other function mode."""
    if not _FUNCTION_MODES():
        return None
    return tuple(str(getattr(mode, "device", None)) for mode in _function_modes())


def alone() -> bool:
    """No other thread is inside generate() (`concurrency.inside_generate` registers each call's thread)."""
    ident = threading.get_ident()
    return all(other == ident for other in list(concurrency._INSIDE))


def row(tensor, device) -> bool:
    """A plain 2D long tensor on the model's device (the ids or positions of a forward of one or more tokens)."""
    return (isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor and tensor.dim() == 2
            and tensor.dtype == torch.long and tensor.device == device)


PADDED_2D = "a padded 2D mask (the model builds its 4D mask this step)"


def attention_mask(mask, batch: int, cache):
    """What stock's `create_causal_mask` hands the attention at this decode step, known on the host: (mask, None),
    or (None, why the step runs eagerly).

    - a 4D mask (the loop's grown mask, `dynamic_loop/wide_mask.py`) is returned as it is;
    - no mask, or a 2D mask of ones as long as the cache and this token (the call's host summary says the prompt has
      no padding and no zero column was added), gives None on SDPA's decode step (`_ignore_causal_mask_sdpa`: no
      padding and one query);
    - anything else (a padded 2D mask: stock builds the 4D mask inside the forward) is left to the eager forward."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or type(mask) is not torch.Tensor:
        return None, "a mask the recording does not take"
    if mask.dim() == 4:
        if (mask.dtype == torch.bool and mask.shape[0] == batch and mask.shape[1:3] == (1, 1)
                and mask.shape[3] == cache.get_seq_length() + 1):
            return mask, None
        return None, "a 4D mask other than the decode step's"
    if mask.dim() == 2:
        if mask.shape[-1] != cache.get_seq_length() + 1:
            # shorter than the cache + this token (a chunked prefill or a conversation fed again on a continued
            # cache): stock's mask then hides the cache's last positions, SDPA's unmasked decode step would not (CUDA
            # usage fuzzer seeds 51, 177, 1339, 1443 on 5.17; tests/test_piecewise_redteam.py, hole A)
            return None, "a 2D mask whose length is not the cache's + 1"
        tag = masking._tag_of(mask)
        if tag is not None and not tag[0].padded and tag[1] == mask.shape[-1]:
            return None, None
        return None, PADDED_2D
    return None, "a mask the recording does not take"


def wide_mask(mask, batch: int, width: int, cache):
    """The step's own mask for a forward of `width` > 1 tokens: (mask, None), or (None, why the step runs eagerly).
    Stock builds its 4D mask from it inside the forward at every such step (`sdpa_mask`; with a cache it never skips
    it at more than one query), and so does each replay, with the same function and arguments
    (`graphs.Recording._masks`): any padding is taken. A 4D mask (no caller of the package passes one at K > 1) or a
    2D mask not as long as the cache plus the step's tokens stays eager."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or type(mask) is not torch.Tensor or mask.dim() != 2:
        return None, "a mask the recording does not take"
    if mask.shape[0] != batch or mask.shape[1] != cache.get_seq_length() + width:
        return None, "a 2D mask whose length is not the cache's + the step's tokens"
    return mask, None


SLIDING_PADDED = "a padded batch with sliding-window layers (the model builds its masks this step)"


def sliding_step(mask, cache, config, holds_sliding=True) -> str | None:
    """For a one-token decode step of a cache with sliding-window layers: why its masks are not ones the host answers
    for (`masks.host_mask`), or None. The host answers a batch without padding (no mask, or a 2D mask of ones as long
    as the cache and this token, the call's host summary says so), whose first sliding layer's window is the config's
    (the one `create_sliding_window_causal_mask` reads) and at least 2. A padded batch (stock builds each kind's 4D
    mask inside the forward) or a 4D mask stays eager. `holds_sliding`: the cache holds a sliding-window layer (else
    only the config has a window)."""
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or type(mask) is not torch.Tensor or mask.dim() != 2:
            return "a mask the recording does not take with sliding-window layers"
        if mask.shape[-1] != cache.get_seq_length() + 1:
            return "a 2D mask whose length is not the cache's + 1"
        tag = masking._tag_of(mask)
        if tag is None or tag[0].padded or tag[1] != mask.shape[-1]:
            return SLIDING_PADDED if holds_sliding else PADDED_2D
    if not holds_sliding:
        # a window in the config over full-attention layers only (Gemma 3 configured so): a layer that takes the
        # sliding mask stops the recording (`recorder._Recorder.attention`)
        return None
    window = getattr(config, "sliding_window", None)
    layer = cache.layers[cache.is_sliding.index(True)]
    if type(window) is not int or window < 2 or layer.sliding_window != window:
        return "a sliding layer whose window is not the config's"
    if type(layer.cumulative_length) is not int:
        return "a sliding layer without a length on the host"
    return None
