"""One recording of a decode forward (`graphs.record`): its graphs, fixed buffers and recorded calls, and its replay.

**Replay**: copy the step's ids and positions into the buffers; replay piece 0; make the step's masks where the
recording made them again (`masks.py`: a K-token forward, or any implementation other than SDPA) or answer them on the
host (one token, sliding-window layers, SDPA); per layer, the real `cache.update` of the piece's k/v (then, with a
derivation, its piece and the class's method on the update's results: `attention.Cut.derive`; with a position
bias, the class's method on the step's host lengths: `attention.Cut.bias`) and the real
attention (the function the forward looks up now, `attention.function`) with the recorded arguments (a bool mask in
its additive form, converted once per step where the recording proved it: `additive_mask.py`), its output copied
into the buffer; replay the next piece (`graphs.py` describes the pieces).
"""

from __future__ import annotations

from ...release_checks import cache_kwarg
from . import additive_mask, masks
from .masks import POSITIONS, Marker

# an attention's `position_bias` that each replay makes again (`attention.Cut.bias`: T5's `compute_bias`)
BIAS = Marker("the step's position bias")

# an encoder-decoder's output fields that carry the encoder's outputs (`Seq2SeqLMOutput`) -> the `BaseModelOutput`'s
ENCODER_FIELDS = {"encoder_last_hidden_state": "last_hidden_state", "encoder_hidden_states": "hidden_states",
                  "encoder_attentions": "attentions"}


