"""The state of one `generate()` call, and the one ContextVar that carries it.

The `generate()` wrapper creates a `CallState` when the call starts and puts the caller's back when it returns or
raises. A `generate()` called from inside a logits processor or a stopping criterion (an LLM judge, a reward model)
therefore starts with clean state: it never sees, advances or undoes the outer call's controller.

The state reaches the few places that have no explicit path to it (`_has_unfinished_sequences`, transformers'
`DeferredStopCheck`, the beam-search helpers) through `CALL`. Anything that can run inside a model's forward calls
`compiling()` first and goes straight to the original when it is true: torch.compile cannot trace `ContextVar.get`.
"""

from __future__ import annotations

import contextvars

import torch


class CallState:
    """What the package's wrappers share during one `generate()` call."""

    __slots__ = ("user_cache", "slice_inputs", "fed_mask", "ctl", "assisted", "drafting", "draft")

    def __init__(self, user_cache: bool, slice_inputs: bool):
        outer = CALL.get()
        self.user_cache = user_cache  # the caller passed `past_key_values`: the cache outlives the call
        self.slice_inputs = slice_inputs  # no user `cache_position`: inputs.py may slice by host lengths
        self.fed_mask = None  # weakref to the tagged mask generate() feeds the model now (masking.py)
        self.ctl = None  # the AsyncStop controller of a deferred decoding loop
        # assisted decoding (assisted/): the call's per-call state, and the draft run its assistant's generate() is
        # inside of right now (set only around that call, so a generate() in a processor or criterion gets none)
        self.assisted = None
        self.drafting = None
        # this call is an assistant's draft inside a deferred assisted call: that call's DraftRun
        self.draft = outer.drafting if outer is not None else None


CALL: contextvars.ContextVar[CallState | None] = contextvars.ContextVar("transformers_async_stop_call",
                                                                       default=None)


def active_controller():
    """The controller of the deferred loop of the innermost `generate()` call, or None."""
    state = CALL.get()
    return None if state is None else state.ctl


def active_draft():
    """The `DraftRun` of the deferred assisted call whose assistant this `generate()` drafts for, or None."""
    state = CALL.get()
    return None if state is None else state.draft


def compiling() -> bool:
    """True while dynamo traces (torch.compile, torch.export): leave every Python-side decision to the original."""
    return torch.compiler.is_compiling()
