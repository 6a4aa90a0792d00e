"""A greedy verify round's acceptance, replayed from one CUDA graph per width (issue 38).

`acceptance.select`, `accepted_length`, `last_is_eos` and the packing `RoundBox.send` does are about forty small
device ops per round: on an H200 host, 0.84 ms of a 2-layer draft's 18 ms round (`scripts/round_host_cost.py
--device cuda`), against a few microseconds of kernels. Their shapes depend only on the round's width K (candidates +
1) and on the call's constants (the vocabulary, the EOS ids, whether a length budget applies), so a greedy round
replays them: the round's logits, candidates, last token and budget are copied into the graph's inputs, one replay
computes the same ops on them (`_body`: the functions above, unchanged but for the budget, a device scalar here and
`torch.minimum` for `clamp(max=...)`: the same integer), and the packed verdict goes out with `RoundBox.send_packed`.

Where it runs: greedy rounds (`do_sample` off, no ensemble weight with draft logits: their choice is one `argmax`,
no random numbers), without scikit-learn's draft probabilities, on a CUDA device (or the tests' emulation), with the
sequence holding a token; 4.57-5.17's "done candidate" verdict (one device boolean) is one more input. A width is captured at its second sighting
(a width seen once, the last round clipped by the length, may never come back), at most `MAX_WIDTHS` per call; the
graphs, their inputs and their memory pool are the call's and are freed with it (`close`). A capture that fails
leaves the rounds eager for the rest of the call, with the device's generator healed, as the static loop's tail.
Every other round runs the ops eagerly, as before: `last_path().acceptance` says which, and why.
"""

from __future__ import annotations

import collections
import os
import warnings

import torch

from ...graphs.backend import capture, emulates
from . import acceptance

MAX_WIDTHS = 8
ENV = "TRANSFORMERS_ASYNC_STOP_ACCEPTANCE_GRAPH"  # "0": every round's acceptance eager (a switch for side-by-side runs)


def _where(tensor) -> tuple:
    """Where a replay finds a tensor: its memory, geometry and type."""
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.device)


