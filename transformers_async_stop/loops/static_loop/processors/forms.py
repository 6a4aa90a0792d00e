"""The forms of the built-in processors that read the sequence: on the tail's sequence buffer at the device-side
length, or on a device state the tail updates after each token, in place of the growing `input_ids`.
"""

from __future__ import annotations

import torch

from ....release_checks.verified import installed_digests, matches
from .guards import _MISSING, AttrGuard, _same


class _Form:
    """What every form shares: the stock processor, the tail's buffers, the switch to stock."""

    def __init__(self, processor):
        self.processor = processor
        self.stock = False  # run the stock processor on the real sequence (then not captured)
        self.guard = None
        self.seq = self.length = None

    def bind(self, tail) -> None:
        self.seq, self.length = tail.seq, tail.length

    @property
    def capturable(self) -> bool:
        return not self.stock

    def start(self, seq, length: int, vocab: int, pad) -> None:
        self.guard = AttrGuard(self.processor)

    def to_stock(self) -> None:
        self.stock = True

    def after_token(self, tokens, position) -> None:
        pass

    def rebuild(self, length: int) -> None:
        pass

    def phase(self, length: int) -> tuple:
        return ()

    def _stock_call(self, input_ids, scores):
        return self.processor(input_ids.contiguous(), scores)

    def _changed(self) -> bool:
        # an eager step reads the current settings; a change to one the form keeps state for goes stock for good
        if self.guard is not None and not self.guard.unchanged():
            self.stock = True
        return self.stock


# RepetitionPenaltyLogitsProcessor.__call__ digests: (padded: clamp ids and pad the scores by one column, tensor:
# `prompt_ignore_length` may be a per-row tensor)
_REPETITION = {"35dcc5fc15b0": (False, False), "4f13000c1f61": (True, False), "0bf3c6d07642": (True, True)}
_REPETITION_SOURCE = "transformers.generation.logits_process:RepetitionPenaltyLogitsProcessor.__call__"


