"""The padding warning of a decode step, with the flag: checked without a blocking read, emitted where stock emits it.

GPT-2-like models run `PreTrainedModel.warn_if_padding_and_no_attention_mask` at every forward. Without an attention
mask (5.18+ drops an all-ones one) it tests `pad_token_id in input_ids[:, [-1, 0]]`, a blocking device read, and warns
once per process (`warning_once`) if so. A decode step feeds the pad token once a row has finished, or where a row
made that token: stock then logs "We strongly recommend passing in an `attention_mask`...".

With the flag, a decode forward's check copies those columns to pinned memory without waiting, and the original check
runs on the host copy when the host reads the previous step's verdict (`AsyncStop.join`, right after this forward was
queued; by then the copy, queued behind that step's tokens, has landed). It runs only where that verdict says stock
makes this forward too: the extra step's forward, which stock never runs, warns about nothing. The record is stock's
own (the original check emits it), after this forward's Python has run rather than inside it: a record this same
forward emits after its padding check comes before it (none does in GPT-2's decode forward).

Where the previous verdict is already read (the controller reads each one at once, or the forward runs outside the
loop's forward, inside a processor or criterion), the original check runs as in stock. Once a check has warned, the
call's later checks are skipped: stock's would hit `warning_once`'s cache and emit nothing.
"""

from __future__ import annotations

import torch


class PendingChecks:
    """The padding checks of the decode forward queued before the controller's next `join`."""

    __slots__ = ("items", "warned")

    def __init__(self):
        self.items = []  # (original, model, host columns, event or None)
        self.warned = False  # a check of this call found padding: stock's later ones emit nothing

    def settle(self, skip: bool) -> None:
        """At the controller's read of the previous verdict: run the checks, unless their forward was the extra
        step (`skip`), or the call left the loop before stock would have reached it."""
        items, self.items = self.items, []
        if skip:
            return
        for original, model, columns, event in items:
            if self.warned:
                return
            if event is not None:
                event.synchronize()  # the copy follows the previous step's tokens: landed with its verdict
            original(model, columns, None)
            self.warned = model.config.pad_token_id in columns


def check(original, model, ctl, input_ids, attention_mask, args, kwargs):
    """`warn_if_padding_and_no_attention_mask` at a decode step of a deferred loop (`ctl.steps > 0`)."""
    if attention_mask is not None or args or kwargs or getattr(model.config, "pad_token_id", None) is None:
        return original(model, input_ids, attention_mask, *args, **kwargs)  # returns before any device read
    if ctl.read >= ctl.steps:
        # the previous verdict is read: this forward is one stock runs too, and the check can be stock's own
        return original(model, input_ids, attention_mask)
    pending = ctl.padding
    if pending is None:
        pending = ctl.padding = PendingChecks()
    if pending.warned or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        return None
    if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # a forward captured into a CUDA graph: no copy can be taken (stock's own read would raise)
    columns = input_ids[:, [-1, 0]]  # advanced indexing: a copy, unchanged by later in-place edits of the ids
    event = None
    if columns.device.type != "cpu":
        host = torch.empty(columns.shape, dtype=columns.dtype, device="cpu", pin_memory=columns.is_cuda)
        host.copy_(columns, non_blocking=columns.is_cuda)
        if columns.is_cuda:
            event = torch.cuda.Event()
            event.record()
        columns = host
    pending.items.append((original, model, columns, event))
    return None
