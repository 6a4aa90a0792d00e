"""Everything a static-cache decode step does on the device after the forward, as one body: eager or replayed.

Copied from transformers v5.17.0-v5.23.0 `GenerationMixin._sample` (the part of the loop body between the logits
copy and `stop_check`) and `EosTokenCriteria.__call__`. Differences, same values:
- the logits land in one fixed fp32 buffer (stock: `.to(copy=True, dtype=float32)`, a new tensor each step);
- the new token is written into a preallocated sequence at a device-side length (stock: `torch.cat`);
- an exact `EosTokenCriteria` compares the new token with the EOS ids (stock: `isin` on `input_ids[:, -1]`, the
  same token), updating `unfinished_sequences` in place;
- the next step's inputs are advanced in place (`inputs.StepInputs`).

On CUDA, when every processor is graph-safe (`eligibility.py`), the body runs eagerly the first time a phase is seen
(a phase: the host decisions that can change with the length, such as the minimum-length processors'), is captured
into a CUDA graph the second time and replayed from then on. Sampling draws from the device's default generator,
which CUDA graphs advance exactly as the eager ops do. The graphs, their memory pool and the buffers belong to one
call: nothing outlives it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _capture_stream(device: torch.device) -> "torch.cuda.Stream":
    # a graph cannot be captured on the legacy default stream, where most callers run
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def prefix(seq: torch.Tensor, length: int) -> torch.Tensor:
    """The sequence so far, as user code gets it: its first `length` columns, contiguous (a copy for several rows)."""
    ids = seq[:, :length]
    return ids if ids.is_contiguous() else ids.contiguous()


class Tail:
    """The device work of every decode step after the forward, for one `_sample` call."""

    def __init__(self, plan, seq: torch.Tensor, length: int, unfinished: torch.Tensor, pad_token_id):
        self.plan = plan
        self.seq = seq  # (batch, max_length): the prompt, then each step's token
        self.length = torch.tensor([length], dtype=torch.long, device=seq.device)  # columns of `seq` written
        self.unfinished = unfinished
        self.pad = pad_token_id
        self.tokens = torch.empty(seq.shape[0], dtype=torch.long, device=seq.device)
        self.logits = None  # (batch, vocab) fp32, made at the first step
        self.eos = None
        if plan.eos:
            for criterion in plan.eos:  # stock moves them at every call; once is the same
                criterion.eos_token_id = criterion.eos_token_id.to(seq.device)
            self.eos = torch.cat([c.eos_token_id.reshape(-1) for c in plan.eos])
        self.inputs = None  # the loop's `StepInputs`, once the first decode step's inputs are known
        self.capture = plan.capture
        self.graphs: dict = {}
        self.outputs: dict = {}  # per phase: the graph's processed-scores tensor (rewritten by each replay)
        self.seen: set = set()
        self.pool = None

    def load(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's last-position logits into the fixed fp32 buffer (eager: the forward's output moves)."""
        last = logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty(last.shape, dtype=torch.float32, device=self.seq.device)
        self.logits.copy_(last)
        return self.logits

    def run(self, length: int, advance: bool) -> torch.Tensor:
        """One step's processors, token, EOS check, sequence write and (`advance`) next inputs; the processed scores.
        `length`: the sequence length before this step's token (what stock's processors see)."""
        key = (self.plan.phase(length), advance)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return self.outputs[key]
        if self.capture and key in self.seen:
            scores = self._capture(key, length, advance)
            if scores is not None:
                return scores
        self.seen.add(key)
        return self._body(prefix(self.seq, length), advance)

    def _body(self, input_ids: torch.Tensor, advance: bool) -> torch.Tensor:
        plan = self.plan
        scores = self.logits
        for processor in plan.processors:
            scores = processor(input_ids, scores)
        if plan.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if plan.has_eos:
            next_tokens = next_tokens * self.unfinished + self.pad * (1 - self.unfinished)
        self.tokens.copy_(next_tokens)
        self.seq.index_copy_(1, self.length, next_tokens[:, None])
        self.length.add_(1)
        if self.eos is not None:
            self.unfinished.bitwise_and_(~(next_tokens[:, None] == self.eos).any(-1))
        if advance:
            self.inputs.advance(next_tokens)
        return scores

    def _capture(self, key, length: int, advance: bool):
        """Capture the body for `key` and replay it once (this step); None if capture failed (then eager for good)."""
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.seq.device)
        stream = _capture_stream(self.seq.device)
        stream.wait_stream(main)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    scores = self._body(self.seq[:, :length], advance)
                except BaseException:
                    with contextlib.suppress(Exception):
                        graph.capture_end()
                    raise
                graph.capture_end()
        except Exception as error:  # a processor declared graph-safe that is not: run eagerly from now on
            self.capture = False
            warnings.warn(f"async_stopping_criteria=True: the decode step could not be captured into a CUDA graph "
                          f"({type(error).__name__}: {error}); it runs eagerly for the rest of this call (identical "
                          "output).", UserWarning, stacklevel=4)
            return None
        self.pool = graph.pool()
        self.graphs[key] = graph
        self.outputs[key] = scores
        graph.replay()
        return scores

    def close(self) -> None:
        """Free the graphs and their pool (the call is over)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
