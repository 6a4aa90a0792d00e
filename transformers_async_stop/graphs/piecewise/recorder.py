"""The state of one recording forward (`graphs.record`): the bodies of its interceptions (the cache update, the
attention, a derivation, a cross-attention, a K-token mask call) and the code it runs eagerly between the pieces.

`graphs.py` describes the pieces and what each interception does; this module holds the recorder and the stand-in it
hands the forward for attention weights; `encoder_decoder_sites.py` the interceptions only an encoder-decoder's
decoder makes (a cross-attention, its mask call, the position table's call, a position bias made after the cache
update: T5's `compute_bias`, `attention.Cut.bias`); `not_recordable.py` the exception a refused recording raises.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from . import additive_mask, masks
from .encoder_decoder_sites import EncoderDecoderSites
from .masks import POSITIONS, SCALARS
from .not_recordable import NotRecordable

if TYPE_CHECKING:
    from .recording import Recording

_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)



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



class _UnreadWeights(torch.Tensor):
    """The attention weights a recording hands the forward where the attention function returned some (eager
    attention does; SDPA returns None): a tensor, so that the forward's Python takes stock's path, which no op may
    touch (transformers' decoder layers drop it). A replay has no weights: an op on them inside a piece would read the
    recording's, so it refuses the recording instead."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise NotRecordable("the forward used the attention weights (a replay computes none)")




class _Recorder(EncoderDecoderSites):
    """The state of one recording forward (see the module docstring); an encoder-decoder's sites (the
    cross-attention, its mask call, the position table, the position bias) in `EncoderDecoderSites`."""

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
        # the decoder's cross-attention mask call (`cross_mask`): the step's encoder mask and states it must be handed,
        # the sentinel it returns, the function itself, and stock's mask for the step (made at the first
        # cross-attention, outside the capture: its SDPA skip check reads the device)
        self.encoder_mask = self.encoder_states = None
        self.cross_sentinel = None
        self.cross_mask_module = None  # the modeling module whose function it is (looked up there at each replay)
        self.cross_mask_function = None
        self.cross_mask_made = None
        # the family's position table (`family.Family.position_table`) and whether its call was handed the positions
        self.position_table = None
        self.positioned = False
        # a cut with a position bias (`attention.Cut.bias`, T5's): whether to read the cache's length before each
        # update (the bias's `past_seen_tokens`) and that length; the bias the forward got (every self-attention's
        # `position_bias` must be it) and the cross-attention's (T5's zeros of the encoder's length, made in a piece:
        # every cross-attention's must be the first one's, which the recording holds)
        self.biases = False
        self.before = None
        self.bias_made = None
        self.cross_bias = None

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
        if self.biases:
            # what the attention module read on the host before its update (T5: `cache.get_seq_length(layer_idx)`)
            self.before = self.cache.get_seq_length(layer_idx)
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
        derived, self.derived = self.derived is True, None
        return self._next_piece((layer_idx, query, k, v, recorded), output, weights, additive, derived)

    def _next_piece(self, site, output, weights, additive: bool, derived: bool):
        """An attention site recorded (`site`: its layer, query, k, v and recorded keywords): its output copied into
        the buffer the next piece reads, the next piece begun; (the buffer, the weights' stand-in) for the forward."""
        with self.backend.stream(self.main), self.quiet():
            buffer = torch.empty_strided(output.shape, output.stride(), dtype=output.dtype, device=output.device)
            buffer.copy_(output)
            if weights is not None:
                weights = torch.Tensor._make_subclass(_UnreadWeights, torch.empty(0, device="meta"))
        self.rec.layers.append((*site, buffer))
        self.rec.additive.append(additive)
        self.rec.derived.append(derived)
        self.stream.wait_stream(self.main)
        self.begin()
        return buffer, weights

    def _recorded_kwargs(self, kwargs, cross=False) -> dict:
        """The attention's keyword arguments as a replay hands them again: scalars, the positions buffer marked, and
        a position bias (`cross`: at a cross-attention site) as `_position_bias` says."""
        recorded = {}
        for name, value in kwargs.items():
            if value is self.rec.positions and value is not None:
                recorded[name] = POSITIONS
            elif isinstance(value, SCALARS):
                recorded[name] = value
            elif name == "position_bias" and isinstance(value, torch.Tensor):
                recorded[name] = self._position_bias(value, cross)
            else:
                raise NotRecordable(f"the attention's argument {name!r} is a {type(value).__name__}")
        return recorded

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
