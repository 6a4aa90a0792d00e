"""One decode forward, recorded as CUDA graphs of its shape-fixed pieces, and its replay.

**Recording** runs the model's own forward once, on the capture stream, with two interceptions:
- `cache.update` (an attribute of the call's cache object, for the recording only) ends the capture of the current
  piece, replays it on the main stream (this step's real q/k/v), and runs the real `DynamicLayer.update` eagerly;
- the attention function (transformers' registry entry for `sdpa`, swapped for the recording only, and passing
  through to the original for every call that is not this recording's) runs the real attention eagerly on the main
  stream, copies its output into a fixed buffer, and begins the capture of the next piece, which reads that buffer.
So piece 0 is embedding + rotary + layer 0's norm, q/k/v projections and rotary; piece i (1..L-1) is layer i-1's
o_proj, residual, post-attention norm, MLP and residual, and layer i's norm, projections and rotary; piece L ends
with the final norm and the LM head. The kernels are the eager ones (a CUDA graph replays the launches it captured).

The forward is handed fixed `input_ids` / `position_ids` buffers and, as its `attention_mask`, a 4D sentinel: a 4D
mask is returned as it is by `create_causal_mask` (its first line), so no mask work lands in a piece. The real
attention gets what stock's `create_causal_mask` gives it for the step (`forward.PiecewiseForward._attention_mask`):
the loop's grown 4D mask, or None for an unpadded batch (SDPA's own causal path).

**Replay**: copy the step's ids and positions into the buffers; replay piece 0; per layer, the real `cache.update`
of the piece's k/v and the real attention (looked up in the registry as the model looks it up) with the recorded
arguments, its output copied into the buffer; replay the next piece. The returned cache holds the tensors
`DynamicLayer.update` made, as in stock, under the running release's field name (`past_key_values` up to 5.23,
`cache` from 5.24: `cache_kwarg.py`).

All pieces of a model share one memory pool and are replayed in the order they were captured; every tensor that
crosses a piece boundary is kept referenced by the recording, so no later capture reuses its memory.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ...release_checks import cache_kwarg
from ...state import concurrency
from ..backend import backend_for

_ACTIVE: contextvars.ContextVar["_Recorder | None"] = contextvars.ContextVar("tas_piecewise_recorder", default=None)
_SCALARS = (bool, int, float, str, type(None))
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class NotRecordable(Exception):
    """The forward did something a replay could not reproduce; the reason is the message."""


class CaptureFailed(Exception):
    """`record`'s own failure other than `NotRecordable` (the device refused the capture, or its pool ran out of
    memory): the cache is as it was before the step, which runs again eagerly. The message names the error, its
    cause."""


class Recording:
    """The graphs and fixed buffers of one (model, batch, dtype, mask kind, ...) key."""

    def __init__(self, ids, positions, sentinel):
        self.ids, self.positions, self.sentinel = ids, positions, sentinel
        self.graphs: list = []
        self.layers: list = []  # per layer: (layer_idx, q, k, v, attention kwargs (positions marked), output buffer)
        self.logits = None
        self.output_type = None
        self.pool = None
        self.capture_seconds = 0.0

    def replay(self, cache, input_ids, position_ids, mask, attention_fn, modules):
        self.ids.copy_(input_ids)
        self.positions.copy_(position_ids)
        graphs = self.graphs
        graphs[0].replay()
        update = type(cache).update
        for i, (layer_idx, q, k, v, kwargs, out) in enumerate(self.layers):
            keys, values = update(cache, k, v, layer_idx)
            if _POSITIONS in kwargs.values():
                kwargs = {name: (self.positions if value is _POSITIONS else value) for name, value in kwargs.items()}
            result = attention_fn(modules[i], q, keys, values, mask, **kwargs)[0]
            out.copy_(result)
            graphs[i + 1].replay()
        return self.output_type(logits=self.logits, **cache_kwarg.output_field(cache))


def _plain_update(args, kwargs) -> bool:
    """A `cache.update(k, v, layer_idx)` call a replay's `update(cache, k, v, layer_idx)` reproduces: no further
    argument, or (5.24+, whose attention forwards call `cache.update(..., kwargs=kwargs)`) only the attention's
    `kwargs` dict, which `Cache.update` hands to `DynamicLayer.update`'s `**kwargs` and that ignores (both digested in
    `targets/piecewise_rows.py`)."""
    return not args and (not kwargs or (kwargs.keys() == {"kwargs"} and type(kwargs["kwargs"]) is dict))


class _Marker:
    def __repr__(self):
        return "<positions buffer>"


_POSITIONS = _Marker()


def _intercept(original):
    def attention(*args, **kwargs):
        recorder = _ACTIVE.get()
        if recorder is None or not args or args[0] is not recorder.expected_module():
            return original(*args, **kwargs)
        return recorder.attention(original, args, kwargs)

    attention._tas_piecewise_original = original
    return attention


@contextlib.contextmanager
def _swapped_attention(impl: str):
    """The registry entry `impl` replaced by the interceptor for the recording; restored whatever happens."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, before = impl in local, local.get(impl)
    original = ALL_ATTENTION_FUNCTIONS[impl]
    local[impl] = _intercept(original)
    try:
        yield
    finally:
        if had:
            local[impl] = before
        else:
            local.pop(impl, None)


