"""The interceptions only an encoder-decoder's decoder makes in a recording (`recorder._Recorder`'s mixin): its
cross-attention (a second attention site per layer, over the cross-attention cache's keys and values), the
cross-attention mask call (`create_bidirectional_mask`, made again at every replay), the position table's call (BART's
family, handed the positions buffer) and the position bias made after the cache update (T5's `compute_bias`:
`attention.Cut.bias`). Each reads and writes the recorder's state (`recorder._Recorder.__init__` lists it)."""

from __future__ import annotations

import torch

from . import masks
from .not_recordable import NotRecordable
from .recording import BIAS


class EncoderDecoderSites:
    """`recorder._Recorder`'s encoder-decoder interceptions (see the module docstring)."""

    def bias(self, original, args, kwargs):
        """The position bias's call (`attention.Cut.bias`, T5's `compute_bias(query_length, key_length, device=...,
        past_seen_tokens=...)`): once per recording, between an update and its attention, with the host values stock's
        forward has (the step's query length, the grown cache layer's length, the cache's length before the update,
        the query's device). It runs eagerly (its shape grows with the cache); its result is what every
        self-attention must get as `position_bias` (`_recorded_kwargs`), and every replay calls the method again with
        the step's lengths (`Recording.replay`)."""
        if (self.pending is None or self.bias_made is not None or self.derived is not None or len(args) != 3
                or kwargs.keys() != {"device", "past_seen_tokens"}):
            raise NotRecordable("a position bias call the recording did not expect")
        module, query_length, key_length = args
        keys, seen = self.pending[3], kwargs["past_seen_tokens"]
        if (type(query_length) is not int or query_length != self.rec.ids.shape[1] or type(key_length) is not int
                or key_length != keys.shape[-2] or type(seen) is not int or seen != self.before
                or kwargs["device"] != self.rec.ids.device):
            raise NotRecordable("the position bias's lengths are not the step's")
        with self.backend.stream(self.main):
            made = self._eager(original, module, query_length, key_length, **kwargs)
        if not isinstance(made, torch.Tensor):
            raise NotRecordable("the position bias is not a tensor")
        self.bias_made = made
        self.rec.bias_site = (len(self.rec.layers), query_length, kwargs["device"])
        return made

    def _position_bias(self, value, cross: bool):
        """A self-attention's `position_bias` must be, by identity, what the bias call made this step (marked: each
        replay makes it again); a cross-attention's is a tensor made inside the piece that just ended (T5's zeros of
        the encoder's length, rewritten by every replay of that piece), the very one at every cross-attention: held
        by the recording and handed as it is."""
        if not cross:
            if value is not self.bias_made:
                raise NotRecordable("the attention's position_bias is not the one the forward made this step")
            return BIAS
        if self.cross_bias is None:
            if value is self.bias_made or value is self.rec.positions or value is self.rec.ids:
                raise NotRecordable("a cross-attention's position_bias the recording did not expect")
            self.cross_bias = value
        elif value is not self.cross_bias:
            raise NotRecordable("a cross-attention's position_bias is not the first cross-attention's")
        return value

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
        if mask is not (self.cross_sentinel if self.cross_mask_function is not None else None):
            raise NotRecordable("the cross-attention's mask is not the forward's")
        recorded = self._recorded_kwargs(kwargs, cross=True)
        self.end()
        with self.backend.stream(self.main):
            if self.cross_mask_function is not None and self.cross_mask_made is None:
                # stock's mask for this step, as each replay makes it (`Recording.replay`). Stock's decoder makes it
                # before its first layer: where it raises, the caller's cache is as it was before the step (red team
                # of 2026-11-29, BART graphs, hole 1), not holding layer 0's update the recording has made since
                try:
                    self.cross_mask_made = [self._eager(masks.cross_mask_call, self.cross_mask_function,
                                                        self.rec.cross_mask[1], self.encoder_mask,
                                                        self.encoder_states)]
                except BaseException:
                    self.restore_cache()
                    raise
            mask = self.cross_mask_made[0] if self.cross_mask_made is not None else None
            output, weights = self._eager(original, module, query, keys, values, mask, **kwargs)
        return self._next_piece((layer_idx, query, None, None, recorded), output, weights, False, False)

    def cross_mask(self, original, args, kwargs):
        """The decoder's cross-attention mask call (`create_bidirectional_mask` of the encoder's mask), in piece 0:
        its keywords recorded (markers for the step's encoder mask and encoder states, which it must have been handed),
        a sentinel returned, which every cross-attention must get. Each replay calls the modeling module's function
        again with the step's own (`Recording.replay`): stock's mask, from stock's code, at every step."""
        if args or self.graph is None or self.rec.layers or self.pending is not None or self.rec.cross_mask:
            raise NotRecordable("a cross-attention mask call the recording did not expect")
        recorded, why = masks.recorded_cross_kwargs(kwargs, self.encoder_mask, self.encoder_states)
        if recorded is None:
            raise NotRecordable(f"a cross-attention mask call the recording cannot make again: {why}")
        self.rec.cross_mask = (self.cross_mask_module, recorded)
        self.cross_mask_function = original
        return self.cross_sentinel

    def positions(self, original, args, kwargs):
        """The position table's call (`family.Family.position_table`), in piece 0: handed the positions buffer as its
        `position_ids` in place of the ones the decoder made from the cache's host length (stock's `arange(n) + cache
        length`, the values each replay fills the buffer with, from that very length: `forward._record`), once."""
        made, positions = kwargs.get("position_ids"), self.rec.positions
        if (self.graph is None or self.rec.layers or self.pending is not None or self.positioned
                or not isinstance(made, torch.Tensor) or made.shape != positions.shape
                or made.dtype != positions.dtype or made.device != positions.device):
            raise NotRecordable("a position table call the recording did not expect")
        self.positioned = True
        return original(*args, **{**kwargs, "position_ids": positions})
