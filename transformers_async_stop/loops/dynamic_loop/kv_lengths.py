"""How many attention lengths a call's decode steps met that this thread had not met before (issue 44).

On CUDA, SDPA's cuDNN backend (the decode step's attention for bf16 and fp16 on Hopper with torch 2.11) builds an
execution plan for each exact sequence length it is asked for, and PyTorch keeps those plans per thread
(`getMHAGraphCache_` is `thread_local`): about 35 ms of host time per new key/value length on an H200, in stock and with
the flag alike (docs/benchmarks.md, "cold lengths"). A call over lengths the thread has not met runs at several
times its warm speed, which the flag cannot hide without changing the kernels of both sides (`TORCH_CUDNN_SDPA_AVOID_
RECOMPILE=1`, or the cuDNN backend turned off: README, "Cold lengths"). So the dynamic-cache loop counts them, per
thread and per attention shape, and `last_path().attention_lengths` says how many a call met: "12 new of 127" means 12
of the call's 127 decode steps ran at a key/value length this thread had not run before.

A host-side count from the cache's length at each step: no device read, a set lookup per step. It counts decode
steps of this package's dynamic-cache loop only (the prefill and stock's loops are not counted), on CUDA only.
"""

from __future__ import annotations

import threading

from ...graphs.backend import emulates

_SEEN = threading.local()
_MAX = 1 << 16  # lengths remembered per thread (a long-running server thread starts counting again beyond)


class Meter:
    """The call's count: `step(length)` before each decode step's forward."""

    __slots__ = ("seen", "shape", "new", "steps")

    def __init__(self, model, batch: int):
        seen = getattr(_SEEN, "lengths", None)
        if seen is None or len(seen) > _MAX:
            seen = _SEEN.lengths = set()
        self.seen = seen
        config = getattr(model, "config", None)
        weight = model.get_input_embeddings().weight
        # what else the cuDNN plan is keyed by: the dtype, the device, the batch and the attention's geometry
        self.shape = (weight.device, weight.dtype, batch, getattr(config, "num_attention_heads", None),
                      getattr(config, "num_key_value_heads", None), getattr(config, "head_dim", None),
                      getattr(config, "hidden_size", None))
        self.new = self.steps = 0

    def step(self, length: int) -> None:
        self.steps += 1
        key = (self.shape, length)
        if key not in self.seen:
            self.seen.add(key)
            self.new += 1

    def text(self) -> str:
        return f"{self.new} new of {self.steps}"


def meter_for(model, input_ids):
    """A meter where the call runs on CUDA (elsewhere no attention backend keys a plan by length; the CPU under the
    tests' graph emulation counts as CUDA would), else None."""
    if input_ids.device.type != "cuda" and not emulates(input_ids.device):
        return None
    return Meter(model, input_ids.shape[0])
