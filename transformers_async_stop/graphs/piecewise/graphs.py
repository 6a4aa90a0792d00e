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
it the cross-attention cache's tensors of the step's own cache, never an address the recording saw. A decoder that
makes its cross-attention mask (`create_bidirectional_mask` of the encoder's mask: BART's) has that call recorded
(its keywords kept with markers for the step's encoder mask and states, a sentinel returned that each cross-attention
must get) and made again by every replay with the step's own, by stock's function. A decoder that takes no
`position_ids` (BART's: it makes them from the cache's host length) has its position table's call handed the
positions buffer (`family.Family.position_table`), which every replay fills from that length.
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
from . import masks
from .proof import attention as sites
from .recorder import (  # noqa: F401 (the recorder and its helpers, named here as before the split)
    _OUT_OF_MEMORY, NotRecordable, _plain_update, _Recorder, _UnreadWeights, _outside_dispatch_modes)
from .recording import ENCODER_FIELDS, Recording  # noqa: F401 (Recording: its graphs, buffers, replay)

_ACTIVE: contextvars.ContextVar["_Recorder | None"] = contextvars.ContextVar("tas_piecewise_recorder", default=None)

# the step's ids, positions and mask under a decoder-only model's names, and under an encoder-decoder's decoder's
DECODER_ONLY_INPUTS = ("input_ids", "position_ids", "attention_mask")
ENCODER_DECODER_INPUTS = ("decoder_input_ids", "decoder_position_ids", "decoder_attention_mask")



class CaptureFailed(Exception):
    """`record`'s own failure other than `NotRecordable` (the device refused the capture, or its pool ran out of
    memory): the cache is as it was before the step, which runs again eagerly. The message names the error, its
    cause."""



def _next_site(recorder, args) -> bool:
    return bool(args) and args[0] is recorder.expected_module()


def _intercepting(step: str, applies=_next_site):
    """The interceptor factory for a recording's `step` (the recorder's method of that name: "attention", "derive",
    "bias", "positions", "cross_mask"): a call `applies(recorder, args)` says is the recording's (by default, from the
    module the recording expects next) goes to the recorder, any other (another thread's, another module's) to the
    original."""
    def make(original):
        def intercepted(*args, **kwargs):
            recorder = _ACTIVE.get()
            if recorder is None or not applies(recorder, args):
                return original(*args, **kwargs)
            return getattr(recorder, step)(original, args, kwargs)

        intercepted._tas_piecewise_original = original
        return intercepted

    return make


_intercept = _intercepting("attention")
_intercept_derivation = _intercepting("derive")
_intercept_bias = _intercepting("bias")
# the position table class's `forward` (`family.Family.position_table`): the recording's table gets the positions
# buffer (`_Recorder.positions`)
_intercept_positions = _intercepting("positions", lambda recorder, args: bool(args) and
                                     args[0] is recorder.position_table)
# the modeling module's `create_bidirectional_mask` in an encoder-decoder's recording (`_Recorder.cross_mask`)
_intercept_cross_mask = _intercepting("cross_mask", lambda recorder, args: recorder.cross_sentinel is not None)


def _encoder_decoder_swaps(stack: contextlib.ExitStack, position_table, cross_mask_module) -> None:
    """The position table class's `forward` and the modeling module's cross-attention mask function replaced by their
    interceptors for the recording (`stack` restores them whatever happens)."""
    if position_table is not None:
        stack.enter_context(sites.swapped_attribute(type(position_table), "forward", _intercept_positions))
    if cross_mask_module is not None and masks.CROSS_MASK_FUNCTION in vars(cross_mask_module):
        stack.enter_context(sites.swapped_attribute(cross_mask_module, masks.CROSS_MASK_FUNCTION,
                                                    _intercept_cross_mask))


def _swapped_attention(impl: str):
    """transformers' registry entry `impl` replaced by the interceptor for the recording; restored whatever happens
    (the registry case of `attention.swapped`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sites.swapped_entry(ALL_ATTENTION_FUNCTIONS, impl, _intercept)



def record(model, model_forward, inputs: dict, cache, modules, real_mask, impl: str, pool, mask_module=None,
           watch=None, host_masks=False, encoder_decoder=False, positions=None, position_table=None,
           cross_mask_module=None):
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
    `encoder_outputs` given; one-token steps whose attention gets the mask known on the host only. Its
    `cross_mask_module`: the modeling module whose `create_bidirectional_mask` call (the cross-attention mask) is
    recorded and made again at each replay. `positions`, `position_table`: a decoder that takes no positions (BART's)
    gets the positions buffer (made from `positions`: stock's own values) through its position table's call."""
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
    # the positions the forward is handed (an encoder-decoder's decoder may take none: BART's get theirs through the
    # position table's call, from `positions`; T5's decoder has none, and no positions buffer)
    handed = inputs.get(positions_key) if encoder_decoder else inputs[positions_key]
    made = positions if positions is not None else handed
    recording = Recording(inputs[ids_key].clone(memory_format=torch.contiguous_format),
                          None if made is None else made.clone(memory_format=torch.contiguous_format),
                          torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device))
    kwargs = dict(inputs)
    kwargs.update({ids_key: recording.ids, mask_key: recording.sentinel})
    if handed is not None:
        kwargs[positions_key] = recording.positions
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
            recorder.encoder_mask = inputs.get("attention_mask")
            recorder.encoder_states = inputs["encoder_outputs"].last_hidden_state
            recorder.cross_sentinel = torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device)
            recorder.cross_mask_module = cross_mask_module
            recorder.position_table = position_table
        recorder.config = model.config  # the config a mask call answered on the host must have been given
        recorder.watch = watch
        recorder.derives = cut.derive is not None
        recording.derive = cut.derive
        recorder.biases = cut.bias is not None  # a position bias made after the update (T5's: `attention.Cut.bias`)
        recording.bias = cut.bias
        if mask_module is not None:
            # one sentinel per mask call, distinct objects (made here: nothing is allocated for them under capture)
            recorder.sentinels = [torch.ones((batch, 1, 1, 1), dtype=torch.bool, device=device)
                                  for _ in masks.MASK_FUNCTIONS]
        stream.wait_stream(main)
        token = _ACTIVE.set(recorder)
        updated.update = recorder.update  # the call's own cache object, for this forward only
        try:
            with sites.swapped(cut, impl, type(modules[0]), _intercept), masks.swapped(mask_module, _ACTIVE), \
                    sites.swapped_derivation(type(modules[0]), cut.derive, _intercept_derivation), \
                    sites.swapped_derivation(type(modules[0]), cut.bias, _intercept_bias), \
                    contextlib.ExitStack() as swaps, backend.stream(stream), \
                    (watch if watch is not None else contextlib.nullcontext()):
                _encoder_decoder_swaps(swaps, position_table, cross_mask_module)
                recorder.begin()
                outputs = model_forward(**kwargs)
                if len(recording.layers) != len(modules) or recorder.pending is not None:
                    raise NotRecordable("the forward did not run every layer's attention once")
                if position_table is not None and not recorder.positioned:
                    raise NotRecordable("the decoder's position table was not handed the positions")
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