class RepetitionPenalty(_Form):
    """`RepetitionPenaltyLogitsProcessor.__call__` (2D scores) on a device "last position seen" state.

    Copied from transformers v5.17.0-v5.24.0. Differences, same values:
    - stock gathers the scores of every id in `input_ids` (past `prompt_ignore_length`), penalizes them
      (`where(score < 0, score * penalty, score / penalty)`) and scatters them back; here a (batch, vocab) `last`
      holds, per row and id, the last position the id holds in the sequence (-1: none), made once from the prompt
      and updated after each token (finished rows' pad token included, as in stock's `input_ids`), and the same
      elementwise penalty is applied where that position counts: the same value per element;
    - 5.18+ clamp ids to the scores' width and pad the scores by one column, returning a view of the first `vocab`
      columns: `last` has the spare column too and the result has the same layout;
    - a token counts where its last position is at or past `prompt_ignore_length` (an int, or on 5.23 one per row),
      which is stock's slice (or `masked_fill`) of `input_ids`; the tensor is read at every call, as stock reads it
      (an in-place change of it is honoured, by a replay too).
    Stock raises on a negative id (and, on 5.17, on an id past the vocabulary): where the prompt or the pad token has
    one, the stock processor runs (one host read per call decides it); so it does for a negative int
    `prompt_ignore_length` (a slice from the end) and for scores another processor made narrower or wider.
    """

    def __init__(self, processor, variant):
        super().__init__(processor)
        self.padded, self.tensor_ignore = variant
        self.last = None
        self.ignore = None  # None, an int or a (batch,) tensor: positions before it do not count
        self.vocab = None

    def start(self, seq, length, vocab, pad):
        super().start(seq, length, vocab, pad)
        self.vocab = vocab
        ignore = self.processor.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):
            if not self.tensor_ignore or ignore.dim() != 1 or ignore.shape[0] != seq.shape[0]:
                self.stock = True  # stock raises, or the release does not take a tensor: stock's own call
                return
            ignore = self.processor.prompt_ignore_length = ignore.to(seq.device)  # as stock's first call does
            self.guard = AttrGuard(self.processor)
        elif not (ignore is None or type(ignore) is int) or (type(ignore) is int and ignore < 0):
            self.stock = True  # a bool, a slice from the end, anything else: stock's own reading of it
            return
        if not self.tensor_ignore and not ignore:  # 5.17-5.22 test `if self.prompt_ignore_length:`
            ignore = None
        self.ignore = ignore
        ids = seq[:, :length]
        checked = ids.reshape(-1) if pad is None else torch.cat([ids.reshape(-1), pad.reshape(-1).to(ids.dtype)])
        bad = checked < 0 if self.padded else (checked < 0) | (checked >= vocab)
        if bad.any().item():  # once per call: stock raises at some step, let it
            self.stock = True
            return
        self.rebuild(length)

    def rebuild(self, length):
        """`last` from the first `length` tokens of the sequence, in place (a captured graph reads this tensor)."""
        if self.stock:
            return
        seq = self.seq
        ids = seq[:, :length]
        if self.padded:
            ids = ids.clamp(max=self.vocab)
        if self.last is None:
            self.last = torch.empty((seq.shape[0], self.vocab + 1 if self.padded else self.vocab), dtype=torch.long,
                                    device=seq.device)
        self.last.fill_(-1)
        positions = torch.arange(length, device=seq.device).expand(ids.shape)
        self.last.scatter_reduce_(1, ids, positions, "amax")

    def after_token(self, tokens, position):
        if self.stock:
            return
        index = (tokens.clamp(max=self.vocab) if self.padded else tokens)[:, None]
        # positions only grow: the new one is the id's last
        self.last.scatter_(1, index, position.reshape(1, 1).expand(index.shape))

    def __call__(self, input_ids, scores):
        if self._changed() or scores.shape[-1] != self.vocab:
            self.stock = True  # another processor changed the width: stock sizes everything by `scores`
            return self._stock_call(input_ids, scores)
        penalty = self.processor.penalty
        if self.padded:
            scores = torch.nn.functional.pad(scores, (0, 1))
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        seen = self.last >= 0
        if self.ignore is not None:
            ignore = self.ignore.reshape(-1, 1) if isinstance(self.ignore, torch.Tensor) else self.ignore
            seen &= self.last >= ignore
        processed = torch.where(seen, penalized, scores)
        return processed[..., : self.vocab] if self.padded else processed

    def _changed(self):
        # `penalty` is read at every eager call; any other change (prompt_ignore_length...) goes stock for good
        if not self.stock and self.guard is not None and not self.guard.unchanged():
            if self._only_penalty_changed():
                self.guard = AttrGuard(self.processor)
            else:
                self.stock = True
        return self.stock

    def _only_penalty_changed(self) -> bool:
        attrs = vars(self.processor)
        if type(self.processor) is not self.guard.kind or len(attrs) != self.guard.size:
            return False
        return all(key == "penalty" or _same(attrs.get(key, _MISSING), ref, snap)
                   for key, ref, snap in self.guard.items)


# SequenceBiasLogitsProcessor.__call__ (NoBadWordsLogitsProcessor inherits it): only the 5.23 source
# (`targets.SHORTCUTS` "static loop sequence bias"), whose per-step work is device ops on tensors made at the first
# call; earlier releases build tensors from host lists every step, which no graph can replay.


class LastTokens(_Form):
    """`SequenceBiasLogitsProcessor.__call__` / `NoBadWordsLogitsProcessor` on the last tokens of the sequence
    buffer, read at the device-side length.

    Copied from transformers v5.23.0-v5.24.0: the stock `__call__` itself runs, on a window of the sequence instead of the
    whole of it. It reads `input_ids` only as `input_ids.shape[1]` (whether a prefix is longer than the context) and
    `input_ids[:, -k:]` for prefix lengths `k <= shape[1]`: a window of the last `min(length, longest key)` columns,
    gathered at the device-side length, gives both the same answers. The window's width is the one host decision
    that depends on the length (`phase`). The stock float additions run unchanged, in their order.
    """

    def __init__(self, processor):
        super().__init__(processor)
        self.longest = max((len(ids) for ids in processor.sequence_bias), default=0)  # bad words that were all EOS
        self.offsets = {}

    def phase(self, length):
        return (min(length, self.longest),)

    def __call__(self, input_ids, scores):
        if self._changed():
            return self._stock_call(input_ids, scores)
        width = input_ids.shape[1] if input_ids.shape[1] < self.longest else self.longest
        offsets = self.offsets.get(width)
        if offsets is None:
            offsets = self.offsets[width] = torch.arange(-width, 0, device=self.seq.device)
        window = self.seq.index_select(1, self.length + offsets)
        return self.processor(window, scores)

    def start(self, seq, length, vocab, pad):
        if not self.processor.prepared_bias_variables:
            self.guard = None  # the first stock call prepares its tensors: snapshot after it (`_changed`)
            return
        super().start(seq, length, vocab, pad)

    def _changed(self):
        if self.guard is None and not self.stock:
            if self.processor.prepared_bias_variables:
                self.guard = AttrGuard(self.processor)
            return False
        return super()._changed()


