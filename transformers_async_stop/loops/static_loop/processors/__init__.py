"""Logits processors of the static-cache loop that read the sequence, in a form a CUDA graph can replay, and the
guards that tell when a captured processor's state changed.

Stock processors that read `input_ids` values see a tensor that grows by one column per step; a CUDA graph needs
fixed shapes. The forms here read the loop's preallocated sequence buffer (`Tail.seq`) at the device-side length
(`Tail.length`), or keep a device state the tail updates after each token. Each is used only for the exact built-in
type, and only where the installed source is one it was read against (`targets.SHORTCUTS`); elsewhere the stock
processor runs eagerly. Where a form cannot reproduce stock for this call (an id stock would reject, a setting it
does not model, a state changed mid-call) it hands the call to the stock processor, on the real sequence, for the rest
of the call, and is no longer captured.

The interface the tail uses, on top of `__call__(input_ids, scores)`:
- `start(seq, length, vocab, pad)`: once, at the first step (host length); may decide to run stock for the call;
- `after_token(tokens, position)`: inside the tail's body, after the step's token is written at `position`;
- `rebuild(length)`: the sequence was edited in place by user code; remake the state from it;
- `phase(length)`: the form's host decisions at this length (part of the tail's graph key);
- `capturable`: False once the form runs stock.
"""

from __future__ import annotations

from .forms import LastTokens, NoRepeatNGram, RepetitionPenalty, _Form, device_form
from .guards import AttrGuard

__all__ = ["AttrGuard", "LastTokens", "NoRepeatNGram", "RepetitionPenalty", "device_form", "guard_for_builtin"]


def guard_for_builtin(processor):
    """A maker of the guard of a processor captured by type: called when the tail first captures."""
    from ....control.step_lists import _EosMask

    if isinstance(processor, _EosMask):
        return lambda: AttrGuard(processor.processor)
    if isinstance(processor, _Form):
        return lambda: processor.guard if processor.guard is not None else AttrGuard(processor.processor)
    return lambda: AttrGuard(processor)
