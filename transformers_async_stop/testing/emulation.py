"""Test-only: the package's CUDA graphs on the CPU, each emulated by the ATen ops its capture recorded.

In production the piecewise forward (`piecewise/`) is CUDA-only and steps aside on the CPU, so CI, which has no GPU,
would never run it. Inside `with emulated():` it runs on CPU models too, through the same recording and replay code
(`piecewise/graphs.py`), with this module standing in for `torch.cuda.CUDAGraph` and the streams:

- a capture runs its piece's ops (a CPU has no deferred launch) and records each ATen op it dispatches, with the
  very tensors it read and wrote; the capture's execution is the piece's first replay, as a CUDA graph's capture is
  followed by one (`piecewise/recorder._Recorder.end`);
- a replay runs the recorded ops again on the recorded tensors' memory (a storage rebound since, `p.data = x`, is
  not seen, as a graph keeps reading the old address), without any of the model's Python: an in-place or
  `out=` op runs again in place, an op whose output aliases an input (a view) is skipped (its output already is a
  window on the refreshed input), and any other op's fresh result is copied into the tensor the capture made. So
  what the model decided in Python while recording (shapes, branches, scalars) is baked in, as on CUDA;
- an op that reads the device on the host or has a data-dependent output shape (`.item()`, `nonzero`, `equal`...)
  fails the capture, as it invalidates a CUDA capture;
- streams are one: ordering is the program's;
- memory pools (`_Pool`): graphs captured into one pool share its memory, and CUDA's allocator may hand a later
  capture's tensors the memory an earlier capture freed (its temporaries). So a replay of a graph may overwrite any
  tensor a graph captured *after* it in the same pool made, still alive or not: PyTorch's contract is to replay a
  pool's graphs in their capture order and read nothing a later graph made once an earlier one replayed. The
  emulation makes that overwrite certain: each replay poisons (NaN, or a negative integer) every live tensor that a
  later capture of its pool made, the graph gone or not. Code that reads a replay's output after another graph of
  the pool replayed (an output handed to the caller and kept, such as scores aliasing a verify forward's logits)
  fails here as it would on CUDA only by chance (issue 43, item 1). A capture into a pool whose graphs are all gone
  fails, as CUDA's allocator asserts (it released the pool).

What it cannot show: the other CUDA-only faults (stream ordering, kernel choice). Those stay for the CUDA tests.
Never on outside tests: `active()` is false unless a test entered `emulated()`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..graphs import backend

_LOCK = threading.Lock()
_DEPTH = 0

_ATEN = torch.ops.aten
# host reads a CUDA capture refuses (a sync), beyond the ops torch tags as data-dependent
_HOST_READS = frozenset((_ATEN._local_scalar_dense.default, _ATEN.item.default, _ATEN.equal.default,
                         _ATEN.is_nonzero.default))
# (read by name: torch 2.6, the floor, has no `cudagraph_unsafe` tag)
_UNCAPTURABLE_TAGS = frozenset(getattr(torch.Tag, name) for name in (
    "data_dependent_output", "dynamic_output_shape", "cudagraph_unsafe") if hasattr(torch.Tag, name))


def active() -> bool:
    """Whether a test has the emulation on (process-wide: threads a test starts see it too)."""
    return _DEPTH > 0


def emulates(device: torch.device) -> bool:
    """Whether captures on `device` are emulated: a CPU device while a test has the emulation on (a CUDA device keeps
    its real graphs)."""
    return device.type == "cpu" and _DEPTH > 0


@contextlib.contextmanager
def emulated():
    """The package's graphs on CPU models, emulated (test-only; see the module docstring)."""
    global _DEPTH
    with _LOCK:
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _pinned(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Op:
    """One recorded ATen call and how a replay redoes it."""

    __slots__ = ("func", "args", "kwargs", "outputs", "kind")

    def __init__(self, func, args, kwargs, out):
        self.outputs = list(_tensors(out))
        # a CUDA graph reads and writes addresses: a tensor whose storage is rebound after the capture (`p.data = x`,
        # `.to()`) is not seen by a replay, which keeps the old memory. So the replay holds each argument as an alias
        # of the storage it had at the capture, not the Python object the program may rebind
        self.func, self.args, self.kwargs = func, tree_map(_pinned, args), tree_map(_pinned, kwargs)
        schema = func._schema
        writes = any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments)
        if writes:
            self.kind = "again"  # in place or out=: the same op on the same tensors
        elif not self.outputs:
            self.kind = "skip"  # a metadata query (no tensor out, no write)
        else:
            inputs = {_storage(t) for t in _tensors((args, kwargs)) if t.untyped_storage().nbytes()}
            aliased = [t for t in self.outputs if t.untyped_storage().nbytes() and _storage(t) in inputs]
            if aliased and len(aliased) != len(self.outputs):
                raise RuntimeError(f"emulated CUDA graph: {func} returns both views and new tensors")
            self.kind = "skip" if aliased else "copy"

    def __call__(self) -> None:
        if self.kind == "skip":
            return
        out = self.func(*self.args, **self.kwargs)
        if self.kind == "copy":
            for recorded, fresh in zip(self.outputs, _tensors(out)):
                recorded.copy_(fresh)


