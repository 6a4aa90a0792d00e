"""The `async_stopping_criteria` field of `GenerationConfig`, and the switch that forces the deferred path.

Like every other 5.x generation field (`do_sample`, `output_scores`, ...), the field is stored as `None` while unset,
so that `model.generation_config` can supply it, and `generate()` resolves an unset value to `False` through
`GenerationConfig._get_default_generation_params`.
"""

from __future__ import annotations

import functools
import os
import warnings

from .call_state import active_draft

FIELD = "async_stopping_criteria"
FORCE_ENV = "TRANSFORMERS_ASYNC_STOP_FORCE"


class StockPathWarning(UserWarning):
    """`async_stopping_criteria=True` was asked for where the deferred path cannot run; the stock path ran."""


def warn_stock(reason: str, stacklevel: int = 4) -> None:
    warnings.warn(
        f"async_stopping_criteria=True: {reason}; running the stock generation loop instead "
        "(identical output, one blocking read per step).",
        StockPathWarning,
        stacklevel=stacklevel,
    )


def runs_stock(generation_config, device, why_stock) -> bool:
    """Whether a decoding method must run its stock loop: the flag is off, the loop is an assistant's, the device is
    synchronous, or the method's own `why_stock()` gives a reason (warned once; "" means silently)."""
    if not flag_of(generation_config):
        return True
    if getattr(generation_config, "is_assistant", False) and active_draft() is None:
        return True  # an assistant's own loop inside stock assisted decoding runs stock silently: the caller warned
    if device.type != "cuda" and not force_deferred():
        return True  # CPU / MPS: nothing to gain, the flag is accepted and the stock path runs, silently
    reason = why_stock()
    if reason is None:
        return False
    if reason:
        warn_stock(reason, stacklevel=5)
    return True


def force_deferred() -> bool:
    """`TRANSFORMERS_ASYNC_STOP_FORCE=1` runs the one-step-late path on any device (CPU tests use it)."""
    return os.environ.get(FORCE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def check_flag(value) -> None:
    # bool is a subclass of int: test the exact type so that 0/1 are refused too
    if value is not None and type(value) is not bool:
        raise ValueError(
            f"`{FIELD}` must be a bool (True or False), got {value!r} of type {type(value).__name__}."
        )


def flag_of(generation_config) -> bool:
    return getattr(generation_config, FIELD, None) is True


def _mark(replacement, original):
    from .patching import MARKER

    functools.update_wrapper(replacement, original)
    setattr(replacement, MARKER, True)
    return replacement


def patched_init(original, target):
    def __init__(self, **kwargs):
        value = kwargs.pop(FIELD, None)
        original(self, **kwargs)
        check_flag(value)
        setattr(self, FIELD, value)

    return _mark(__init__, original)


def patched_validate(original, target):
    def validate(self, *args, **kwargs):
        check_flag(getattr(self, FIELD, None))
        return original(self, *args, **kwargs)

    return _mark(validate, original)


def patched_defaults(original, target):
    def _get_default_generation_params():
        defaults = original()
        defaults.setdefault(FIELD, False)
        return defaults

    return staticmethod(_mark(_get_default_generation_params, original))


def class_default(original, target):
    # A plain value: `update()` checks `hasattr`, so configs created before the import accept the keyword.
    return None
