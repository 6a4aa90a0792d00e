"""Prompt lookup on a host copy of the sequence.

`PromptLookupCandidateGenerator.get_candidates` is integer work on the sequence (n-gram windows, `nonzero`, slices
by the match positions, an EOS cut with `.item()`), and on a CUDA sequence each of those is a blocking read, every
round. The host already has the sequence: the prompt is read once per call, and every round's accepted tokens
arrive with the round's one copy (`RoundBox`). Upstream's own `get_candidates` runs on that CPU copy, the "mirror",
so the n-gram search is the same integer work on the same values, and its answer is bit-identical; reading a CPU
tensor costs no sync. The chosen ids go to the device through a pinned buffer, without waiting.

Two attributes of the generator are swapped for the duration of that call:
- `eos_token_id` becomes a CPU copy (made once per call);
- `logits_processor` becomes the part of it that can forbid a candidate, as CPU copies (or None). Upstream's
  "forbidden candidate" check runs the processors on fake all-ones logits and drops a candidate whose fake logit
  comes out `-inf` or `finfo.min`. On such a row, the min-length processors put `-inf` on the EOS ids while the
  sequence is short: that depends on the length and the EOS ids only, so their CPU copies decide it on the host.
  Temperature and repetition penalty map finite values to finite values and `-inf` to `-inf`; top-k and min-p (with
  their default `-inf` filter value) keep every entry of a row whose finite entries are all equal, and keep `-inf`
  entries at `-inf`. So with those in the list, the check's answer is the min-length processors' answer, as long as
  no repetition penalty (which makes the row uneven) comes before a top-k or min-p. Any other processor (no-repeat
  n-grams, bad words, top-p, ...) keeps the call stock, with one `StockPathWarning`.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from ...release_checks.verified import matches

SHORTCUT = "prompt lookup on the host mirror"
_SCALES = (TemperatureLogitsWarper, RepetitionPenaltyLogitsProcessor)  # finite -> finite, -inf -> -inf
_KEEPS_EVEN_ROWS = (TopKLogitsWarper, MinPLogitsWarper)  # remove nothing from a row whose finite entries are equal
_MIN_LENGTH = {MinLengthLogitsProcessor: "MinLengthLogitsProcessor.__call__",
               MinNewTokensLengthLogitsProcessor: "MinNewTokensLengthLogitsProcessor.__call__"}


def why_not_on_host(generator) -> str | None:
    """Why this lookup cannot run on the host mirror (None: it can)."""
    if not matches(SHORTCUT):
        return "this release's prompt lookup is not one the host-side lookup was checked against"
    uneven = False
    others = []
    for processor in generator.logits_processor or ():
        kind = type(processor)
        if kind in _MIN_LENGTH and matches(_MIN_LENGTH[kind]):
            continue
        if kind in _SCALES:
            uneven = uneven or kind is RepetitionPenaltyLogitsProcessor
            continue
        if kind in _KEEPS_EVEN_ROWS and not uneven and processor.filter_value == -math.inf:
            continue
        others.append(kind.__name__)
    if others:
        return (f"prompt lookup with {', '.join(sorted(set(others)))}, whose forbidden-candidate check reads the "
                "device for every candidate token")
    return None


def _host_processors(processors):
    """CPU copies of the processors that can forbid a candidate on all-ones logits (see the module docstring)."""
    kept = []
    for processor in processors or ():
        if type(processor) in _MIN_LENGTH:
            own = copy.copy(processor)
            own.eos_token_id = processor.eos_token_id.cpu()  # once per call
            kept.append(own)
    return LogitsProcessorList(kept) if kept else None


class HostLookup:
    """The call's prompt lookup, run on the host mirror (`Mirror`)."""

    def __init__(self, generator, mirror, device: torch.device):
        self.generator = generator
        self.mirror = mirror
        self.cuda = device.type == "cuda"
        eos = generator.eos_token_id
        self._eos = eos.cpu() if isinstance(eos, torch.Tensor) else eos  # once per call
        self._processors = _host_processors(generator.logits_processor)
        self._staging = None  # pinned: the chosen ids' way to the device

    def get_candidates(self, input_ids: torch.Tensor, *args):
        """Stock's `(candidate_input_ids, None)`, on `input_ids`'s device, from the same search on the mirror."""
        generator = self.generator
        saved = generator.eos_token_id, generator.logits_processor
        generator.eos_token_id, generator.logits_processor = self._eos, self._processors
        try:
            candidates, logits = generator.get_candidates(self.mirror.ids, *args)
        finally:
            generator.eos_token_id, generator.logits_processor = saved
        chosen = candidates[:, input_ids.shape[1]:]
        if chosen.shape[1] == 0:
            return input_ids, logits
        if self.cuda:
            # a pageable or synchronous H2D copy would drain the stream; this buffer is rewritten only after the host
            # has read the round's verdict, by which time the copy below has run
            if self._staging is None or self._staging.numel() < chosen.numel():
                self._staging = torch.empty(max(chosen.numel(), 64), dtype=torch.long, device="cpu",
                                             pin_memory=True)
            staged = self._staging[: chosen.numel()].view(chosen.shape)
            staged.copy_(chosen)
            chosen = staged.to(input_ids.device, non_blocking=True)
        return torch.cat((input_ids, chosen.to(input_ids.dtype)), dim=1), logits


class Mirror:
    """The call's sequence on the host: the prompt (one read per call), then each round's accepted tokens.

    The device sequence is not only appended to: stock hands it to the logits processors (the draft's first step
    gets the call's own tensor, a verify round without candidates too), and a processor may write it in place. Stock
    reads the written sequence afterwards (the assistant's pad-id mask, the n-gram search), so the mirror must too
    (fuzzer seed 297: a processor turned a kept 27 into the pad id 0 on CUDA; stock's assistant masked it in the
    next rounds, the flag's mirror still held 27 and handed an all-ones mask, the drafts and so the processor's
    calls differed). A write in place moves the tensor's version counter, also through a view: where it moved since
    the mirror last read the device, the mirror reads it again (one blocking read, only in a round after such a
    write). An inference tensor has no version counter: where code outside transformers is handed the sequence
    (`foreign`, a user's logits processor), the mirror reads the device each time it is asked.

    The prompt is copied even on the CPU (where `.cpu()` would alias it), so that both devices run the same logic.
    """

    def __init__(self, input_ids: torch.Tensor, foreign: bool = False):
        self.foreign = foreign
        self.reads = 0  # device reads after the prompt's (tests)
        self._ids = input_ids.to("cpu", copy=True)
        self._stale = False
        self._watch(input_ids)

    def _watch(self, device_ids: torch.Tensor) -> None:
        self._source = device_ids
        self._version = None if device_ids.is_inference() else device_ids._version

    def _written(self) -> bool:
        """Was the device sequence written in place since the mirror last followed it (or can that not be told)?"""
        if self._version is None:
            return self.foreign
        return self._source._version != self._version

    def extend(self, tokens: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The round's kept `tokens` (host), and `input_ids`, the device sequence they were appended to."""
        # a write into the previous sequence before the append is in the new one too
        self._stale = self._stale or self._written()
        self._ids = torch.cat((self._ids, tokens.to(self._ids.dtype)), dim=1)
        self._watch(input_ids)

    @property
    def ids(self) -> torch.Tensor:
        if self._stale or self._written():
            self._ids = self._source.to("cpu", copy=True)
            self._stale = False
            self.reads += 1
            self._watch(self._source)
        return self._ids

    def contains(self, token_id: int) -> bool:
        return bool((self.ids.numpy() == token_id).any())
