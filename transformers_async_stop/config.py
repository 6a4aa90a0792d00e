"""The `async_stopping_criteria` field of `GenerationConfig`, and the switch that forces the deferred path.

Like every other 5.x generation field (`do_sample`, `output_scores`, ...), the field is stored as `None` while unset,
so that `model.generation_config` can supply it, and `generate()` resolves an unset value to `False` through
`GenerationConfig._get_default_generation_params`.
"""

from __future__ import annotations

import functools
import os
import weakref

FIELD = "async_stopping_criteria"
FORCE_ENV = "TRANSFORMERS_ASYNC_STOP_FORCE"
MARKER = "_transformers_async_stop_patched"  # on every replacement the package installs (`patching.py`)


class StockPathWarning(UserWarning):
    """`async_stopping_criteria=True` was asked for where the deferred path cannot run; the stock path ran."""


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
    functools.update_wrapper(replacement, original)
    setattr(replacement, MARKER, True)
    return replacement


def patched_init(original, target):
    def __init__(self, **kwargs):
        value = kwargs.pop(FIELD, None)
        original(self, **kwargs)
        check_flag(value)
        setattr(self, FIELD, value)
        _track(self)

    return _mark(__init__, original)


def patched_validate(original, target):
    def validate(self, *args, **kwargs):
        check_flag(getattr(self, FIELD, None))
        _track(self)  # a copy made without __init__ (deepcopy) gets the field back from unpatch() too
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


# --- the field on configs that outlive unpatch() ------------------------------------------------------------------
# Every config created (or validated) while patched holds the field as an instance attribute. Stock transformers
# accepts a generate() keyword whenever the config has an attribute of that name, so after `unpatch()` a model built
# while patched would take `async_stopping_criteria=...` silently, where stock raises. `unpatch()` therefore removes
# the attribute from every live config it saw, and the next `apply()` puts the values back.
_CONFIGS: dict[int, weakref.ref] = {}
_STRIPPED: list[tuple[weakref.ref, object]] = []


def _track(config) -> None:
    key = id(config)
    if key not in _CONFIGS:
        _CONFIGS[key] = weakref.ref(config, lambda _ref, key=key: _CONFIGS.pop(key, None))


def strip_field() -> None:
    """`unpatch()`: take the field off every live config that holds it, keeping the values for `apply()`."""
    for ref in list(_CONFIGS.values()):
        config = ref()
        if config is not None and FIELD in vars(config):
            _STRIPPED.append((ref, vars(config).pop(FIELD)))


def restore_field() -> None:
    """`apply()` after `unpatch()`: give the configs their values back (unless set again in between)."""
    for ref, value in _STRIPPED:
        config = ref()
        if config is not None and FIELD not in vars(config):
            setattr(config, FIELD, value)
    _STRIPPED.clear()
