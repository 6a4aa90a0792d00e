"""Which threads are inside `generate()` now, and the lock a CUDA graph capture holds.

A capture of the static-cache loop's tail is not private to its thread:
- up to torch 2.12, `capture_begin` puts the device's default generator in capture mode until `capture_end`; a random
  op that another thread runs meanwhile raises ("Offset increment outside graph capture encountered unexpectedly");
- work another thread queues on, or makes wait on, the capturing stream lands inside the capture ("dependency created
  on uncaptured work in another stream").
So a capture is made only while no other thread is inside `generate()`, and no `generate()` starts while a capture is
under way (it waits the few milliseconds a capture takes). Two threads generating at once get an eager tail, with the
same output. Threads that draw random numbers on the GPU outside `generate()` are not seen here.
"""

from __future__ import annotations

import contextlib
import threading

_LOCK = threading.RLock()
_INSIDE: dict[int, int] = {}  # thread ident -> generate() calls of that thread under way (nested calls count)


@contextlib.contextmanager
def inside_generate():
    """Around one `generate()` call."""
    ident = threading.get_ident()
    with _LOCK:
        _INSIDE[ident] = _INSIDE.get(ident, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            left = _INSIDE[ident] - 1
            if left:
                _INSIDE[ident] = left
            else:
                del _INSIDE[ident]


@contextlib.contextmanager
def capture_turn():
    """Held around a capture; yields whether it may happen now (no other thread inside `generate()`)."""
    with _LOCK:
        ident = threading.get_ident()
        yield all(other == ident for other in _INSIDE)
