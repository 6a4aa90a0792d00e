"""`synced_gpus=True` (ZeRO-3, FSDP): the peers' "is anyone still running?" all-reduce, read one call late.

Stock builds a tensor from a Python bool, all-reduces it and reads it back every step: two blocking syncs. Here this
peer's flag is derived on the device from its latest verdict, the all-reduce is queued (NCCL runs it on its own
stream; gloo runs it on the CPU), the sum goes to pinned memory, and the host reads the previous call's sum. Every
peer reads the same sums at the same call, so all stop at the same step; the one extra step is undone like any
lagged stop (transformers 5.17+ only: older loops test their device-tensor verdict on the host for `continue`).
"""

from __future__ import annotations

import torch


class PeerVerdict:
    """Allocated once per `generate()` call; `done()` is called at every loop check."""

    def __init__(self, device: torch.device):
        self.cuda = pin = device.type == "cuda"
        self.value = torch.zeros((), dtype=torch.float32, device=device)
        self.flag = torch.zeros((), dtype=torch.bool, device=device)
        self.sums = [torch.zeros((), dtype=torch.float32, device="cpu", pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.calls = 0

    def done(self, ctl, this_peer_finished: bool) -> bool:
        """Reduce this peer's latest verdict over all peers; answer from the previous call's sum."""
        # A peer is running while its latest device verdict says so and the host does not know better (a
        # max_length stop, or the lagged verdict, is already final on the host).
        verdict = ctl.last_verdict
        if verdict is None or this_peer_finished:
            self.value.fill_(0.0 if this_peer_finished else 1.0)
        else:
            ctl.wait_pending()  # the verdict was made on the side stream
            torch.any(verdict, out=self.flag)
            self.value.copy_(self.flag)
        return self._reduce_and_read_previous()

    def _reduce_and_read_previous(self) -> bool:
        import torch.distributed as dist

        slot = self.calls % 2
        dist.all_reduce(self.value, op=dist.ReduceOp.SUM)
        self.sums[slot].copy_(self.value, non_blocking=True)
        if self.cuda:
            self.events[slot].record(self.stream)
        self.calls += 1
        if self.calls == 1:
            return False  # nothing reduced before this call: keep going, as stock does on its first check
        previous = 1 - slot
        if self.cuda:
            self.events[previous].synchronize()
        return float(self.sums[previous]) == 0.0

    def drain(self) -> None:
        if self.cuda:
            for event in self.events:
                event.synchronize()
