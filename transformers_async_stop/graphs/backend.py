"""Where the package's CUDA graphs and streams come from: CUDA, or on the CPU an emulation that a test installed.

Both graphed paths capture through `backend_for(device)`: the static loop's tail (`loops/static_loop/tail.py`) and
the piecewise forward (`piecewise/graphs.py`). The CPU emulation of CUDA graphs is test-only
(`transformers_async_stop.testing.emulation`): the package never imports it; importing it installs it here
(`install`), and even then it emulates only while a test has it on (`emulated()`). So `emulates(device)` is the one
"CPU under a test's emulation" check of the runtime code.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ..state import concurrency

_EMULATION = None  # the test-only emulation module, once a test imported it


def install(emulation) -> None:
    """The emulation (`testing/emulation.py`) registers itself here when imported."""
    global _EMULATION
    _EMULATION = emulation


def emulates(device: torch.device) -> bool:
    """Whether captures on `device` are emulated: a CPU device while a test has the emulation on (a CUDA device keeps
    its real graphs)."""
    emulation = _EMULATION
    return emulation is not None and emulation.emulates(device)


_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _capture_stream(device: torch.device) -> "torch.cuda.Stream":
    # a graph cannot be captured on the legacy default stream, where most callers run; one per device is enough,
    # since captures are serialised (`concurrency.capture_turn`)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _heal_generator(graph, stream) -> None:
    """After a capture that did not end cleanly: end it, and leave the default generator out of capture mode.

    Up to torch 2.12 `capture_end` raises before the generators' capture epilogue when the capture was invalidated
    (a host read inside it), and the generator stays in capture mode: every later random op in the process raises.
    An empty capture on the same generator runs the prologue and epilogue again. Captures never move the
    generator's own offset, so the state afterwards is the one before the failed capture."""
    with contextlib.suppress(Exception):
        with torch.cuda.stream(stream):
            graph.capture_end()
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            empty.capture_begin(capture_error_mode="thread_local")
            empty.capture_end()


class _Cuda:
    """What a capture takes from `torch.cuda` (the tests' emulation's `Backend` stands in for it on the CPU)."""

    @staticmethod
    def Graph():
        return torch.cuda.CUDAGraph()

    current_stream = staticmethod(torch.cuda.current_stream)
    capture_stream = staticmethod(_capture_stream)
    stream = staticmethod(torch.cuda.stream)
    heal = staticmethod(_heal_generator)


def backend_for(device):
    """CUDA's graphs and streams; on the CPU, inside a test's `emulated()`, their emulation."""
    return _EMULATION.Backend if emulates(device) else _Cuda


def capture(device, pool, body):
    """`body()` captured into a new graph on the device's capture stream: (graph, body's outputs), not replayed yet;
    None where another thread is inside `generate()` (a capture waits its turn, `concurrency.capture_turn`).

    Whatever happens inside the capture, nothing global is left behind: a capture that fails, or is interrupted,
    leaves the device's random generator as it found it (`heal`), and the exception propagates (the caller's to
    judge: its step then runs eagerly). The main stream waits for the capture stream at the end either way:
    `capture_begin` (the heal's too) resets the generator's graph-RNG tensors (seed and philox offset, shared by
    every graph of the generator) with two real kernels on the capture stream, outside the capture; a replay on the
    main stream writes the offset it must use into the same tensor, then launches. Without this wait the reset could
    land after the replay's write while a slow forward holds both streams back, and the step would draw with offset 0.
    """
    with concurrency.capture_turn() as alone:
        if not alone:
            return None
        backend = backend_for(device)
        graph = backend.Graph()
        main = backend.current_stream(device)
        stream = backend.capture_stream(device)
        stream.wait_stream(main)
        began = False
        try:
            with backend.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                began = True
                outputs = body()
                graph.capture_end()
        except BaseException:
            if began:
                backend.heal(graph, stream)
            raise
        finally:
            main.wait_stream(stream)
    return graph, outputs