class _Recorder:
    """The state of one recording forward (see the module docstring)."""

    def __init__(self, recording: Recording, cache, modules, real_mask, main, stream, pool, backend):
        self.rec, self.cache, self.modules, self.real_mask = recording, cache, modules, real_mask
        self.main, self.stream, self.pool, self.backend = main, stream, pool, backend
        self.graph = None  # the piece under capture
        self.pending = None  # (layer_idx, k, v, keys, values) between an update and its attention
        self.saved = []  # (layer, keys, values) before this step's update: restored if the recording fails
        self.raised = None  # an exception of the code the recording runs eagerly, as stock runs it (`_eager`)

    def expected_module(self):
        index = len(self.rec.layers)
        return self.modules[index] if index < len(self.modules) else None

    def begin(self) -> None:
        graph = self.backend.Graph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graph = graph

    def end(self) -> None:
        graph = self.graph
        graph.capture_end()  # if this raises (an invalidated capture), `record` heals the generator from `self.graph`
        self.graph = None
        # `capture_begin` resets the generator's graph-RNG tensors with real kernels on the capture stream; the
        # main stream's replays and random draws come after them (as in `static_loop/tail.py`)
        self.main.wait_stream(self.stream)
        if self.pool is None:
            self.pool = graph.pool()
        self.rec.graphs.append(graph)
        with self.backend.stream(self.main):
            graph.replay()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        index = len(self.rec.layers)
        if self.pending is not None or not _plain_update(args, kwargs) or layer_idx != index or self.graph is None:
            raise NotRecordable(f"an unexpected cache update (layer {layer_idx})")
        self.end()
        layer = self.cache.layers[layer_idx] if layer_idx < len(self.cache.layers) else None
        if layer is not None:
            self.saved.append((layer, getattr(layer, "keys", None), getattr(layer, "values", None),
                               getattr(layer, "is_initialized", True)))
        with self.backend.stream(self.main):
            keys, values = self._eager(type(self.cache).update, self.cache, key_states, value_states, layer_idx)
        self.pending = (layer_idx, key_states, value_states, keys, values)
        return keys, values

    def attention(self, original, args, kwargs):
        if self.pending is None or len(args) != 5:
            raise NotRecordable("an attention call the recording did not expect")
        module, query, keys, values, mask = args
        layer_idx, k, v, cache_keys, cache_values = self.pending
        self.pending = None
        if keys is not cache_keys or values is not cache_values:
            raise NotRecordable("the attention's keys/values are not the cache's")
        if mask is not self.rec.sentinel:
            raise NotRecordable("the attention's mask is not the forward's")
        recorded = {}
        for name, value in kwargs.items():
            if value is self.rec.positions:
                recorded[name] = _POSITIONS
            elif isinstance(value, _SCALARS):
                recorded[name] = value
            else:
                raise NotRecordable(f"the attention's argument {name!r} is a {type(value).__name__}")
        with self.backend.stream(self.main):
            output, weights = self._eager(original, module, query, keys, values, self.real_mask, **kwargs)
            if weights is not None:
                raise NotRecordable("the attention returns weights")
            buffer = torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
            buffer.copy_(output)
        self.rec.layers.append((layer_idx, query, k, v, recorded, buffer))
        self.stream.wait_stream(self.main)
        self.begin()
        return buffer, None

    def _eager(self, function, *args, **kwargs):
        """`function` run outside any capture, as stock runs it (the real cache update, the attention function
        registered for "sdpa", a user's maybe): what it raises is its own, whatever its message says (red team hole
        R12: "could not capture ..." from a user's attention), and reaches the caller as stock's raises it."""
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            # out of memory stays the recording's (`capture_failure`): its pool holds memory stock's forward has free
            if not isinstance(error, _OUT_OF_MEMORY):
                self.raised = error
            raise

    def raised_by_eager_code(self, error: BaseException) -> bool:
        """`error` is, or was raised while handling or from, an exception of the code run eagerly (`_eager`)."""
        seen = set()
        while error is not None and id(error) not in seen:
            if error is self.raised:
                return True
            seen.add(id(error))
            error = error.__cause__ or error.__context__
        return False

    def restore_cache(self) -> None:
        """The cache as it was before this step (a failed recording's step runs again eagerly)."""
        for layer, keys, values, initialized in reversed(self.saved):
            layer.keys, layer.values, layer.is_initialized = keys, values, initialized
        self.saved.clear()


