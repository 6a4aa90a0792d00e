"""Which path each `generate()` call took, and why: `last_path()` and the `transformers_async_stop` logger.

A call that asks for the flag (`async_stopping_criteria` set to True or False in the call, its generation config or
the model's) gets a `CallPath`. The decoding method's wrapper fills it in as it decides (`runs_stock` in
control/stock_path.py, `deferred_loop`, `static_loop`, `stock`), and when the call returns it becomes this thread's `last_path()` and one
INFO line of the logger. A `generate()` nested inside another one's processor or criterion has its own report; the
outer call ends later, so its report is the one left as `last_path()`. An assistant's own `generate()` inside
assisted decoding reports nothing: the assisted call's report covers it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading

from .config import FIELD
from .state.call_state import CALL, active_draft, compiling

logger = logging.getLogger("transformers_async_stop")

PATHS = ("stock", "immediate", "deferred", "static loop")
SYNCHRONOUS = ": the device is synchronous"  # the reason's tail that describe() leaves out
FLAG_OFF = "flag off"
NO_LOOP = "no deferred loop for this decoding method"
CUSTOM = "a `custom_generate` decoding loop is not ours to defer"


@dataclasses.dataclass
class CallPath:
    """The path one `generate()` call took.

    - path: "stock" (transformers' own loop), "immediate" (the package's loop, each stop verdict read at once: a
      returned cache that cannot give a step back), "deferred" (the verdict read one step late), or "static loop"
      (deferred, in the package's own static-cache loop);
    - reason: why "stock" or "immediate" (the `StockPathWarning` text, "CPU: the device is synchronous", "flag off");
      on the static loop, why it left its plan (in-place inputs, captured tail) for the rest of the call, or None;
    - tail: the static loop's step tail, "eager" or "captured" (replayed from CUDA graphs); None elsewhere;
    - graphs: CUDA graphs captured during the call;
    - method: "greedy", "sample", "beam search", "beam sample", "assisted", "prompt lookup", or None when no
      decoding method of the package's was reached;
    - loop: "dynamic" where a deferred call ran the package's dynamic-cache loop (inputs made from the previous
      step's), None where it ran transformers' own decoding loop with the package's stop check.
    """

    path: str = "stock"
    reason: str | None = None
    tail: str | None = None
    graphs: int = 0
    method: str | None = None
    loop: str | None = None
    # the dynamic loop's decode forward: "graphed (N pieces): ..." (`piecewise/`) or "eager: <why>", an assisted
    # call's draft forward "draft graphed ..." or "draft eager: <why>"; None elsewhere. describe() gives it short
    forward: str | None = dataclasses.field(default=None, compare=False)  # a detail: reports compare without it
    # an assisted call's verify forward (the target's K tokens, rounds after the first): "graphed (N pieces): R
    # rounds..." or "eager: <why>"; None elsewhere (`piecewise.forward_for(..., verify=True)`)
    verify: str | None = dataclasses.field(default=None, compare=False)
    # an assisted call's acceptance of each round: "graphed: R rounds..." (one CUDA graph per width) or "eager: <why>"
    # (`loops/assisted/acceptance_graph.py`); None elsewhere
    acceptance: str | None = dataclasses.field(default=None, compare=False)
    notice: str | None = None  # this transformers release was not checked: the fast paths off (`release_notice`)
    # the dynamic-cache loop's decode steps on CUDA at a key/value length this thread had not met: "12 new of 127"
    # (`loops/dynamic_loop/kv_lengths.py`: each costs a cuDNN plan, in stock too); None elsewhere
    attention_lengths: str | None = dataclasses.field(default=None, compare=False)

    def describe(self) -> str:
        """One line: "deferred, static loop, tail captured (2 graphs)", "deferred, dynamic loop, forward graphed
        (17 pieces)", "deferred, dynamic loop, forward eager: <why>", "deferred, verify forward graphed (17 pieces), draft forward
        graphed (3 pieces)", "stock: CPU", "stock: flag off"."""
        if self.path == "stock":
            return f"stock: {_short(self.reason)}" if self.reason else "stock"
        if self.path == "immediate":
            immediate = f"immediate: {self.reason}" if self.reason else "immediate"
            return f"{immediate}; {_forward(self.forward)}" if self.forward else immediate
        if self.path == "static loop":
            tail = f", tail {self.tail}" if self.tail else ""
            if self.graphs:
                tail += f" ({self.graphs} graph{'s' if self.graphs != 1 else ''})"
            return f"deferred, static loop{tail}" + (f"; left its plan: {self.reason}" if self.reason else "")
        deferred = "deferred, dynamic loop" if self.loop == "dynamic" else "deferred"
        verify = f", verify {_forward(self.verify)}" if self.verify else ""
        return f"{deferred}{verify}, {_forward(self.forward)}" if self.forward else deferred + verify


def _forward(forward: str) -> str:
    """`CallPath.forward`, short: "forward graphed (17 pieces)", "forward graphed (17 pieces), 3 steps eager: a hook
    was added", "forward eager: <why>"; an assistant's "draft forward ...". The count of replayed steps is left to
    `forward` (`piecewise.forward.PiecewiseForward._note` writes it)."""
    draft, text = ("draft ", forward[len("draft "):]) if forward.startswith("draft ") else ("", forward)
    if text.startswith("graphed"):
        # "graphed (P pieces): N decode steps", and where some steps ran eagerly "; E eager: <why>"
        graphed, _, steps = text.partition(": ")
        count, _, why = steps.partition("; ")[2].partition(" eager: ")
        unit = "round" if " rounds" in steps else "step"  # the verify forward counts rounds
        text = f"{graphed}, {count} {unit}{'s' if count != '1' else ''} eager: {why}" if why else graphed
    return f"{draft}forward {text}"


def _short(reason: str) -> str:
    return reason[: -len(SYNCHRONOUS)] if reason.endswith(SYNCHRONOUS) else reason


_CURRENT: contextvars.ContextVar[CallPath | None] = contextvars.ContextVar("transformers_async_stop_path",
                                                                          default=None)
_LAST = threading.local()


def last_path() -> CallPath | None:
    """The path of the last `generate()` call in this thread that asked for `async_stopping_criteria` (None
    before any)."""
    return getattr(_LAST, "path", None)


# --- the generate() wrapper ---------------------------------------------------------------------------------------
def begin(model, kwargs: dict):
    """Open the call's report if it asks for the flag; returns the token `end()` takes (None: nothing to report)."""
    outer = CALL.get()
    if outer is not None and outer.drafting is not None:
        return None  # an assistant's draft inside a deferred assisted call
    config = kwargs.get("generation_config")
    if getattr(config, "is_assistant", False):
        return None  # an assistant's generate() inside stock assisted decoding
    value = kwargs.get(FIELD)
    for source in (config, getattr(model, "generation_config", None)):
        if value is None:
            value = getattr(source, FIELD, None)
    if value is None:
        return None
    reason = None if value is True else FLAG_OFF
    if value is True and kwargs.get("custom_generate") is not None:
        reason = CUSTOM
    return _CURRENT.set(CallPath(reason=reason))


def end(token) -> None:
    """Close the call's report: it becomes `last_path()` and one logged line."""
    if token is None:
        return
    report = _CURRENT.get()
    _CURRENT.reset(token)
    if report is None:
        return
    if report.path == "stock" and report.reason is None:
        report.reason = NO_LOOP
    elif report.path == "deferred":
        report.reason = None  # (the static loop's is why it left its plan: `static_loop`)
    _LAST.path = report
    if logger.isEnabledFor(logging.INFO):
        method = f" [{report.method}]" if report.method else ""
        logger.info("generate()%s: %s", method, report.describe())


# --- what the decoding methods report -----------------------------------------------------------------------------
def _current() -> CallPath | None:
    return None if compiling() else _CURRENT.get()


def _own() -> CallPath | None:
    """The call's report for its own decisions: an assistant's draft inside a deferred assisted call has no report,
    and its decoding method's choices (its greedy or sample, its loop's verdicts) are not the assisted call's; only
    its forward is told there (`piecewise.forward_for`)."""
    return None if active_draft() is not None else _current()


def decided(method: str, stock_reason: str | None, deferred: bool) -> None:
    """A decoding method chose its loop (`stock_path.runs_stock`)."""
    report = _own()
    if report is None:
        return
    report.method = method
    if deferred:
        report.path, report.reason = "deferred", None
    else:
        report.path = "stock"
        report.reason = stock_reason or report.reason


def stock(reason: str | None) -> None:
    """A method that had chosen the deferred path handed the call to the stock loop after all."""
    report = _own()
    if report is not None:
        report.path, report.reason = "stock", reason


def warned(reason: str) -> None:
    """A `StockPathWarning` was given: its reason explains a stock call that has none yet."""
    report = _own()
    if report is None:
        return
    if report.path == "stock" and report.reason in (None, FLAG_OFF):
        report.reason = reason
    elif report.path == "deferred" and report.reason is None:
        report.reason = reason  # kept for `deferred_loop`, should the loop turn out to read at once


def deferred_loop(ctl) -> None:
    """A deferred loop returned: "immediate" if its controller read every verdict at once."""
    report = _own()
    if report is not None and report.path == "deferred" and getattr(ctl, "synchronous", False):
        report.path = "immediate"
        report.reason = (report.reason or getattr(ctl, "why_synchronous", None)
                         or "a returned cache that cannot give a step back")


def dynamic_loop() -> None:
    """The dynamic-cache loop runs this call's decoding (an assistant's draft loop is not reported: the assisted
    call's report covers it)."""
    report = _current()
    if report is not None and report.path == "deferred":
        report.loop = "dynamic"


def attention_lengths(text: str) -> None:
    """The dynamic-cache loop's count of new key/value lengths (`kv_lengths.Meter`)."""
    report = _current()
    if report is not None:
        report.attention_lengths = text


def static_loop(captured: bool, graphs: int, left: str | None = None) -> None:
    """The static-cache loop ran; its tail was `captured` into `graphs` CUDA graphs, or eager; `left`: why it left
    its plan mid-call (the rest of the call ran eagerly or on stock's per-step inputs)."""
    report = _current()
    if report is not None:
        report.path = "static loop"
        report.tail = "captured" if captured and graphs else "eager"
        report.graphs = graphs
        report.reason = left


def method_of(generation_config) -> str:
    return "sample" if getattr(generation_config, "do_sample", False) else "greedy"
