"""The workloads: what users run, as a sequence of `generate()` calls, each call's kwargs the same for every variant.

- `stream`: one prompt per call, batch 1, prompt lengths spread over a range and shuffled, so that every call meets
  KV lengths the calls before it did not all meet;
- `padded`: left-padded batches of 4 to 16 prompts of different lengths, the batch size changing call to call;
- `padded-b1`, `padded-b4`, `padded-b8`: one batch size per workload (issue 44's per-size goals), rows of different
  lengths; at batch 1 the one prompt is left-padded to a multiple of 64, as a tokenizer's `pad_to_multiple_of=64`
  pads it;
- `chat`: a conversation whose every turn continues the cache the previous turn returned (user tokens appended to the
  returned sequences, the returned cache passed back), so the KV length only grows.
A workload is played as a pass (`Workload.play`); the timing, the fresh threads and the exactness check are
`passes.py`'s. The sizes are per device: a Llama-1B-shaped model on CUDA, the tiny Llama on the CPU (`--quick` and the
CPU tests), where the calls are few and short.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import torch

from ...release_checks import cache_kwarg

KINDS = ("stream", "padded", "chat", "padded-b1", "padded-b4", "padded-b8")
# a call made in each fresh thread before its cold pass, at lengths below every workload's (prompt 2, KV 2-3): the
# thread's cuBLAS and cuDNN handles are taken there, so that the cold pass pays for lengths, not for handles
HANDLE_PROMPT = 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """How big one workload's pass is on a device."""

    calls: int
    lengths: tuple[int, int]  # the prompt lengths' range (inclusive)
    batches: tuple[int, ...] = (1,)  # batch size of call i: batches[i % len(batches)]
    turn_tokens: int = 0  # chat: the user tokens appended at each turn after the first
    pad_multiple: int = 0  # batch 1: the prompt left-padded to a multiple of this (0: not padded)


# on CUDA (a Llama-1B-shaped bf16 model, 48 new tokens per call), sized so that the three workloads' passes for
# stock, upstream and the flag fit in about a minute and a half of an H200: stock's host-bound steps (~13 ms) and the
# first meetings (~15-35 ms per new length, the measurement) dominate
CUDA_SHAPES = {
    "stream": Shape(calls=6, lengths=(17, 140)),
    "padded": Shape(calls=4, lengths=(17, 140), batches=(4, 8, 16, 8)),
    "chat": Shape(calls=3, lengths=(32, 32), turn_tokens=24),
    # one batch size each: 4 calls at lengths 17-140, as the mixed `padded` workload draws them
    "padded-b1": Shape(calls=4, lengths=(17, 140), pad_multiple=64),
    "padded-b4": Shape(calls=4, lengths=(17, 140), batches=(4,)),
    "padded-b8": Shape(calls=4, lengths=(17, 140), batches=(8,)),
}
CPU_SHAPES = {
    "stream": Shape(calls=4, lengths=(5, 20)),
    "padded": Shape(calls=2, lengths=(5, 20), batches=(4, 8)),
    "chat": Shape(calls=3, lengths=(8, 8), turn_tokens=4),
    "padded-b1": Shape(calls=2, lengths=(5, 20), pad_multiple=8),
    "padded-b4": Shape(calls=2, lengths=(5, 20), batches=(4,)),
    "padded-b8": Shape(calls=2, lengths=(5, 20), batches=(8,)),
}


@dataclasses.dataclass
class CallResult:
    ms: float
    tokens: int  # new positions generated (a step of the whole batch counts once)
    sequences: torch.Tensor  # on the CPU, for the exactness check
    path: str | None = None


