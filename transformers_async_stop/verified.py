"""Is the installed transformers code one that a shortcut was checked against?

Some per-call shortcuts of the deferred loop compute what a piece of stock code computes, with less host work
(`targets.SHORTCUTS` lists them, each with the digests of the upstream sources it was read against). The digest of
the installed source is taken once per process, at first use. On a release whose source is not in the table the
shortcut is off and the stock code runs: exact by construction. The drift test (`tests/test_patching.py`) fails on
such a release, so the table is reviewed and extended rather than silently wrong.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import textwrap
import threading

from .targets import SHORTCUTS

logger = logging.getLogger("transformers_async_stop")

_BY_NAME = {shortcut.name: shortcut for shortcut in SHORTCUTS}
_RESULTS: dict[str, bool] = {}
_LOCK = threading.Lock()


def source_digest(obj) -> str:
    """sha256 (first 12 hex digits) of an object's source as written in its file, dedented."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode("utf-8")).hexdigest()[:12]


def installed_digests(name: str) -> dict[str, str | None]:
    """The digest of every upstream source the shortcut `name` relies on, as installed (None: not found)."""
    found = {}
    for source in _BY_NAME[name].sources:
        try:
            found[source] = source_digest(_resolve(source))
        except (ImportError, AttributeError, OSError, TypeError):
            found[source] = None
    return found


def matches(name: str) -> bool:
    """Whether every upstream source behind the shortcut `name` is one it was checked against."""
    result = _RESULTS.get(name)
    if result is None:
        with _LOCK:
            shortcut = _BY_NAME[name]
            found = installed_digests(name)
            result = all(digest in shortcut.digests.get(source, {}) for source, digest in found.items())
            if not result:
                logger.info("transformers_async_stop: shortcut %s is off: %s differs from the sources it was "
                            "checked against; the stock code runs instead", name,
                            ", ".join(s for s, d in found.items() if d not in shortcut.digests.get(s, {})))
            _RESULTS[name] = result
    return result


def _resolve(source: str):
    """"module:Qual.name" -> the object."""
    import importlib

    module_name, _, qualname = source.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