class GraphedAcceptance:
    """One call's graphs of the greedy acceptance, by width."""

    def __init__(self, device, eos_cut, eos_ids, budgeted: bool, report=None):
        self.device = device
        self.eos_cut, self.eos_ids, self.budgeted = eos_cut, eos_ids, budgeted
        self.report = report
        self.graphs: dict = {}  # (K, the done-candidate verdict's shape) -> (inputs, outputs, graph)
        self.seen: collections.Counter = collections.Counter()
        self.pool = None
        self.off = None if device.type == "cuda" or emulates(device) else f"not CUDA ({device.type})"
        if self.off is None and os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
            self.off = f"{ENV}={os.environ[ENV]}"
        eos = ([eos_cut] if eos_cut is not None else []) + list(eos_ids or ())
        if self.off is None and any(ids.device != device for ids in eos):
            self.off = "EOS ids on another device (a copy inside a capture)"
        # a replay reads the EOS ids where they were at the capture: edits in place are seen, new memory is not
        # (`eos.data = other`, `set_`, `resize_` by a streamer or a processor; red team of the issue-38 cuts, hole 3)
        self.eos = eos
        self.eos_where = list(map(_where, eos))
        self.replayed = 0
        self.eager = 0
        self.why = self.off

    def why_not(self, do_sample, candidate_logits, ensemble_weight, is_done, probs, input_ids) -> str | None:
        """Why this round's acceptance runs eagerly (None: it may replay)."""
        if self.off is not None:
            return self.off
        if self.eos and list(map(_where, self.eos)) != self.eos_where:
            self.off = "EOS ids moved to other memory mid-call"
            self.close()
            return self.off
        if do_sample:
            return "sampling (its random draws stay eager)"
        if ensemble_weight is not None and candidate_logits is not None:
            return "an ensemble weight with draft logits"
        if is_done is not None and not (isinstance(is_done, torch.Tensor) and is_done.dtype == torch.bool
                                        and is_done.numel() == 1 and is_done.device == self.device):
            return "a done-candidate verdict other than one boolean on the device"
        if probs is not None:
            return "draft probabilities for scikit-learn"
        if input_ids.shape[1] == 0:
            return "a sequence without a token yet (inputs_embeds)"
        return None

    def run(self, new_logits, candidates, input_ids, budget, is_done=None):
        """(tokens, packed) from the graph of this width, or None: this round runs the ops eagerly. `tokens` and
        `packed` are the graph's own outputs: read (copied) before the next round's replay writes them again.
        `is_done`: 4.57-5.17's "done candidate" verdict (one device boolean), None on the other releases."""
        width = candidates.shape[1] + 1
        key = (width, None if is_done is None else tuple(is_done.shape))
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= MAX_WIDTHS:
                return self._eager(f"more than {MAX_WIDTHS} widths in one call")
            self.seen[key] += 1
            if self.seen[key] < 2:
                return self._eager(f"width {width} seen once")
            entry = self._capture(key, new_logits, candidates, input_ids, budget, is_done)
            if entry is None:
                return self._eager(self.off or "another thread is inside generate()")
        else:
            inputs, _, graph = entry
            self._load(inputs, new_logits, candidates, input_ids, budget, is_done)
            graph.replay()
        self.replayed += 1
        self._note()
        return entry[1]

    def _load(self, inputs, new_logits, candidates, input_ids, budget, is_done) -> None:
        logits, tokens, previous, limit, done = inputs
        logits.copy_(new_logits)
        tokens.copy_(candidates)
        previous.copy_(input_ids[0, -1:])
        if limit is not None:
            limit.fill_(budget)
        if done is not None:
            done.copy_(is_done)

    def _body(self, inputs):
        logits, candidates, previous, limit, done = inputs
        width = logits.shape[1]
        tokens, n_matches = acceptance.select(logits, candidates, None, width - 1, False, None)
        length = acceptance.accepted_length(n_matches, tokens, done, limit, self.eos_cut)
        eos_stop = acceptance.last_eos_after(previous, tokens, length, self.eos_ids) if self.eos_ids else None
        zero = length.new_zeros(())
        header = torch.stack([length, zero if eos_stop is None else eos_stop.long(), zero])
        return tokens, torch.cat((header, tokens[0]))

    def _capture(self, key, new_logits, candidates, input_ids, budget, is_done):
        device = self.device
        inputs = (torch.empty_like(new_logits), torch.empty_like(candidates),
                  torch.empty((1,), dtype=input_ids.dtype, device=device),
                  torch.empty((), dtype=torch.long, device=device) if self.budgeted else None,
                  None if is_done is None else torch.empty_like(is_done))
        self._load(inputs, new_logits, candidates, input_ids, budget, is_done)
        try:
            made = capture(device, self.pool, lambda: self._body(inputs))
        except Exception as error:  # KeyboardInterrupt, SystemExit propagate (after the generator is healed)
            self.off = f"the acceptance could not be captured ({type(error).__name__}: {error})"
            warnings.warn(f"async_stopping_criteria=True: {self.off}; it runs eagerly for the rest of this call "
                          "(identical output).", UserWarning, stacklevel=4)
            return None
        if made is None:
            return None
        graph, outputs = made
        self.pool = graph.pool()
        self.graphs[key] = (inputs, outputs, graph)
        graph.replay()
        return self.graphs[key]

    def _eager(self, why):
        self.eager += 1
        self.why = why
        self._note()
        return None

    def note_eager(self, why: str) -> None:
        """A round whose acceptance `why_not` kept eager (None, as `run` gives for an eager round)."""
        return self._eager(why)

    def _note(self) -> None:
        if self.report is None:
            return
        if self.replayed:
            tail = f"; {self.eager} eager: {self.why}" if self.eager else ""
            self.report.acceptance = f"graphed: {self.replayed} rounds{tail}"
        else:
            self.report.acceptance = f"eager: {self.why}"

    def close(self) -> None:
        self.graphs.clear()
        self.pool = None
