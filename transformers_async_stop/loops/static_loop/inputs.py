"""The forward's inputs of a static-cache decode step, kept in place and advanced on the device.

Copied from transformers v5.17.0-v5.24.0 `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation`,
as they act on a decode step of a decoder-only model with a static cache. Per step stock appends a one to the 2D
mask and `last + 1` to the position ids, then slices and clones the new token and the new position, and rebuilds the
4D mask from the cache's device counter (`static_mask.MaskPlan`). Here the first decode step's inputs come from the
real `prepare_inputs_for_generation`; each later step writes the same values into the same tensors: the new token,
the position plus one, and the mask `(arange <= counter) & padding`, whose padding columns after the prompt are the
ones stock appends, up to the 2D mask's width (stock pads it with zeros past that: a criterion that runs its own
forward into the cache moves the counter past the width). Shapes, dtypes and strides stay the ones stock makes, so
the compiled forward sees what it saw.

Any input this does not know how to advance (another tensor, a mask the plan did not make) leaves the loop on
stock's own `prepare_inputs_for_generation` every step.
"""

from __future__ import annotations

import torch

from ...sync_free import static_mask

_ADVANCED = frozenset(("input_ids", "position_ids", "attention_mask"))


class StepInputs:
    """The decode-step inputs of one loop; `advance(tokens)` turns step t's into step t+1's (on the device)."""

    __slots__ = ("inputs", "ids", "positions", "mask", "causal_only", "kv", "offset", "padding", "last_column")

    def __init__(self, inputs, ids, positions, mask, plan, offset, width=None):
        self.inputs = inputs
        self.ids = ids
        self.positions = positions
        self.mask = mask
        self.offset = offset
        self.kv = plan.kv if plan is not None else None
        self.causal_only = plan is not None and plan.padding is None
        self.padding = self.last_column = None
        if plan is not None and plan.padding is not None:
            # the 2D mask as stock will have grown it: the prompt's columns, then the ones the loop appends
            padding = plan.padding.clone()
            padding[:, plan.known:] = True
            self.padding = padding[:, None, None, :]
            # the 2D mask's last column at this forward, advanced with it: stock pads the 2D mask with zeros past
            # its width, so no column past it is attended, wherever user code moved the cache's counter (a
            # criterion's own forward into the cache writes a position stock's mask then leaves out)
            self.last_column = torch.tensor(width - 1, dtype=torch.long, device=padding.device)

    @classmethod
    def build(cls, model, input_ids, model_kwargs, cache, cache_end) -> tuple[dict, "StepInputs | None"]:
        """The first decode step's inputs, from stock's `prepare_inputs_for_generation`, and the `StepInputs` that
        advances them (None: they are rebuilt by stock every step). `cache_end`: the cache position this step's
        forward writes (the controller's host copy of the cache's counter after the prefill), or None."""
        plan = static_mask._plan_of(cache)
        if plan is not None:
            plan.last = None
        inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
        for key, value in inputs.items():
            if key not in _ADVANCED and _holds_tensor(value):
                return inputs, None
        ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
        if not _one_column(ids) or (positions is not None and not _one_column(positions)):
            return inputs, None
        mask = inputs.get("attention_mask")
        if isinstance(mask, dict):
            mask = mask.get("full_attention") if list(mask) == ["full_attention"] else None
            if mask is None:
                return inputs, None
        if mask is not None:
            made = plan.last if plan is not None else None
            made = made.get("full_attention") if isinstance(made, dict) else made
            # the plan made it (the caller's `.contiguous()` may have copied it): it can be rebuilt the plan's way
            if made is None or made.shape != mask.shape or made.dtype != mask.dtype or not mask.is_contiguous():
                return inputs, None
            offset = cache.get_query_offset(0)
            if not isinstance(offset, torch.Tensor):
                return inputs, None
            # stock pads the 2D mask with zeros past its own width, which grows one column per step: the ones the
            # advanced mask assumes there line up with the cache's positions only where the mask's last column is
            # the position this step writes (a multi-turn caller may feed a conversation shorter than the cache)
            mask2d = model_kwargs.get("attention_mask")
            if plan.padding is not None and (cache_end is None or mask2d is None
                                             or cache_end != mask2d.shape[-1] - 1):
                return inputs, None
        else:
            plan, offset = None, None
        width = model_kwargs["attention_mask"].shape[-1] if plan is not None and plan.padding is not None else None
        return inputs, cls(inputs, ids, positions, mask, plan, offset, width)

    def advance(self, tokens: torch.Tensor) -> None:
        """After step t's token is chosen (and step t's forward has advanced the cache counter): step t+1's inputs."""
        self.ids.copy_(tokens[:, None])
        if self.positions is not None:
            self.positions.add_(1)
        if self.last_column is not None:
            self.last_column.add_(1)
        self.refresh()

    def refresh(self) -> None:
        """The mask from the cache's counter as it is now: again after user code ran (a criterion may `reset()` the
        cache; stock builds the next mask after the criteria)."""
        if self.mask is not None:
            if self.causal_only:
                self.mask.copy_((self.kv <= self.offset).expand_as(self.mask))
            else:
                causal = self.kv <= torch.minimum(self.offset, self.last_column)
                torch.bitwise_and(causal, self.padding, out=self.mask)


def _one_column(tensor) -> bool:
    return (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] == 1
            and tensor.dtype == torch.long and tensor.is_contiguous())


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False