class Recording:
    """The graphs and fixed buffers of one (model, batch, width, dtype, mask kind, ...) key."""

    def __init__(self, ids, positions, sentinel):
        self.ids, self.positions, self.sentinel = ids, positions, sentinel
        self.graphs: list = []
        self.layers: list = []  # per layer: (layer_idx, q, k, v, attention kwargs (positions marked), output buffer)
        # per layer: its replays may hand the attention its bool mask's additive form (`additive_mask.check`)
        self.additive: list = []
        # the attention class's derivation (`attention.Cut.derive`: its name, None without) and, per layer, whether
        # the recording ran it (then a piece of its own sits between the layer's update and the derivation)
        self.derive = None
        self.derived: list = []
        # the attention class's position bias method (`attention.Cut.bias`: its name, None without), and where the
        # recording ran it: (the site whose update comes first, the query's length, the device), None where it did not
        self.bias = None
        self.bias_site = None
        # per site: whether its recorded keywords hold a marker (`POSITIONS`, `BIAS`) a replay substitutes
        self.marked = None
        self.logits = None
        self.output_type = None
        self.pool = None
        self.capture_seconds = 0.0
        self.uses = 0  # replays: the least used of a model's multi-token recordings is dropped first
        # K > 1: the modeling module, its mask calls [(function name, kwargs with markers)] and which call's mask
        # each layer's attention got (an index into `mask_calls`); empty for a one-token forward
        self.mask_module = None
        self.mask_calls: list = []
        self.mask_of_layer: list = []
        # one token with sliding-window layers: the mask calls are answered on the host at each replay
        # (`masks.host_mask`), not made again; the materialised windows it made, kept (`made`)
        self.host_masks = False
        self.host_made: dict = {}
        # an encoder-decoder's decoder (`graphs.record(encoder_decoder=True)`): per attention site, whether it is a
        # cross-attention (its keys and values the cross-attention cache's, no update); None: a decoder-only model
        self.cross = None
        # its cross-attention mask call (`recorder._Recorder.cross_mask`): (the modeling module, the call's keywords
        # with markers), made again at each replay; None: the cross-attentions get None (Whisper's decoder)
        self.cross_mask = None

    def replay(self, cache, input_ids, position_ids, mask, attention_fn, modules, fresh_logits=False,
               encoder_outputs=None, encoder_mask=None):
        """This step's forward. `mask`: the attention's mask for a one-token forward, the step's own (2D or None)
        mask for a K-token one. `fresh_logits`: return a copy of the logits buffer (a caller that keeps them past
        the next replay: the verify forward, whose fp32 logits stock's loop writes into and returns as scores).
        An encoder-decoder's: `cache` its `EncoderDecoderCache`, `position_ids` the host length every position of the
        step's (one-token) positions holds (stock's `arange(1) + cache_length`, repeated over the batch), and
        `encoder_outputs` the step's, carried by the output as stock's carries them, and `encoder_mask` the step's
        encoder `attention_mask`, from which the cross-attention mask is made as stock's decoder makes it."""
        self.uses += 1
        self.ids.copy_(input_ids)
        if self.positions is None:  # an encoder-decoder's decoder without positions (T5's): none to fill
            pass
        elif type(position_ids) is int:
            self.positions.fill_(position_ids)
        else:
            self.positions.copy_(position_ids)
        cross = self.cross
        outer = cache
        if cross is not None:
            # the self-attention cache is the one updated; each cross-attention reads the step's own cache's layer
            cross_layers, cache = cache.cross_attention_cache.layers, cache.self_attention_cache
        graphs = self.graphs
        graphs[0].replay()
        cross_mask = None
        if self.cross_mask is not None:
            # where stock's decoder makes it: before the first layer, with the step's encoder mask and states
            module, recorded = self.cross_mask
            cross_mask = masks.cross_mask_call(getattr(module, masks.CROSS_MASK_FUNCTION), recorded, encoder_mask,
                                               encoder_outputs.last_hidden_state)
        made = ((self._host_masks(cache, mask) if self.host_masks else self._masks(cache, mask)) if self.mask_calls
                else None)
        update = type(cache).update
        # each bool mask converted once this step, for the layers proven at the recording (`additive_mask.py`)
        converted = additive_mask.StepMasks() if any(self.additive) and additive_mask.allowed(attention_fn) else None
        # the derivation as the forward's `self.<name>(...)` finds it now (the per-step checks keep the forward eager
        # where it is not transformers' own: `attention.why_not`)
        derive = getattr(type(modules[0]), self.derive) if self.derive is not None else None
        # the position bias likewise (`attention.Cut.bias`), made after its site's update from the step's lengths
        bias_site = self.bias_site
        if bias_site is not None:
            bias_at, query_length, device = bias_site
            make_bias = getattr(type(modules[bias_at]), self.bias)
        else:
            bias_at = -1
        marked = self.marked
        if marked is None:
            marked = self.marked = [any(value is POSITIONS or value is BIAS for value in site[4].values())
                                    for site in self.layers]
        bias = None
        piece = 1
        for i, (layer_idx, q, k, v, kwargs, out) in enumerate(self.layers):
            if i == bias_at:
                # what stock's attention read on the host before its update (T5: `cache.get_seq_length(layer_idx)`)
                seen = cache.get_seq_length(layer_idx)
                keys, values = update(cache, k, v, layer_idx)
                bias = make_bias(modules[i], query_length, keys.shape[-2], device=device, past_seen_tokens=seen)
            if marked[i]:
                kwargs = {name: (self.positions if value is POSITIONS else bias if value is BIAS else value)
                          for name, value in kwargs.items()}
            if cross is not None and cross[i]:
                layer = cross_layers[layer_idx]
                out.copy_(attention_fn(modules[i], q, layer.keys, layer.values, cross_mask, **kwargs)[0])
                graphs[piece].replay()
                piece += 1
                continue
            if i != bias_at:
                keys, values = update(cache, k, v, layer_idx)
            if self.derived[i]:
                graphs[piece].replay()
                piece += 1
                keys, values = derive(modules[i], keys, values)
            layer_mask = mask if made is None else made[self.mask_of_layer[i]]
            if converted is not None and self.additive[i]:
                layer_mask = converted.get(layer_mask, q.dtype)
            result = attention_fn(modules[i], q, keys, values, layer_mask, **kwargs)[0]
            out.copy_(result)
            graphs[piece].replay()
            piece += 1
        return self.output(outer, fresh_logits, encoder_outputs)

    def output(self, cache, fresh_logits=False, encoder_outputs=None):
        """The forward's output: the logits buffer (a copy of it with `fresh_logits`) and the cache; an
        encoder-decoder's also the encoder's outputs it was handed (`ENCODER_FIELDS`), as stock's carries
        them."""
        logits = self.logits.clone() if fresh_logits else self.logits
        if self.cross is not None:  # an encoder-decoder's decoder
            fields = {field: getattr(encoder_outputs, source) for field, source in ENCODER_FIELDS.items()}
            return self.output_type(logits=logits, **cache_kwarg.output_field(cache), **fields)
        return self.output_type(logits=logits, **cache_kwarg.output_field(cache))

    def _host_masks(self, cache, mask) -> dict:
        """A one-token step's masks with sliding-window layers, each mask call some layer reads answered on the host
        as stock's function makes it for this step (`masks.host_mask`: `mask` is the step's own, without padding)."""
        calls, batch, device, made = self.mask_calls, self.ids.shape[0], self.ids.device, self.host_made
        return {index: masks.host_mask(calls[index][0], calls[index][1], mask, batch, cache, device, made)
                for index in dict.fromkeys(self.mask_of_layer)}

    def _masks(self, cache, mask) -> dict:
        """The masks of the mask calls some layer reads, made as stock's forward makes them (the module's function,
        looked up as the forward looks it up, with this step's mask, cache and positions)."""
        module, calls = self.mask_module, self.mask_calls
        return {index: masks.mask_call(getattr(module, calls[index][0]), calls[index][1], mask, cache, self.positions)
                for index in dict.fromkeys(self.mask_of_layer)}
