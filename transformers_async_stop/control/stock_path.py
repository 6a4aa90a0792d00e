"""Whether a decoding method runs its stock loop, and the one warning when the flag was asked for where it cannot run.

Each decoding method's wrapper asks `runs_stock` once per call; the choice and its reason go to the call's
`path_report`.
"""

from __future__ import annotations

import warnings

from .. import path_report
from ..config import StockPathWarning, flag_of, force_deferred
from ..release_checks import release_notice
from ..state.call_state import active_draft


def warn_stock(reason: str, stacklevel: int = 4) -> None:
    path_report.warned(reason)
    warnings.warn(
        f"async_stopping_criteria=True: {reason}; running the stock generation loop instead "
        "(identical output, one blocking read per step).",
        StockPathWarning,
        stacklevel=stacklevel,
    )


def runs_stock(generation_config, device, why_stock, method: str | None = None) -> bool:
    """Whether a decoding method must run its stock loop: the flag is off, the loop is an assistant's, the device is
    synchronous, or the method's own `why_stock()` gives a reason (warned once; "" means silently). The choice and
    its reason go to the call's `path_report`; `method` names the decoding method there (default: greedy/sample)."""
    method = method or path_report.method_of(generation_config)
    if not flag_of(generation_config):
        path_report.decided(method, path_report.FLAG_OFF, deferred=False)
        return True
    release_notice.check()  # a release the package was not checked against: said once per process
    if getattr(generation_config, "is_assistant", False) and active_draft() is None:
        return True  # an assistant's own loop inside stock assisted decoding runs stock silently: the caller warned
    if device.type != "cuda" and not force_deferred():
        # CPU / MPS: nothing to gain, the flag is accepted and the stock path runs, silently
        path_report.decided(method, f"{device.type.upper()}{path_report.SYNCHRONOUS}", deferred=False)
        return True
    reason = why_stock()
    if reason is None:
        path_report.decided(method, None, deferred=True)
        return False
    path_report.decided(method, None, deferred=False)
    if reason:
        warn_stock(reason, stacklevel=5)
    return True