# indexing ops torch tags as data-dependent because a boolean index's output shape is its count of True values: with
# integer indices alone the shape is the indices' own, and CUDA captures them (GPT-J's `embed_positions[position_ids]`)
_INDEXING = frozenset((_ATEN.index.Tensor,))


def _integer_index(func, args) -> bool:
    if func not in _INDEXING or len(args) < 2:
        return False
    return all(index is None or (isinstance(index, torch.Tensor) and not index.dtype.is_floating_point
                                 and index.dtype is not torch.bool and index.dtype is not torch.uint8)
               for index in args[1])


class _Pool:
    """A memory pool shared by the graphs captured into it: what each capture made, in capture order, weakly (a
    tensor the program dropped is memory CUDA's allocator may reuse, and nothing here keeps it alive)."""

    def __init__(self):
        self.made: list = []  # per capture, in order: weak references to the tensors it made
        # the graphs captured into it: CUDA releases a pool once none is left, and a capture into it then asserts
        self.graphs: "weakref.WeakSet" = weakref.WeakSet()

    def poison_after(self, index: int) -> None:
        """What a replay of the pool's `index`-th capture may overwrite: every live tensor a later capture made."""
        with torch.inference_mode():  # an inference tensor is written only there; a normal one there too
            for later in self.made[index + 1:]:
                for ref in later:
                    tensor = ref()
                    if tensor is not None:
                        tensor.fill_(_poison(tensor.dtype))


def _poison(dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype is torch.bool:
        return True
    return -7777 if dtype.is_signed else 77


class _Capture(TorchDispatchMode):
    def __init__(self, ops: list, made: list):
        super().__init__()
        self.ops = ops
        self.made = made  # weak references to the tensors this capture made (fresh, or views of those)
        self._storages: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS or (_UNCAPTURABLE_TAGS.intersection(func.tags) and not _integer_index(func, args)):
            raise RuntimeError(f"emulated CUDA graph capture: {func} is not permitted while capturing (it reads the "
                               "device on the host or has a data-dependent output)")
        out = func(*args, **kwargs)
        op = _Op(func, args, kwargs, out)
        self.ops.append(op)
        for tensor in op.outputs:
            # pool memory: a fresh tensor, or a view of one this capture made (a view of a tensor made outside the
            # capture, the fixed input buffers, is not the pool's)
            if not tensor.untyped_storage().nbytes():
                continue
            storage = _storage(tensor)
            if op.kind == "copy":
                self._storages.add(storage)
            elif op.kind != "skip" or storage not in self._storages:
                continue
            self.made.append(weakref.ref(tensor))
        return out


class Graph:
    """Stands in for `torch.cuda.CUDAGraph` (the calls the package makes)."""

    def __init__(self):
        self.ops: list = []
        self._mode = None
        self._first_replay_done = False
        self._pool = None  # the pool it was captured into, and its place in that pool's captures
        self._index = None

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        if self._mode is not None or self.ops:
            raise RuntimeError("emulated CUDA graph: captured twice")
        # `pool`: another graph's `pool()` (shared memory, as `torch.cuda.graph(pool=...)`), or None for a new one
        if pool is not None and not isinstance(pool, _Pool):
            raise TypeError(f"emulated CUDA graph: pool={pool!r} is not an emulated graph's pool()")
        if pool is not None and not len(pool.graphs):
            raise RuntimeError("emulated CUDA graph: a capture into a pool whose graphs are all gone (CUDA has "
                               "released it: `it->second->use_count > 0` INTERNAL ASSERT FAILED)")
        self._pool = pool if pool is not None else _Pool()
        self._pool.graphs.add(self)
        made: list = []
        self._index = len(self._pool.made)
        self._pool.made.append(made)
        self._mode = _Capture(self.ops, made)
        self._mode.__enter__()

    def capture_end(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            raise RuntimeError("emulated CUDA graph: capture_end without capture_begin")
        mode.__exit__(None, None, None)

    def abort(self) -> None:
        """End a capture an exception interrupted (`graphs.record`'s clean-up)."""
        if self._mode is not None:
            self.capture_end()

    def pool(self):
        return self._pool

    def replay(self) -> None:
        if self._mode is not None:
            raise RuntimeError("emulated CUDA graph: replayed while capturing")
        if not self._first_replay_done:
            self._first_replay_done = True  # the capture ran the ops: that was this replay
            return
        self._pool.poison_after(self._index)
        with torch.no_grad():
            for op in self.ops:
                op()


class _Stream:
    def wait_stream(self, other) -> None:
        pass


_ONE_STREAM = _Stream()


class Backend:
    """The emulated counterparts of what the package's captures take from `torch.cuda`."""

    Graph = Graph

    @staticmethod
    def current_stream(device):
        return _ONE_STREAM

    @staticmethod
    def capture_stream(device):
        return _ONE_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def heal(graph, stream) -> None:
        graph.abort()


backend.install(sys.modules[__name__])  # the runtime's one hook (`graphs/backend.py`): it never imports this module