class Workload:
    """One workload's calls on one model (`kind` in KINDS); `play` runs them all, in order, timing each call with
    `clock` (a function of a thunk: returns (ms, what the thunk returned))."""

    def __init__(self, kind: str, shape: Shape, new_tokens: int, pad_token_id: int, vocab: int, device):
        if kind not in KINDS:
            raise ValueError(f"workload {kind!r}: one of {KINDS}")
        self.kind, self.shape, self.new_tokens = kind, shape, new_tokens
        self.pad, self.vocab, self.device = pad_token_id, vocab, device

    def describe(self) -> str:
        s = self.shape
        lengths = f"{s.lengths[0]}" if s.lengths[0] == s.lengths[1] else f"{s.lengths[0]}-{s.lengths[1]}"
        if self.kind == "chat":
            return (f"{s.calls} turns, a {lengths}-token first prompt, {s.turn_tokens} user tokens per later turn, "
                    f"{self.new_tokens} new tokens per turn, the returned cache continued")
        if s.batches == (1,):
            batches = f"batch 1, left-padded to a multiple of {s.pad_multiple}" if s.pad_multiple else "batch 1"
        else:
            batches = "batches " + ",".join(map(str, s.batches)) + " (left-padded)"
        return f"{s.calls} calls, prompt lengths {lengths}, {batches}, {self.new_tokens} new tokens each"

    def kv_lengths(self) -> tuple[int, int]:
        """The lowest and highest KV length a pass meets (the handle call stays below the lowest)."""
        s = self.shape
        if self.kind == "chat":
            top = s.lengths[0] + s.calls * self.new_tokens + (s.calls - 1) * s.turn_tokens
        else:
            top = self._width(s.lengths[1]) + self.new_tokens
        return s.lengths[0], top

    # --- inputs, the same for every variant (seeded) ------------------------------------------------------------
    def _ids(self, rows: int, length: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, self.vocab - 1, (rows, length), generator=gen)

    def prompt_lengths(self) -> list[int]:
        lo, hi = self.shape.lengths
        count = self.shape.calls
        spread = [lo + round(i * (hi - lo) / max(1, count - 1)) for i in range(count)]
        random.Random(44).shuffle(spread)  # every call meets lengths the earlier ones did not all meet
        return spread

    def call_inputs(self, index: int) -> dict:
        """`input_ids` and `attention_mask` of call `index` (stream and padded)."""
        batch = self.shape.batches[index % len(self.shape.batches)]
        if batch == 1:
            length = self.prompt_lengths()[index]
            ids = self._ids(1, length, 100 + index)
            if not self.shape.pad_multiple:
                return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            lengths, width = [length], self._width(length)
            ids = torch.cat([ids.new_full((1, width - length), self.pad), ids], dim=-1)
        else:
            lo, hi = self.shape.lengths
            gen = random.Random(200 + index)
            lengths = [gen.randint(lo, hi) for _ in range(batch)]
            width = max(lengths)
            ids = self._ids(batch, width, 300 + index)
        mask = torch.ones_like(ids)
        for row, length in enumerate(lengths):
            ids[row, :width - length] = self.pad
            mask[row, :width - length] = 0
        return {"input_ids": ids, "attention_mask": mask}

    def _width(self, length: int) -> int:
        """A batch-1 prompt's width with its padding (`pad_multiple`), else its length."""
        multiple = self.shape.pad_multiple
        return -(-length // multiple) * multiple if multiple else length

    def _kwargs(self, inputs: dict, **extra) -> dict:
        kwargs = {name: value.to(self.device) for name, value in inputs.items()}
        # every call generates its budget (eos masked until then): every variant does the same work
        kwargs.update(max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, do_sample=False,
                      pad_token_id=self.pad, **extra)
        return kwargs

    def handle_call(self) -> dict:
        """A call below the workload's lengths (see HANDLE_PROMPT)."""
        ids = self._ids(1, HANDLE_PROMPT, 7)
        kwargs = self._kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        kwargs.update(max_new_tokens=2, min_new_tokens=2)
        return kwargs

    # --- a pass -------------------------------------------------------------------------------------------------
    def play(self, model, flag: dict, clock: Callable, path: Callable[[], str | None]) -> list[CallResult]:
        """Every call of the workload, in order; `path()` is read after each call (the variant's path, or None)."""
        if self.kind == "chat":
            return self._chat(model, flag, clock, path)
        results = []
        for index in range(self.shape.calls):
            kwargs = self._kwargs(self.call_inputs(index))
            ms, out = clock(lambda: model.generate(**kwargs, **flag))
            results.append(CallResult(ms, self.new_tokens, out.cpu(), path()))
        return results

    def _chat(self, model, flag, clock, path) -> list[CallResult]:
        results, sequences, cache = [], None, None
        for turn in range(self.shape.calls):
            if turn == 0:
                ids = self._ids(1, self.shape.lengths[0], 400)
            else:
                ids = torch.cat([sequences, self._ids(1, self.shape.turn_tokens, 400 + turn).to(sequences.device)],
                                dim=-1)
            kwargs = self._kwargs({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  return_dict_in_generate=True)
            if cache is not None:
                kwargs[cache_kwarg.name()] = cache  # the conversation continues the cache the last turn returned
            ms, out = clock(lambda: model.generate(**kwargs, **flag))
            sequences, cache = out.sequences, cache_kwarg.of_output(out)
            results.append(CallResult(ms, self.new_tokens, sequences.cpu(), path()))
        # the conversation's cache as the last turn returned it: part of what the flag must give back as stock does
        results[-1].sequences = (results[-1].sequences, [(layer.keys.cpu(), layer.values.cpu())
                                                         for layer in cache.layers])
        return results


def same_outputs(a: list[CallResult], b: list[CallResult]) -> bool:
    """Every call's sequences (and the chat's last returned cache) equal, bit for bit."""
    if len(a) != len(b):
        return False
    return all(_equal(x.sequences, y.sequences) for x, y in zip(a, b))


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and bool(torch.equal(x, y))
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y
