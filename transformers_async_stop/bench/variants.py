"""The variants compared on every run, and how transformers is set up for each.

- stock:    transformers as shipped: this package unpatched (`unpatch()`, re-applied afterwards), no flag keyword;
- imported: this package applied, `async_stopping_criteria=False`;
- async:    this package applied, `async_stopping_criteria=True`;
- upstream: this package unpatched, transformers' own `DeferredStopCheck` (5.17+) forced on for CUDA;
- floor:    not a generate() set-up but a figure: GPU kernel time per decode step (CUDA only; see measure.py).

`variant(name)` sets one up and always leaves the package applied afterwards. The timed variants run rep by rep in a
rotated order (`rep_orders`), so that no variant is always first after another's compilation or clock change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import torch
import transformers

from .. import apply, is_patched, unpatch
from ..config import FIELD

TIMED = ("stock", "imported", "async", "upstream")
VARIANTS = TIMED + ("floor",)
UNPATCHED = ("stock", "upstream")

_active: str | None = None


@dataclasses.dataclass
class Selection:
    timed: list[str]  # in canonical order; rep_orders() rotates it
    floor: bool
    notes: list[str]


def select(requested: list[str] | None, device: torch.device) -> Selection:
    """The variants to run on this device and release (all by default), with a note for each one left out."""
    names = list(requested) if requested else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    notes = []
    timed = [v for v in TIMED if v in names]
    if "upstream" in timed and not upstream_available():
        timed.remove("upstream")
        notes.append(f"upstream skipped: transformers {transformers.__version__} has no DeferredStopCheck (5.17+)")
    elif "upstream" in timed and device.type != "cuda":
        notes.append("upstream on CPU is meaningless: DeferredStopCheck is forced on only for CUDA, so this row is "
                     "stock transformers")
    floor = "floor" in names and device.type == "cuda"
    if "floor" in names and not floor:
        notes.append("floor skipped: GPU kernel time needs CUDA")
    if not timed:
        raise SystemExit("no timed variant left to run (choose from stock, imported, async, upstream)")
    return Selection(timed, floor, notes)


def rep_orders(timed: list[str], reps: int) -> list[list[str]]:
    """Rep r runs the variants rotated by r: over len(timed) reps each variant comes first once."""
    k = len(timed)
    return [timed[r % k:] + timed[:r % k] for r in range(reps)]


def active() -> str | None:
    """The variant whose set-up is in force (None outside `variant()`); lets a case's processor check it."""
    return _active


def upstream_available() -> bool:
    gen_utils = importlib.import_module("transformers.generation.utils")
    return hasattr(gen_utils, "DeferredStopCheck")


@contextlib.contextmanager
def variant(name: str):
    """Set transformers up for one timed variant; yields its extra generate() kwargs. Leaves the package applied."""
    global _active
    if name not in TIMED:
        raise ValueError(f"not a timed variant: {name!r}")
    if name in UNPATCHED:
        unpatch()
        if is_patched():
            apply()
            raise RuntimeError("unpatch() left transformers_async_stop applied: the stock baseline would be wrong")
    else:
        apply()
    try:
        with _upstream_deferred_on_cuda() if name == "upstream" else contextlib.nullcontext():
            _active = name
            # unpatched transformers knows no flag keyword: stock and upstream get none
            yield {} if name in UNPATCHED else {FIELD: name == "async"}
    finally:
        _active = None
        apply()


@contextlib.contextmanager
def _upstream_deferred_on_cuda():
    """Upstream gates its DeferredStopCheck to MPS; open the gate for CUDA (the anchor we compare against)."""
    cls = importlib.import_module("transformers.generation.utils").DeferredStopCheck
    stored = vars(cls)["is_supported"]  # the staticmethod object itself, to put back exactly
    original = cls.is_supported

    def is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs):
        if torch.device(device).type == "cuda":
            # upstream's own rule, with "cuda" where it says "mps"
            return not is_assistant and (cache is None or getattr(cache, "is_croppable", False)
                                         or not cache_is_returned)
        return original(device, cache, cache_is_returned, is_assistant, *args, **kwargs)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        cls.is_supported = stored
