"""A replay's bool attention mask handed to transformers' SDPA attention as the additive mask torch makes of it: made
once per step instead of once per layer.

torch's `scaled_dot_product_attention` turns a bool `attn_mask` into an additive one before any kernel runs
(`convert_boolean_attn_mask`, `convert_boolean_attn_mask_cudnn` for cuDNN: aten/src/ATen/native/transformers/
attention.cpp), `where(mask.logical_not(), -inf, scalar_tensor(0.0, dtype=query.dtype))`, and passes a float mask
through as it is; its documentation gives the two the same meaning. A padded decode step makes that conversion in
every layer's call: on an H200 with torch 2.11 a bool mask costs 29 host ops per call against 15 for its additive
form, and a padded step of a 16-layer Llama dispatches 322 more host ops than an unpadded one, 224 of them in those
conversions (docs/gpu-runs/2026-11-29-session2/call2, `padded_probe.py`). Here the replay converts each distinct mask
once per step, with torch's own expression, and hands every layer the result.

Copied from transformers v5.17.0-v5.24.0 `sdpa_attention_forward` (and the helpers it calls: `use_gqa_in_sdpa`,
`repeat_kv`, `pack_gqa`, `create_position_bias_mask`; `targets.SHORTCUTS` "sdpa additive mask"), which reads the mask
for `is None` and its shape only, but (a) with a `position_bias` (a bool mask is merged by `where`, a float one
added) and (b) on an Ascend NPU (a float mask is made bool). Differences: the mask is converted once per step, as
torch converts it inside each call. Taken only where all of this holds:
- the attention function the replay calls now is transformers' own `sdpa_attention_forward`, the SDPA it calls is
  torch's own (no user's replacement of `torch.nn.functional.scaled_dot_product_attention`), on no NPU, and the
  sources are the ones read (`matches`: "sdpa additive mask", and "sdpa additive mask (pack_gqa)" where the module
  has `pack_gqa`);
- the layer's recorded arguments hold no `position_bias` and no dropout;
- the recording proved it for that layer (`check`): its attention ran with the bool mask (stock's) and again with
  its additive form, and the two outputs were equal bit for bit. A torch that converts otherwise, or that picks
  another kernel for a float mask, is caught there: that recording keeps handing the bool mask (stock's cost and
  bits). A layer that had no bool mask at its recording is not converted.
"""

from __future__ import annotations

import torch

from ...release_checks.verified import matches

SHORTCUT = "sdpa additive mask"
PACK_SHORTCUT = "sdpa additive mask (pack_gqa)"  # 5.23+: the module's `pack_gqa`, read where it has one


def _sdpa():
    """transformers' own SDPA attention function (None where it cannot be imported)."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return None, None
    return sdpa_attention.sdpa_attention_forward, sdpa_attention


def _torch_sdpa():
    """torch's own SDPA (the C function `torch.nn.functional` binds; None where a torch has no such binding)."""
    return getattr(getattr(torch._C, "_nn", None), "scaled_dot_product_attention", None)


def allowed(attention_fn) -> bool:
    """The replay may hand `attention_fn` converted masks (the function, its module's state and the SDPA it calls;
    per step, on the host). transformers' function looks up `torch.nn.functional.scaled_dot_product_attention` at
    every call: a user's replacement there (a wrapper, another kernel) gets what stock hands it, the bool mask (red
    team of 2026-11-29, holes R1 and R2)."""
    function, module = _sdpa()
    sdpa = _torch_sdpa()
    return (function is not None and attention_fn is function and sdpa is not None
            and torch.nn.functional.scaled_dot_product_attention is sdpa
            and not getattr(module, "_is_torch_npu_available", False) and matches(SHORTCUT)
            and (not hasattr(module, "pack_gqa") or matches(PACK_SHORTCUT)))


def of(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask torch's SDPA makes of the bool `mask` for a query of `dtype` (the same expression)."""
    return torch.where(mask.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _plain(kwargs: dict) -> bool:
    return kwargs.get("position_bias") is None and not kwargs.get("dropout", 0.0)


def check(attention_fn, eager, module, query, keys, values, mask, kwargs: dict, output) -> bool:
    """At a recording (outside any capture; it reads the device): whether this layer's attention, run by `eager` with
    the additive form of its bool `mask`, gives `output` (its run with `mask`) bit for bit. False where the shortcut
    does not apply to the layer."""
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and _plain(kwargs) and allowed(attention_fn)):
        return False
    converted = eager(attention_fn, module, query, keys, values, of(mask, query.dtype), **kwargs)[0]
    return (isinstance(output, torch.Tensor) and converted.shape == output.shape
            and converted.dtype == output.dtype and bool(torch.equal(converted, output)))


class StepMasks:
    """The converted masks of one replay step: each distinct (mask, dtype) converted once."""

    __slots__ = ("made",)

    def __init__(self):
        self.made = {}

    def get(self, mask, dtype):
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            return mask
        key = (id(mask), dtype)
        found = self.made.get(key)
        if found is None:
            # the mask is kept alive by the step (its id is not reused while this step runs)
            found = self.made[key] = (of(mask, dtype), mask)
        return found[0]