def record(model, model_forward, inputs: dict, cache, modules, real_mask, impl: str, pool):
    """Record the decode forward for `inputs`; (Recording, this step's outputs). Raises `NotRecordable` or
    `CaptureFailed` (nothing of this step done: the cache is as it was; `capture_failure`), or what the forward
    raised otherwise; returns None when another thread is inside
    generate() (a capture is not private then: `concurrency.py`)."""
    import time

    device = inputs["input_ids"].device
    batch = inputs["input_ids"].shape[0]
    recording = Recording(inputs["input_ids"].clone(), inputs["position_ids"].clone(),
                          torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device))
    kwargs = dict(inputs)
    kwargs.update(input_ids=recording.ids, position_ids=recording.positions, attention_mask=recording.sentinel)
    started = time.perf_counter()
    with concurrency.capture_turn() as alone:
        if not alone:
            return None
        backend = backend_for(device)
        main = backend.current_stream(device)
        stream = backend.capture_stream(device)
        recorder = _Recorder(recording, cache, modules, real_mask, main, stream, pool, backend)
        stream.wait_stream(main)
        token = _ACTIVE.set(recorder)
        cache.update = recorder.update  # the call's own cache object, for this forward only
        try:
            with _swapped_attention(impl), backend.stream(stream):
                recorder.begin()
                outputs = model_forward(**kwargs)
                if len(recording.layers) != len(modules) or recorder.pending is not None:
                    raise NotRecordable("the forward did not run every layer's attention once")
                _check_outputs(outputs, cache)
                recorder.end()
        except BaseException as error:
            if recorder.graph is not None:
                backend.heal(recorder.graph, stream)
            main.wait_stream(stream)
            if recorder.raised_by_eager_code(error) or not capture_failure(error):
                # the model's or the user's own exception (or a KeyboardInterrupt): it reaches the caller, with the
                # cache as stock's forward leaves it (the layers updated before the raise keep their update)
                raise
            recorder.restore_cache()  # the step runs again eagerly (`forward.PiecewiseForward._record`)
            if isinstance(error, NotRecordable):
                raise
            raise CaptureFailed(f"{type(error).__name__}: {error}") from error
        finally:
            del cache.update
            _ACTIVE.reset(token)
    recording.logits = outputs.logits
    recording.output_type = type(outputs)
    recording.pool = recorder.pool
    recording.capture_seconds = time.perf_counter() - started
    return recording, outputs


# where a forward looks up the torch functions it calls: a name rebound there after the recording (user code setting
# `torch.nn.functional.silu = ...`) is one stock's next forward calls and a replay never does
_TORCH_NAMESPACES = (torch, torch.nn.functional, torch._C._nn, torch.special, torch.linalg)


