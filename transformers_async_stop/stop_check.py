"""The one-step-late stop verdict.

Stock `generate()` asks "has every row finished?" after each step by reading a device tensor on the host
(`unfinished_sequences.max() == 0`). The read waits for the whole step to finish, so the host cannot queue step
t+1 while the GPU runs step t. `AsyncStop` instead copies step t's verdict into pinned host memory with a
non-blocking copy and an event, and decides whether to run step t+1 from step t-1's verdict, whose copy has long
landed. The cost is one extra step when the verdict says stop; `finish()` reports it so the caller undoes it.

`max_length` needs no device read (it is a host-side count) and stays exact, so no step ever runs past it: a
StaticCache holds exactly `max_length` positions.

Per `generate()` call: two pinned flag slots (two token slots with a streamer), two copy events and one join event
are created here, once; the side stream is cached per device. Nothing is allocated per step on the host side
beyond the RNG snapshot when sampling.
"""

from __future__ import annotations

import contextvars
import warnings

import torch

from .cache_rollback import cache_blocks_deferral
from .config import warn_stock

# The controller of the `generate()` call running on this thread/context, if it runs the deferred path.
ACTIVE: contextvars.ContextVar["AsyncStop | None"] = contextvars.ContextVar("transformers_async_stop_active",
                                                                           default=None)

