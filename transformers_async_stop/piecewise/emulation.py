"""Moved to `transformers_async_stop.graph_emulation` (the static loop's captures use it too)."""

from ..graph_emulation import Backend, Graph, active, emulated  # noqa: F401