# NoRepeatNGramLogitsProcessor.__call__ digests: whether ids past the vocabulary are clamped to the spare column
_NGRAM = {"9bfab15ed81f": False, "9a61f49a39f4": True, "dd416ba08a20": True}
_NGRAM_SOURCE = "transformers.generation.logits_process:NoRepeatNGramLogitsProcessor.__call__"


class NoRepeatNGram(_Form):
    """`NoRepeatNGramLogitsProcessor.__call__` over the whole sequence buffer, with the device-side length.

    Copied from transformers v5.17.0-v5.24.0 (5.18+ clamp ids past the vocabulary to the spare column). Stock matches
    the last `n - 1` tokens against every window of `n` tokens of `input_ids` and bans each matching window's last
    token. Differences, same mask: the windows run over the preallocated buffer, and only those that end before the
    device-side length count (the others, over columns not yet written, go to the spare column); the last `n - 1`
    tokens are gathered at that length. Whether a full n-gram exists yet (`length < n`) is a host decision (`phase`).
    Stock raises on a negative id (on 5.17 also on one past the vocabulary): where the prompt or the pad token has
    one, the stock processor runs (one host read per call).
    """

    def __init__(self, processor, clamps):
        super().__init__(processor)
        self.clamps = clamps
        self.n = processor.ngram_size
        self.vocab = None
        self.prefix_offsets = self.starts = None

    def start(self, seq, length, vocab, pad):
        super().start(seq, length, vocab, pad)
        self.vocab = vocab
        device = seq.device
        self.prefix_offsets = torch.arange(1 - self.n, 0, device=device)
        self.starts = torch.arange(max(seq.shape[1] - self.n + 1, 0), device=device)
        ids = seq[:, :length].reshape(-1)
        checked = ids if pad is None else torch.cat([ids, pad.reshape(-1).to(ids.dtype)])
        bad = checked < 0 if self.clamps else (checked < 0) | (checked > vocab)
        if bad.any().item():
            self.stock = True

    def phase(self, length):
        return (length < self.n,)

    def __call__(self, input_ids, scores):
        if self._changed() or scores.shape[-1] != self.vocab:
            self.stock = True  # another processor changed the width: stock sizes everything by `scores`
            return self._stock_call(input_ids, scores)
        n = self.n
        if input_ids.shape[-1] < n:
            return scores
        seq, vocab = self.seq, self.vocab
        prefix = seq.index_select(1, self.length + self.prefix_offsets)
        windows = seq.unfold(dimension=1, size=n, step=1)
        written = self.starts <= self.length - n  # windows that end within the sequence so far
        matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & written
        last = windows[..., -1].clamp(max=vocab) if self.clamps else windows[..., -1]
        banned_mask = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
        banned_mask.scatter_(1, torch.where(matches, last, vocab), True)
        return scores.masked_fill(banned_mask[:, :vocab], -float("inf"))


def device_form(processor):
    """The loop's form of a built-in processor that reads the sequence, or None (the processor runs as it is)."""
    from transformers.generation import logits_process as lp

    kind = type(processor)
    if kind is lp.RepetitionPenaltyLogitsProcessor and matches("static loop repetition penalty"):
        variant = _REPETITION.get(installed_digests("static loop repetition penalty")[_REPETITION_SOURCE])
        return RepetitionPenalty(processor, variant) if variant is not None else None
    if kind is lp.NoRepeatNGramLogitsProcessor and matches("static loop no repeat ngram"):
        clamps = _NGRAM.get(installed_digests("static loop no repeat ngram")[_NGRAM_SOURCE])
        return NoRepeatNGram(processor, clamps) if clamps is not None else None
    if kind in (lp.SequenceBiasLogitsProcessor, lp.NoBadWordsLogitsProcessor) and matches(
            "static loop sequence bias"):
        return LastTokens(processor)
    return None
