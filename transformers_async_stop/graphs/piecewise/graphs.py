"""One decode forward, recorded as CUDA graphs of its shape-fixed pieces, and its replay.

**Recording** runs the model's own forward once, on the capture stream, with two interceptions:
- `cache.update` (an attribute of the call's cache object, for the recording only) ends the capture of the current
  piece, replays it on the main stream (this step's real q/k/v), and runs the real `DynamicLayer.update` eagerly;
- the attention function (whatever the forward looks up under the model's attention implementation: the registry's
  entry for "sdpa", "flex_attention"..., the modeling module's `eager_attention_forward`, GPT-J's `_attn` method up to
  5.23; `attention.py`), swapped for the recording only, and passing through to the original for every call that is
  not this recording's, runs the real attention eagerly on the main stream, copies its output into a fixed buffer,
  and begins the capture of the next piece, which reads that buffer. Eager attention also returns its weights: the
  forward gets a stand-in that refuses the recording if any op touches it (`_UnreadWeights`; the decoder layers drop
  them).
Where the attention's keys and values are derived from the update's results by a method of the attention module
(multi-head latent attention's `expand_kv`: `attention.Cut.derive`), the update begins a piece of its own (the
forward's fixed-shape ops up to that call: the query's concatenation), the method's call ends it and runs eagerly, and
its results must be what the attention gets (`derive`).
The decoder of an encoder-decoder model (Whisper's: `family.Family.cross_attention`) has two attention sites per
layer: the self-attention, cut as above at the update of the call's `EncoderDecoderCache`'s `self_attention_cache`
(the interception goes on that inner object), and the cross-attention, whose keys and values are, by identity, the
cross-attention cache layer's tensors as the step began (no op, no update: its `is_updated` branch). At that call the
piece ends, the attention runs eagerly (its output copied into a buffer) and the next piece begins; each replay hands
it the cross-attention cache's tensors of the step's own cache, never an address the recording saw.
So piece 0 is embedding + rotary + layer 0's norm, q/k/v projections and rotary; piece i (1..L-1) is layer i-1's
o_proj, residual, post-attention norm, MLP and residual, and layer i's norm, projections and rotary; piece L ends
with the final norm and the LM head. The kernels are the eager ones (a CUDA graph replays the launches it captured).

The forward is handed fixed `input_ids` / `position_ids` buffers and, as its `attention_mask`, a 4D sentinel: a 4D
mask is returned as it is by `create_causal_mask` (its first line), so no mask work lands in a piece. With SDPA the
real attention of a one-token step gets what stock's `create_causal_mask` gives it for the step, known on the host
(`steps.attention_mask`): the loop's grown 4D mask, or None for an unpadded batch (SDPA's own causal path). Any other
implementation needs its mask made at every step (eager attention a materialised 4D float mask, never skipped; flex
attention a block mask): its one-token recordings make their masks as the K-token ones below do.

**Replay** (`recording.py`): copy the step's ids and positions into the buffers; replay piece 0; per layer, the real
`cache.update` of the piece's k/v and the real attention (looked up as the model looks it up, `attention.function`)
with the recorded arguments, its output copied into the buffer; replay the next piece. The returned cache holds the tensors
`DynamicLayer.update` made, as in stock, under the running release's field name (`past_key_values` up to 5.23,
`cache` from 5.24: `cache_kwarg.py`).

All pieces of a model share one memory pool and are replayed in the order they were captured; every tensor that
crosses a piece boundary is kept referenced by the recording, so no later capture reuses its memory.

**A forward of K > 1 tokens** (assisted decoding's verify forward, the draft's two-token prefill), and a one-token
forward under any attention implementation other than SDPA, is recorded the same way, with the pieces' shapes K
tokens wide. Its attention mask is not one the host knows: stock builds a 4D mask
inside the forward (`create_causal_mask` -> `sdpa_mask`, padding included; it never skips it at K > 1). So the
recording also intercepts the modeling module's mask functions (`create_causal_mask`, and Gemma 3's sliding one): each
call returns a sentinel of its own, and its keyword arguments are recorded (the config, the embeddings tensor of
piece 0, the mask, the cache, the positions). Every replay then calls the module's mask function itself, eagerly,
after piece 0 and before the first cache update (where stock calls it), with the step's own 2D mask, cache and
positions: the attention gets stock's mask, made by stock's code from the same inputs. The embeddings tensor is piece
0's output (a fixed buffer, this step's values by then); the mask functions read its shape, dtype and device.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ...release_checks import cache_kwarg
from ...state import concurrency
from ..backend import backend_for
from . import additive_mask, masks
from .masks import POSITIONS, SCALARS
from .proof import attention as sites
from .recording import Recording  # noqa: F401 (a recording's graphs and buffers, and its replay)

_ACTIVE: contextvars.ContextVar["_Recorder | None"] = contextvars.ContextVar("tas_piecewise_recorder", default=None)
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# the step's ids, positions and mask under a decoder-only model's names, and under an encoder-decoder's decoder's
DECODER_ONLY_INPUTS = ("input_ids", "position_ids", "attention_mask")
ENCODER_DECODER_INPUTS = ("decoder_input_ids", "decoder_position_ids", "decoder_attention_mask")
# an encoder-decoder's output fields that carry the encoder's outputs (`Seq2SeqLMOutput`) -> the `BaseModelOutput`'s
ENCODER_FIELDS = {"encoder_last_hidden_state": "last_hidden_state", "encoder_hidden_states": "hidden_states",
                  "encoder_attentions": "attentions"}


class NotRecordable(Exception):
    """The forward did something a replay could not reproduce; the reason is the message."""


class CaptureFailed(Exception):
    """`record`'s own failure other than `NotRecordable` (the device refused the capture, or its pool ran out of
    memory): the cache is as it was before the step, which runs again eagerly. The message names the error, its
    cause."""


def _outside_dispatch_modes():
    """The code a recording runs eagerly between the pieces runs as stock runs it, outside the watch's op log (a
    dispatch mode, `proof/watch.py`; the only one a recording runs under: `steps.why_mode`), which is paused there
    anyway: a higher-order op (flex attention's) refuses a mode that does not declare it handles them."""
    if not torch._C._len_torch_dispatch_stack():
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _plain_update(args, kwargs) -> bool:
    """A `cache.update(k, v, layer_idx)` call a replay's `update(cache, k, v, layer_idx)` reproduces: no further
    argument, or (5.24+, whose attention forwards call `cache.update(..., kwargs=kwargs)`) only the attention's
    `kwargs` dict, which `Cache.update` hands to `DynamicLayer.update`'s `**kwargs` and that ignores (both digested in
    `targets/piecewise_rows.py`)."""
    return not args and (not kwargs or (kwargs.keys() == {"kwargs"} and type(kwargs["kwargs"]) is dict))


def _intercept(original):
    def attention(*args, **kwargs):
        recorder = _ACTIVE.get()
        if recorder is None or not args or args[0] is not recorder.expected_module():
            return original(*args, **kwargs)
        return recorder.attention(original, args, kwargs)

    attention._tas_piecewise_original = original
    return attention


def _intercept_derivation(original):
    def derive(*args, **kwargs):
        recorder = _ACTIVE.get()
        if recorder is None or not args or args[0] is not recorder.expected_module():
            return original(*args, **kwargs)
        return recorder.derive(original, args, kwargs)

    derive._tas_piecewise_original = original
    return derive


def _swapped_attention(impl: str):
    """transformers' registry entry `impl` replaced by the interceptor for the recording; restored whatever happens
    (the registry case of `attention.swapped`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sites.swapped_entry(ALL_ATTENTION_FUNCTIONS, impl, _intercept)


class _UnreadWeights(torch.Tensor):
    """The attention weights a recording hands the forward where the attention function returned some (eager
    attention does; SDPA returns None): a tensor, so that the forward's Python takes stock's path, which no op may
    touch (transformers' decoder layers drop it). A replay has no weights: an op on them inside a piece would read the
    recording's, so it refuses the recording instead."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise NotRecordable("the forward used the attention weights (a replay computes none)")


class _Recorder:
    """The state of one recording forward (see the module docstring)."""

    def __init__(self, recording: Recording, cache, modules, real_mask, main, stream, pool, backend):
        self.rec, self.cache, self.modules, self.real_mask = recording, cache, modules, real_mask
        self.main, self.stream, self.pool, self.backend = main, stream, pool, backend
        # K > 1 (`recording.mask_module` set; `real_mask` is then the step's own mask): one sentinel per possible mask
        # call (made by `record` before the capture: the i-th call returns the i-th), the mask functions themselves
        # (the module holds the interceptors meanwhile) and the real masks, made before the first cache update as
        # stock makes them
        self.sentinels: list = []
        self.originals: list = []
        self.real_masks: list | None = None
        self.graph = None  # the piece under capture
        self.pending = None  # (layer_idx, k, v, keys, values) between an update and its attention
        self.saved = []  # (layer, its attributes) before this step's update: restored if the recording fails
        self.config = None  # the model's config (`record`)
        self.raised = None  # an exception of the code the recording runs eagerly, as stock runs it (`_eager`)
        self.watch = None  # what the run executed, (`proof/watch.py`)
        # a cut with a derivation (`attention.Cut.derive`): the layer's state between its update and its attention,
        # None (no derivation), False (its piece under capture, the method not called yet) or True (called)
        self.derives = False
        self.derived = None
        # an encoder-decoder's decoder (`family.Family.cross_attention`): per attention site (one per module, in call
        # order) its cache layer and whether it is a cross-attention (no update, the cross-attention cache's keys and
        # values); the cross-attention cache and each of its layers' (keys, values) as the step began. A decoder-only
        # model: a site per layer, none a cross-attention
        self.site_layers = range(len(modules))
        self.cross_sites = None
        self.cross_cache = None
        self.cross_held = None

    def expected_module(self):
        index = len(self.rec.layers)
        return self.modules[index] if index < len(self.modules) else None

    def begin(self) -> None:
        with self.quiet():
            graph = self.backend.Graph()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self.graph = graph
        if self.watch is not None:
            self.watch.between = False

    def quiet(self):
        """The recorder's own work (captures, replays, buffers), unseen by the run's watch (`proof/watch.py`)."""
        return self.watch.paused() if self.watch is not None else contextlib.nullcontext()

    def end(self) -> None:
        if self.watch is not None:
            self.watch.between = True
        with self.quiet():
            self._end()

    def _end(self) -> None:
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
        if self.pending is not None:
            # the previous layer's attention never reached transformers' attention registry (Falcon calls
            # `F.scaled_dot_product_attention` itself): it would have been captured over a cache that grows
            raise NotRecordable(f"layer {self.pending[0]}'s attention does not go through transformers' attention "
                                "functions")
        if (not _plain_update(args, kwargs) or index >= len(self.site_layers) or layer_idx != self.site_layers[index]
                or (self.cross_sites is not None and self.cross_sites[index]) or self.graph is None):
            raise NotRecordable(f"an unexpected cache update (layer {layer_idx})")
        self.end()
        if self.mask_module is not None and self.real_masks is None:
            # stock's forward made its masks before any layer ran, with the cache as it was before this step
            if not self.rec.mask_calls:
                raise NotRecordable("the forward made no mask the recording saw")
            with self.backend.stream(self.main):
                self.real_masks = [self._eager(masks.mask_call, function, kwargs, self.real_mask, self.cache,
                                               self.rec.positions)
                                   for function, (_, kwargs) in zip(self.originals, self.rec.mask_calls)]
        layer = self.cache.layers[layer_idx] if layer_idx < len(self.cache.layers) else None
        if layer is not None:
            # its attributes (shallow): the update binds new tensors and counters (a sliding layer's
            # `cumulative_length` too), writing into none it held
            self.saved.append((layer, dict(vars(layer))))
        with self.backend.stream(self.main):
            keys, values = self._eager(type(self.cache).update, self.cache, key_states, value_states, layer_idx)
        self.pending = (layer_idx, key_states, value_states, keys, values)
        if self.derives:
            # the forward's ops from here to the derivation's call (the query's concatenation) are a piece of their
            # own: fixed shapes, replayed between the update and the derivation
            self.derived = False
            self.stream.wait_stream(self.main)
            self.begin()
        return keys, values

    def derive(self, original, args, kwargs):
        """The derivation's call (`attention.Cut.derive`): it ends the piece the update began, runs eagerly on the
        update's results and hands its own results on, which the attention must then get (checked by identity)."""
        if self.pending is None or self.derived is not False or kwargs or len(args) != 3:
            raise NotRecordable("a derivation call the recording did not expect")
        module, keys, values = args
        layer_idx, k, v, cache_keys, cache_values = self.pending
        if keys is not cache_keys or values is not cache_values:
            raise NotRecordable("the derivation's inputs are not the cache's")
        self.end()
        with self.backend.stream(self.main):
            made = self._eager(original, module, keys, values)
        if type(made) is not tuple or len(made) != 2:
            raise NotRecordable("the derivation did not return keys and values")
        self.pending = (layer_idx, k, v, made[0], made[1])
        self.derived = True
        return made

    def attention(self, original, args, kwargs):
        if self.cross_sites is not None and len(self.rec.layers) < len(self.cross_sites) and \
                self.cross_sites[len(self.rec.layers)]:
            return self.cross_attention(original, args, kwargs)
        if self.pending is None or len(args) != 5:
            raise NotRecordable("an attention call the recording did not expect")
        module, query, keys, values, mask = args
        layer_idx, k, v, cache_keys, cache_values = self.pending
        self.pending = None
        if self.derived is False:
            raise NotRecordable("the attention's keys/values are not derived from the cache's as the forward's code "
                                "says")
        if keys is not cache_keys or values is not cache_values:
            raise NotRecordable("the attention's keys/values are not the cache's")
        real_mask = self.real_mask
        if self.mask_module is not None:
            made = self.sentinels[:len(self.rec.mask_calls)]
            index = next((i for i, sentinel in enumerate(made) if mask is sentinel), None)
            if index is None or self.real_masks is None:
                raise NotRecordable("the attention's mask is not one the forward made")
            if (self.rec.host_masks and self.rec.mask_calls[index][0] != "create_causal_mask"
                    and not getattr(self.cache.layers[layer_idx], "is_sliding", False)):
                # the host answers a sliding mask from the cache's sliding layers (`masks.host_mask`)
                raise NotRecordable("a sliding-window mask for a full-attention cache layer")
            self.rec.mask_of_layer.append(index)
            real_mask = self.real_masks[index]
        elif mask is not self.rec.sentinel:
            raise NotRecordable("the attention's mask is not the forward's")
        recorded = self._recorded_kwargs(kwargs)
        with self.backend.stream(self.main):
            output, weights = self._eager(original, module, query, keys, values, real_mask, **kwargs)
            with self.quiet():
                # whether this layer's replays may hand the attention its bool mask's additive form (the recorder's
                # own work, unseen by the run's watch: `additive_mask.py`)
                additive = additive_mask.check(original, self._eager, module, query, keys, values, real_mask, kwargs,
                                               output)
                buffer = torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
                buffer.copy_(output)
                if weights is not None:
                    weights = torch.Tensor._make_subclass(_UnreadWeights, torch.empty(0, device="meta"))
        self.rec.layers.append((layer_idx, query, k, v, recorded, buffer))
        self.rec.additive.append(additive)
        self.rec.derived.append(self.derived is True)
        self.derived = None
        self.stream.wait_stream(self.main)
        self.begin()
        return buffer, weights

    def _recorded_kwargs(self, kwargs) -> dict:
        """The attention's keyword arguments as a replay hands them again: scalars, and the positions buffer marked."""
        recorded = {}
        for name, value in kwargs.items():
            if value is self.rec.positions:
                recorded[name] = POSITIONS
            elif isinstance(value, SCALARS):
                recorded[name] = value
            else:
                raise NotRecordable(f"the attention's argument {name!r} is a {type(value).__name__}")
        return recorded

    def cross_attention(self, original, args, kwargs):
        """An encoder-decoder layer's cross-attention (`family.Family.cross_attention`): its keys and values are, by
        identity, the cross-attention cache layer's as the step began (no op made them, no update wrote them: the
        attention module's forward took the cache's `is_updated` branch), its mask None. It ends the piece under
        capture, runs eagerly (its output copied into a buffer) and begins the next piece; each replay hands it the
        cross-attention cache's tensors of the step's own cache (`Recording.replay`)."""
        index = len(self.rec.layers)
        if self.pending is not None or self.graph is None or len(args) != 5 or self.mask_module is not None:
            raise NotRecordable("a cross-attention call the recording did not expect")
        module, query, keys, values, mask = args
        layer_idx = self.site_layers[index]
        held = self.cross_held[layer_idx] if layer_idx < len(self.cross_held) else None
        layer = self.cross_cache.layers[layer_idx] if layer_idx < len(self.cross_cache.layers) else None
        if (held is None or keys is not held[0] or values is not held[1] or layer.keys is not keys
                or layer.values is not values):
            raise NotRecordable("the cross-attention's keys/values are not the cross-attention cache's")
        if mask is not None:
            raise NotRecordable("a cross-attention mask")
        recorded = self._recorded_kwargs(kwargs)
        self.end()
        with self.backend.stream(self.main):
            output, weights = self._eager(original, module, query, keys, values, None, **kwargs)
            with self.quiet():
                buffer = torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
                buffer.copy_(output)
                if weights is not None:
                    weights = torch.Tensor._make_subclass(_UnreadWeights, torch.empty(0, device="meta"))
        self.rec.layers.append((layer_idx, query, None, None, recorded, buffer))
        self.rec.additive.append(False)
        self.rec.derived.append(False)
        self.stream.wait_stream(self.main)
        self.begin()
        return buffer, weights

    def mask(self, name, original, args, kwargs):
        """A mask function's call inside a K-token recording: its keywords recorded (markers for the step's mask,
        cache and positions), a sentinel of its own returned (the attention says which call's mask it got)."""
        if args or self.graph is None or self.rec.layers or self.pending is not None:
            raise NotRecordable(f"a {name} call the recording did not expect")
        recorded, why = masks.recorded_kwargs(kwargs, self.rec.sentinel, self.cache, self.rec.positions)
        if recorded is None:
            raise NotRecordable(f"a {name} call the recording cannot make again: {why}")
        if self.rec.host_masks:
            why = masks.why_not_host(name, recorded, self.config)
            if why is not None:
                raise NotRecordable(why)
        calls = self.rec.mask_calls
        if len(calls) >= len(self.sentinels):
            raise NotRecordable("more mask calls than the recording takes")
        sentinel = self.sentinels[len(calls)]
        calls.append((name, recorded))
        self.originals.append(original)
        return sentinel

    @property
    def mask_module(self):
        """The modeling module whose mask calls a K-token recording intercepts (None: a one-token one)."""
        return self.rec.mask_module

    def _eager(self, function, *args, **kwargs):
        """`function` run outside any capture, as stock runs it (the real cache update, the attention function, a
        user's maybe): what it raises is its own, whatever its message says (red team hole
        R12: "could not capture ..." from a user's attention), and reaches the caller as stock's raises it."""
        try:
            with self.quiet(), _outside_dispatch_modes():
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
        for layer, state in reversed(self.saved):
            vars(layer).clear()
            vars(layer).update(state)
        self.saved.clear()


def record(model, model_forward, inputs: dict, cache, modules, real_mask, impl: str, pool, mask_module=None,
           watch=None, host_masks=False, encoder_decoder=False):
    """Record the forward for `inputs`; (Recording, this step's outputs). Raises `NotRecordable` or
    `CaptureFailed` (nothing of this step done: the cache is as it was; `capture_failure`), or what the forward
    raised otherwise; returns None when another thread is inside
    generate() (a capture is not private then: `concurrency.py`).

    `impl`: the model's attention implementation; the attention is intercepted where the forward looks it up under
    it (`attention.swapped`). `mask_module`: for a forward of K > 1 tokens, or of one token under an implementation
    other than SDPA, the modeling module whose mask calls are recorded and made again at each replay (`real_mask` is
    then the step's own 2D mask or None); for a one-token SDPA forward of a cache with sliding-window layers, the
    module whose mask calls are recorded and answered on the host at each replay (`masks.host_mask`; `real_mask` the
    step's own); None for any other one-token forward, whose attention gets `real_mask` itself.
    `watch`: a `proof.watch.RunWatch` installed around the forward: what the run
    executed, for `proof.verdict` to judge after it. `encoder_decoder`: the decoder of an encoder-decoder model
    (`modules` in call order, each layer's self-attention then its cross-attention), `cache` its `EncoderDecoderCache`
    (the update intercepted on its `self_attention_cache`), the step's inputs under the decoder's names and its
    `encoder_outputs` given; one-token steps whose attention gets the mask known on the host only."""
    import time

    cut, why = sites.cut_of(type(modules[0]))
    if cut is None:
        raise NotRecordable(why)
    ids_key, positions_key, mask_key = ENCODER_DECODER_INPUTS if encoder_decoder else DECODER_ONLY_INPUTS
    if encoder_decoder and mask_module is not None:
        raise NotRecordable("an encoder-decoder's mask made in the forward")
    device = inputs[ids_key].device
    batch = inputs[ids_key].shape[0]
    # the buffers in their sizes' own strides: a (batch, 1) column sliced from the sequence (stock's input preparation,
    # which a step after a mid-call change gets) carries the sequence's length as its row stride, which `clone` keeps,
    # and a confirming recording at another position would then see another geometry at the embedding's op and never
    # be confirmed (red team of 2026-11-29, latent attention: observation 1)
    recording = Recording(inputs[ids_key].clone(memory_format=torch.contiguous_format),
                          inputs[positions_key].clone(memory_format=torch.contiguous_format),
                          torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device))
    kwargs = dict(inputs)
    kwargs.update({ids_key: recording.ids, positions_key: recording.positions, mask_key: recording.sentinel})
    # the cache whose update is intercepted: an encoder-decoder's self-attention cache
    updated = cache.self_attention_cache if encoder_decoder else cache
    started = time.perf_counter()
    with concurrency.capture_turn() as alone:
        if not alone:
            return None
        backend = backend_for(device)
        main = backend.current_stream(device)
        stream = backend.capture_stream(device)
        recording.mask_module = mask_module
        # one token with a mask module under SDPA and no padding, over a cache with sliding-window layers: its masks
        # each replay answers on the host (any other implementation's, or a padded batch's, are made again at each
        # replay)
        recording.host_masks = host_masks and mask_module is not None and inputs["input_ids"].shape[1] == 1
        recorder = _Recorder(recording, updated, modules, real_mask, main, stream, pool, backend)
        if encoder_decoder:
            recording.cross = [index % 2 == 1 for index in range(len(modules))]
            recorder.cross_sites = recording.cross
            recorder.site_layers = [index // 2 for index in range(len(modules))]
            recorder.cross_cache = cache.cross_attention_cache
            recorder.cross_held = [(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers]
        recorder.config = model.config  # the config a mask call answered on the host must have been given
        recorder.watch = watch
        recorder.derives = cut.derive is not None
        recording.derive = cut.derive
        if mask_module is not None:
            # one sentinel per mask call, distinct objects (made here: nothing is allocated for them under capture)
            recorder.sentinels = [torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device)
                                  for _ in masks.MASK_FUNCTIONS]
        stream.wait_stream(main)
        token = _ACTIVE.set(recorder)
        updated.update = recorder.update  # the call's own cache object, for this forward only
        try:
            with sites.swapped(cut, impl, type(modules[0]), _intercept), masks.swapped(mask_module, _ACTIVE), \
                    sites.swapped_derivation(cut, type(modules[0]), _intercept_derivation), backend.stream(stream), (watch if watch is not None else contextlib.nullcontext()):
                recorder.begin()
                outputs = model_forward(**kwargs)
                if len(recording.layers) != len(modules) or recorder.pending is not None:
                    raise NotRecordable("the forward did not run every layer's attention once")
                _check_outputs(outputs, cache, inputs.get("encoder_outputs") if encoder_decoder else None)
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
            del updated.update
            _ACTIVE.reset(token)
    recording.logits = outputs.logits
    recording.output_type = type(outputs)
    recording.encoder_decoder = encoder_decoder
    recording.pool = recorder.pool
    recording.capture_seconds = time.perf_counter() - started
    return recording, outputs


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


def _check_outputs(outputs, cache, encoder_outputs=None) -> None:
    """A replay returns the logits and the cache, nothing else (an encoder-decoder's: and the encoder's outputs it was
    handed, `Recording.output`)."""
    if (not isinstance(getattr(outputs, "logits", None), torch.Tensor)
            or cache_kwarg.of_output(outputs) is not cache
            or getattr(outputs, "hidden_states", None) is not None or getattr(outputs, "attentions", None) is not None
            or getattr(outputs, "loss", None) is not None):
        raise NotRecordable("the forward's outputs are not the logits and the cache alone")
    if encoder_outputs is not None and (
            set(outputs.keys()) - {"logits", cache_kwarg.name(), *ENCODER_FIELDS}
            or any(getattr(outputs, field, None) is not getattr(encoder_outputs, source, None)
                   for field, source in ENCODER_FIELDS.items())):
        raise NotRecordable("the forward's outputs are not the logits, the cache and the encoder's outputs alone")
