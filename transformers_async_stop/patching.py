"""apply(), unpatch(), is_patched(): reversible, idempotent patching of the targets in `targets/`.

Each replacement carries a marker attribute and `__wrapped__` (the original), so a second `apply()` is a no-op and
`unpatch()` puts back the very same objects it found, whether they were functions, staticmethods or plain values.
A target that the installed transformers lacks is logged once and skipped; it never raises at import.
"""

from __future__ import annotations

import importlib
import logging
import threading

from .config import MARKER, restore_field, strip_field
from .release_checks.targets import TARGETS, Target, present_in

logger = logging.getLogger("transformers_async_stop")

_MISSING = object()

# (id(owner), attr) -> (target name, owner, attr, the raw value found in owner.__dict__ or _MISSING)
_ORIGINALS: dict[tuple[int, str], tuple[str, object, str, object]] = {}
_SKIPPED: dict[str, str] = {}
_LOCK = threading.RLock()


def _build(target: Target, original):
    module_name, func_name = target.factory.split(":")
    module = importlib.import_module(f"{__package__}.{module_name}")
    factory = getattr(module, func_name)
    return factory(original, target)


def _raw(owner, attr):
    """The attribute as stored (a staticmethod stays a staticmethod), or _MISSING."""
    return vars(owner).get(attr, _MISSING)


def _is_ours(raw) -> bool:
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return getattr(func, MARKER, False) is True


def apply() -> list[str]:
    """Patch every target the installed transformers has. Returns the names patched by this call."""
    patched = []
    with _LOCK:
        for target in TARGETS:
            try:
                owner = target.resolve_owner()
            except (ImportError, AttributeError) as exc:
                _skip(target, f"owner not importable ({exc})")
                continue
            key = (id(owner), target.attr)
            raw = _raw(owner, target.attr)
            if key in _ORIGINALS or (raw is not _MISSING and _is_ours(raw)):
                continue  # already ours: a second apply() is a no-op
            if raw is _MISSING and target.present != "new":
                _skip(target, "not found")
                continue
            if raw is not _MISSING and target.present == "new":
                _skip(target, "already provided upstream")
                continue
            original = getattr(owner, target.attr) if raw is not _MISSING else None
            replacement = _build(target, original)
            _ORIGINALS[key] = (target.name, owner, target.attr, raw)
            setattr(owner, target.attr, replacement)
            patched.append(target.name)
        if patched:
            restore_field()
    return patched


def _skip(target: Target, reason: str) -> None:
    if target.name in _SKIPPED:
        return
    _SKIPPED[target.name] = reason
    # a warning only where the table expected the target: its absence there is drift, not a known release gap
    expected = present_in(target, _installed_release())
    level = logging.WARNING if target.required and expected is not False else logging.INFO
    logger.log(level, "transformers_async_stop: %s %s in this transformers release; skipped (%s)",
               target.name, reason, target.why)


def _installed_release() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def unpatch() -> list[str]:
    """Restore every original exactly as found, and take the `async_stopping_criteria` field off the configs
    created while patched (`apply()` gives it back). Returns the names restored."""
    restored = []
    with _LOCK:
        for name, owner, attr, raw in _ORIGINALS.values():
            if raw is _MISSING:
                if attr in vars(owner):
                    delattr(owner, attr)
            else:
                setattr(owner, attr, raw)
            restored.append(name)
        _ORIGINALS.clear()
        if restored:
            strip_field()  # configs created while patched: see config.py
    return restored


def is_patched() -> bool:
    """True while our replacements are installed."""
    return bool(_ORIGINALS)


def skipped() -> dict[str, str]:
    """Targets that were missing at the last apply(), with the reason."""
    return dict(_SKIPPED)


def original(target_name: str):
    """The original object behind a target (for tests and for calling the stock path)."""
    for target in TARGETS:
        if target.name == target_name:
            owner = target.resolve_owner()
            raw = _raw(owner, target.attr)
            if raw is _MISSING:
                return None
            func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            return getattr(func, "__wrapped__", func) if _is_ours(raw) else func
    raise KeyError(target_name)
