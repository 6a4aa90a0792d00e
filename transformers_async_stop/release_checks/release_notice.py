"""A transformers release the package was not checked against is said out loud, once per process.

Every fast path of the flag is keyed to the upstream sources it was read against (`targets/`): on a release whose
sources differ, the path is off and the stock code runs, so outputs stay exact, but slower than the user expects. On
the first call that asks for `async_stopping_criteria=True`, if the installed transformers is newer than
`NEWEST_CHECKED`, or a fast path the tables expect on this release is off (a source digest they do not list, a
patch target missing), one `NewerReleaseWarning` names the release, the fast paths that are off, and says that
outputs are still exact. Every flagged call's `last_path().notice` carries the same text.

`scripts/drift_report.py` lists the same for a maintainer, with the changed sources, to port a new release.
"""

from __future__ import annotations

import threading
import warnings

from .. import path_report

# the newest transformers release the tables in targets/ were read against (keep in step with noxfile.TRANSFORMERS
# and README.md, "Supported transformers releases")
NEWEST_CHECKED = (5, 24, 0)

_LOCK = threading.Lock()
_STATE: dict = {}  # "text": the notice (None: nothing to say), computed once; "warned": the warning was given


class NewerReleaseWarning(UserWarning):
    """The installed transformers is one the package was not checked against: some fast paths are off there (the
    stock code runs instead, with identical outputs)."""


def installed_release() -> str:
    import transformers

    return transformers.__version__


def installed_version() -> tuple[int, ...]:
    from packaging.version import Version

    return Version(installed_release()).release


def is_newer(version: tuple[int, ...]) -> bool:
    return tuple(version) > NEWEST_CHECKED


def fast_paths_off(version: tuple[int, ...] | None = None) -> list[str]:
    """The fast paths the tables expect on `version` (default: the installed release) that are off here: shortcuts
    whose installed sources are not ones they were read against, and patch targets that are missing."""
    from .. import patching
    from . import verified
    from .targets import SHORTCUTS, TARGETS, present_in

    version = tuple(version or installed_version())[:2]
    off = [shortcut.name for shortcut in SHORTCUTS
           if present_in(shortcut, version) and not verified.matches(shortcut.name)
           and not verified.off_by_user_code(shortcut.name)]
    skipped = patching.skipped()
    off += [f"patch {target.name}" for target in TARGETS
            if target.name in skipped and present_in(target, version) and target.required]
    return off


def notice_text(version: tuple[int, ...] | None = None, off: list[str] | None = None) -> str | None:
    """The notice for the installed release (None: it is one the package was checked against, all paths on)."""
    version = tuple(version or installed_version())
    off = fast_paths_off(version) if off is None else off
    newer = is_newer(version)
    if not newer and not off:
        return None
    checked = ".".join(str(part) for part in NEWEST_CHECKED)
    release = f"transformers {installed_release()}"
    if newer:
        head = f"{release} is newer than the newest release transformers_async_stop was checked against ({checked})"
    else:
        head = f"{release}'s sources differ from the ones transformers_async_stop was checked against"
    paths = ("these fast paths are off: " + ", ".join(off)) if off else "no fast path found off"
    return (f"async_stopping_criteria=True: {head}; {paths}. Outputs are still exact (the stock code runs where a "
            "fast path is off). Run scripts/drift_report.py for the changed sources.")


def check() -> None:
    """At a flagged call: warn once per process if this release is not one the package was checked against, and
    put the notice on the call's `last_path()`."""
    if "text" not in _STATE:
        with _LOCK:
            if "text" not in _STATE:
                try:
                    _STATE["text"] = notice_text()
                except Exception:  # never let the notice break a call
                    _STATE["text"] = None
    text = _STATE["text"]
    if text is None:
        return
    report = path_report._current()
    if report is not None:
        report.notice = text
    with _LOCK:
        if _STATE.get("warned"):
            return
        _STATE["warned"] = True
    warnings.warn(text, NewerReleaseWarning, stacklevel=5)


def reset() -> None:
    """Forget the computed notice and that it was given (tests)."""
    with _LOCK:
        _STATE.clear()