_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class RngGuard:
    """Snapshot of the generator that sampling on `device` draws from, to give back the extra step's draws."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generator = torch.cuda.default_generators[index]
        else:
            self.generator = torch.default_generator
        self.saved = None

    def snapshot(self) -> None:
        # host-side state (seed, philox offset) on CUDA: no device read
        self.saved = self.generator.get_state()

    def restore(self) -> None:
        if self.saved is not None:
            self.generator.set_state(self.saved)


class AsyncStop:
    """Controller of one deferred `generate()` decode loop."""

    def __init__(self, input_ids: torch.Tensor, max_length: int | None, *, do_sample: bool, streamer=None):
        self.device = input_ids.device
        self.cuda = self.device.type == "cuda"
        self.max_length = max_length
        self.streamer = streamer
        batch_size = input_ids.shape[0]
        pin = self.cuda
        self._flags = [torch.zeros((), dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._tokens = (
            [torch.zeros(batch_size, dtype=torch.long, pin_memory=pin) for _ in range(2)] if streamer else None
        )
        if self.cuda:
            self.main = torch.cuda.current_stream(self.device)
            self.side = side_stream(self.device)
            # `torch.cuda.set_stream` also makes the stream's device current; the caller's current device may be
            # another one (inputs on cuda:1 while cuda:0 is current), and is put back after each side section
            self._home = torch.cuda.current_device()
            # one event per slot marks the end of a step's side-stream work (criteria, update, verdict copy): the
            # host waits on the previous slot, the main stream on the current one
            self._copied = [torch.cuda.Event() for _ in range(2)]
            # `Stream.wait_stream` creates an event per call; one reused event does the same without the allocation
            self._main_ready = torch.cuda.Event()
            self._pending = None
        self.rng = RngGuard(self.device) if do_sample else None
        self.route_a = False  # set by the `_sample` wrapper: which loop shape drives this controller
        self.steps = 0
        self.last_length = input_ids.shape[-1]
        self.stop_reported = False
        self.steps_to_undo = 0
        self._on_side = False
        self._warned: set[str] = set()
        # A cache created inside the loop (5.0-5.16 build it in the first forward) is only seen after prefill;
        # if the caller will see it and it cannot give a step back, the loop reads each verdict at once instead
        self.cache_returned = False
        self.synchronous = False
        self._cache_seen = False
        self.peers: _PeerVerdict | None = None
        self._last_finished: torch.Tensor | None = None

    def warn_host_verdict(self, criteria) -> None:
        """A user criterion answered with a Python value: it read the device itself, every step."""
        name = type(criteria).__name__
        if name in self._warned:
            return
        self._warned.add(name)
        warnings.warn(
            f"async_stopping_criteria=True: stopping criterion {name} returned a "
            "Python value instead of a per-row bool tensor; computing it most likely read a device tensor on the "
            "host (a blocking sync every step) that the flag cannot remove. Results stay exact. Return "
            "`torch.BoolTensor` of shape (batch_size,) to make it sync-free.",
            UserWarning,
            stacklevel=5,
        )

    # -- synced_gpus: the peers' verdict ---------------------------------------------------------------------
    def enable_peer_reduction(self) -> None:
        """Allocate, once per call, what the deferred all-reduce of `synced_gpus=True` needs."""
        self.peers = _PeerVerdict(self.device)

    def peers_done(self, this_peer_finished: bool) -> bool:
        """Reduce this peer's latest verdict over all peers; answer from the previous call's sum."""
        peers = self.peers
        # A peer is unfinished while its latest device verdict says so and the host does not know better
        # (a max_length stop, or the lagged verdict, is already final on the host).
        if self._last_finished is None or this_peer_finished:
            peers.value.fill_(0.0 if this_peer_finished else 1.0)
        else:
            torch.logical_not(self._last_finished, out=peers.flag)
            peers.value.copy_(peers.flag)
        return peers.reduce_and_read_previous()

    def see_cache(self, cache) -> None:
        """Called with the loop's cache after the first forward (see `masking.patched_update_model_kwargs`)."""
        if self._cache_seen or cache is None:
            return
        self._cache_seen = True
        if not self.cache_returned:
            return
        reason = cache_blocks_deferral(cache, self.route_a)
        if reason is not None and self.steps == 0:
            self.synchronous = True
            warn_stock(reason)

    # -- streams --------------------------------------------------------------------------------------------
    def to_side(self, *read: torch.Tensor) -> None:
        """Run what follows (criteria, the `unfinished_sequences` update, the verdict) on the side stream."""
        if not self.cuda or self._on_side:
            return
        self._main_ready.record(self.main)
        self.side.wait_event(self._main_ready)  # the criteria read this step's ids and scores
        for tensor in read:
            # made on the main stream, read on the side one: keep the allocator from reusing them too early
            tensor.record_stream(self.side)
        torch.cuda.set_stream(self.side)
        self._on_side = True

    def to_main(self, done: "torch.cuda.Event | None" = None) -> None:
        """Back to the main stream; `done` (recorded on the side stream) is what the main stream must wait for."""
        if not self._on_side:
            return
        if done is None:
            done = self._copied[self.steps % 2]
        done.record(self.side)
        torch.cuda.set_stream(self.main)
        if self._home != self.main.device_index:
            torch.cuda.set_device(self._home)
        self._on_side = False
        self._pending = done
        if self.steps == 0:
            # The first update read `unfinished_sequences` from the main stream's memory pool: once Python drops
            # it, the main stream may reuse that memory before the side stream has read it. Wait here, once;
            # later verdicts live in the side stream's pool (and are `record_stream`ed for the main one).
            self.join()

    def join(self) -> None:
        """Make the main stream wait for the last criteria before it uses `unfinished_sequences` again.

        Called from the logits processor, i.e. after the next forward has been queued: the criteria of step t
        overlap the forward of step t+1 instead of delaying it.
        """
        if self.cuda and self._pending is not None:
            self.main.wait_event(self._pending)
            self._pending = None

    def adopt(self, made_on_side: torch.Tensor) -> None:
        """A tensor made on the side stream and used next on the main stream."""
        if self._on_side:
            made_on_side.record_stream(self.main)

    # -- the verdict ----------------------------------------------------------------------------------------
    def step(self, finished: torch.Tensor, tokens: torch.Tensor | None, length: int) -> bool:
        """Record step t's verdict (a device bool), return whether to stop, from step t-1's verdict and `length`."""
        if self.synchronous:
            return self._step_now(finished, tokens, length)
        slot = self.steps % 2
        if self.peers is not None:
            self._last_finished = finished  # the peers' reduction reads it at the next loop check
        self._flags[slot].copy_(finished, non_blocking=True)
        if self._tokens is not None and tokens is not None:
            if self._on_side:
                tokens.record_stream(self.side)
            self._tokens[slot].copy_(tokens, non_blocking=True)
        if self.cuda:
            if self._on_side:
                self.to_main(self._copied[slot])
            else:
                # on the stream of the verdict's device, whichever device is current (a model split over GPUs)
                self._copied[slot].record(self.main)

        if self.steps > 0:
            previous = 1 - slot
            if self.cuda:
                # step t-1 finished long ago unless the host is far ahead: this wait bounds run-ahead to one step
                self._copied[previous].synchronize()
            if self.streamer is not None and self._tokens is not None:
                self.streamer.put(self._tokens[previous].clone())
            self.stop_reported = bool(self._flags[previous])
        self.steps += 1
        self.last_length = length
        stopping = self.stop_reported or (self.max_length is not None and length >= self.max_length)
        if not stopping and self.rng is not None:
            self.rng.snapshot()
        return stopping

    def _step_now(self, finished: torch.Tensor, tokens: torch.Tensor | None, length: int) -> bool:
        """Stock behaviour: read this step's verdict now (a blocking read on CUDA); nothing to undo later."""
        self.to_main()
        self.join()  # the verdict was computed on the side stream
        if self.streamer is not None and tokens is not None:
            self.streamer.put(tokens.cpu())
        self.steps += 1
        self.last_length = length
        return bool(finished) or (self.max_length is not None and length >= self.max_length)

    def finish(self) -> int:
        """Drain the copies; return how many steps (0 or 1) the caller must undo, and undo the RNG draws."""
        self.close()
        if self.peers is not None:
            self.peers.drain()
        if self.cuda:
            for event in self._copied:
                event.synchronize()
        self.steps_to_undo = 1 if self.stop_reported else 0
        if self.streamer is not None and self._tokens is not None and not self.steps_to_undo and self.steps:
            self.streamer.put(self._tokens[(self.steps - 1) % 2].clone())
        if self.steps_to_undo and self.rng is not None:
            self.rng.restore()
        return self.steps_to_undo

    @property
    def kept_cache_length(self) -> int:
        """Positions the flag-off run leaves in the cache: every token but the last returned one."""
        return self.last_length - self.steps_to_undo - 1

    def close(self) -> None:
        """Leave the streams as found, also after an exception inside the loop."""
        if self.cuda:
            self.to_main()
            self.join()
            self.main.wait_stream(self.side)