def _codes(function, seen: set) -> None:
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    while code is None and hasattr(function, "__wrapped__"):  # a decorator's wrapper: the wrapped function's code
        function = function.__wrapped__
        code = getattr(function, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        if code not in seen:
            seen.add(code)
            stack += [const for const in code.co_consts if hasattr(const, "co_names")]
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None and wrapped is not function:
        _codes(wrapped, seen)


def code_names(function) -> set:
    """Every name the code of `function` (its nested functions and wrapped functions included) looks up."""
    codes: set = set()
    _codes(function, codes)
    names: set = set()
    for code in codes:
        names.update(code.co_names)
    return names


def watched_functions(model, module) -> list:
    """(namespace, name, object) for every torch function or tensor method name the Python a replay skips looks up:
    the names in the code of each module class's own `forward` / `__call__` (the model's, and torch's own modules')
    and of the modeling module's functions they call (`module`'s functions). A name rebound in `torch`,
    `torch.nn.functional`... or set on `torch.Tensor` after the recording makes it stale
    (`staleness.ModelGraphs.changed`). A pass over the code objects, not a trace of the recording: a function mode or
    profiler active while recording would change what torch calls (a `TorchFunctionMode` makes `F.silu` look its own
    name up again)."""
    codes: set = set()
    for cls in {type(m) for m in model.modules()}:
        for klass in cls.__mro__:
            if klass is torch.nn.Module or klass is object:
                continue
            for attr in ("forward", "__call__"):
                if attr in vars(klass):
                    _codes(vars(klass)[attr], codes)
    for value in list(vars(module).values()):
        if callable(value) and getattr(value, "__module__", None) == module.__name__ and hasattr(value, "__code__"):
            _codes(value, codes)
    names = set()
    for code in codes:
        names.update(code.co_names)
    entries = []
    for namespace in _TORCH_NAMESPACES:
        table = vars(namespace)
        entries += [(table, name, table[name]) for name in names if name in table]
    tensor_table, base = vars(torch.Tensor), torch._C.TensorBase
    # operators are looked up by the interpreter, not by name in the code (`residual + hidden_states`)
    names.update(_TENSOR_OPERATORS)
    entries += [(tensor_table, name, tensor_table.get(name)) for name in names if hasattr(base, name)]
    return entries


_TENSOR_OPERATORS = tuple(f"__{op}__" for op in (
    "add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "truediv", "rtruediv", "itruediv",
    "matmul", "rmatmul", "pow", "rpow", "neg", "pos", "getitem", "setitem", "and", "or", "invert", "eq", "ne", "lt",
    "le", "gt", "ge", "mod", "floordiv"))


def capture_failure(error: BaseException) -> bool:
    """Whether `error`, raised while a piece was under capture (not by the code `_Recorder._eager` runs between the
    pieces: that is stock's code and the user's, whose errors are theirs whatever they say), is the recording's own
    failure: the forward did something a graph cannot hold (a host read or a data-dependent shape invalidates a CUDA
    capture: "operation not permitted when stream is capturing", and the emulation says "not permitted while
    capturing"), the capture ran out of its pool's memory, or the recording refused the forward (`NotRecordable`).
    The step then runs again eagerly, as stock runs it. Any other exception is one the model's code raised while it
    ran: stock raises it too, at this very point, so it is raised, not retried (a retry would run that code twice and
    could return where stock raises)."""
    if isinstance(error, NotRecordable):
        return True
    if isinstance(error, _OUT_OF_MEMORY):
        return True  # the eager retry allocates as stock does, and raises there if stock would
    return isinstance(error, RuntimeError) and "captur" in str(error).lower()


def _check_outputs(outputs, cache) -> None:
    """A replay returns the logits and the cache, nothing else."""
    if (not isinstance(getattr(outputs, "logits", None), torch.Tensor)
            or cache_kwarg.of_output(outputs) is not cache
            or getattr(outputs, "hidden_states", None) is not None or getattr(outputs, "attentions", None) is not None
            or getattr(outputs, "loss", None) is not None):
        raise NotRecordable("the forward's outputs are not the logits and the cache alone")