class _PeerVerdict:
    """The deferred all-reduce of `synced_gpus=True`: "how many peers are unfinished", one call late.

    Stock builds a tensor from a Python bool, all-reduces it and reads it back every step: two blocking syncs. Here
    the flag is derived on the device, the all-reduce is queued (NCCL runs it on its own stream; gloo runs it on
    the CPU), the sum goes to pinned memory, and the host reads the previous call's sum. All peers read the same
    sums at the same call, so they agree on when to stop; the one extra step is undone like a lagged stop.
    """

    def __init__(self, device: torch.device):
        self.cuda = pin = device.type == "cuda"
        self.value = torch.zeros((), dtype=torch.float32, device=device)
        self.flag = torch.zeros((), dtype=torch.bool, device=device)
        self.sums = [torch.zeros((), dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.calls = 0

    def reduce_and_read_previous(self) -> bool:
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


def patched_deferred_class(original, target):
    from .cache_rollback import rollback_one_step, why_not_rollbackable

    class AsyncDeferredStopCheck(original):
        """Copied from transformers v5.23.0 `DeferredStopCheck` (identical in 5.17). Differences:

        - used on any device when `async_stopping_criteria=True` (upstream: MPS only); without the flag, or on a
          call our `_sample` wrapper did not take over, every method is upstream's;
        - the verdict and the token copy are recorded on the side stream the criteria ran on (see `AsyncStop`);
        - a StaticCache (not croppable upstream) is rolled back too (`cache_rollback.rollback_one_step`);
        - sampling's RNG draws of the extra step are given back;
        - an `EncoderDecoderCache` (no `.layers`) is handled through its decoder's `self_attention_cache`.
        """

        @staticmethod
        def is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs):
            ctl = ACTIVE.get()
            if ctl is None:
                return original.is_supported(device, cache, cache_is_returned, is_assistant, *args, **kwargs)
            # our `_sample` wrapper already checked the cache; an assistant never gets a controller
            return not is_assistant

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None, *args, **kwargs):
            self._ctl = ACTIVE.get()
            if self._ctl is None:
                super().__init__(input_ids, max_length, cache, cache_is_returned, streamer, *args, **kwargs)
                return
            # `max_length` and the streamer are the ones our `_sample` wrapper gave the controller already
            self.streamer = streamer
            self.cache = cache if cache_is_returned else None
            self._static = self.cache is not None and why_not_rollbackable(self.cache) is None and not getattr(
                self.cache, "is_croppable", False)
            self._recorded = self.cache is not None and not self._static
            if self._recorded:
                self.cache.activate_past_recording()

        def __call__(self, unfinished_sequences, tokens, length):
            ctl = self._ctl
            if ctl is None:
                return super().__call__(unfinished_sequences, tokens, length)
            ctl.adopt(unfinished_sequences)
            stopping = ctl.step(unfinished_sequences.max() == 0, tokens, length)
            if not stopping and self._recorded:
                self.cache.crop(0)  # upstream: trim the recorded past back to the window
            return stopping

        def finish(self):
            ctl = self._ctl
            if ctl is None:
                return super().finish()
            steps_to_undo = ctl.finish()
            if self.cache is not None:
                if self._recorded:
                    self.cache.crop(-steps_to_undo)
                    # an EncoderDecoderCache has no `.layers` (upstream's finish() failed there): its decoder's do
                    for layer in getattr(self.cache, "self_attention_cache", self.cache).layers:
                        if hasattr(layer, "record_past"):
                            layer.record_past = False
                elif steps_to_undo:
                    rollback_one_step(self.cache, ctl.kept_cache_length)
            return steps_to_undo

    AsyncDeferredStopCheck.__name__ = original.__name__
    AsyncDeferredStopCheck.__qualname__ = original.__qualname__
    AsyncDeferredStopCheck.__module__ = original.__module__
    AsyncDeferredStopCheck.__wrapped__ = original
    from .patching import MARKER

    setattr(AsyncDeferredStopCheck, MARKER, True)
    return AsyncDeferredStopCheck
