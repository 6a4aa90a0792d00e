"""`AsyncStop`: the one-step-late stop verdict of one decoding loop.

Stock `generate()` asks "has every row finished?" at the end of each step by reading a device tensor on the host,
which waits for the whole step. Here step t's verdict is copied into pinned host memory with a non-blocking copy
and an event. The host reads it while step t+1 runs: at step t+1's logits processors (`join`), after step t+1's
forward has been queued, so the GPU always has that forward to work on while the host waits, if it waits at all.

If step t's verdict says "all finished", step t+1 is the extra step, the one the flag-off run never made. The host
knows it before any logits processor or stopping criterion of that step runs, so none of them is called (user
code sees exactly the calls the flag-off run makes), and `finish()` reports the step so the caller undoes its
forward: the sequences, the records, the cache, and the random numbers it drew (the RNG state is snapshotted at the
end of every step that is not known to be the last, and put back).

`max_length`, and the room left in a fixed-size cache, are decided on the host at the same step as stock: no step
ever runs past either. The room is counted in the cache's own positions (its counter after the prefill, copied to
pinned memory once per call and read when first needed), not in sequence length: a multi-turn caller may feed only
the tokens the cache lacks, or `inputs_embeds`.

Per call: two pinned verdict slots (two token slots with a streamer), two events and one "main stream ready" event.
Per step: one non-blocking copy (two with a streamer), two event records, two stream waits, two stream switches.
"""

from __future__ import annotations

import warnings

import torch

from ..undo.cache_rollback import cache_blocks_deferral, cache_end, capacity
from .stock_path import warn_stock
from ..release_checks.input_drops import drop_length

_SIDE_STREAMS: dict[int, list] = {}


def side_stream(device: torch.device, main) -> "torch.cuda.Stream":
    """The package's side stream on `device` (created once per device), never the stream the caller runs on: a
    `generate()` called inside a stopping criterion runs on the outer call's side stream and gets another one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _SIDE_STREAMS.setdefault(index, [])
    for stream in streams:
        if stream != main:
            return stream
    stream = torch.cuda.Stream(device=index)
    streams.append(stream)
    return stream


class RngGuard:
    """The generator the extra step draws from on `device` (dropout, sampling), snapshotted to give its draws back."""

    __slots__ = ("generator", "saved")

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generator = torch.cuda.default_generators[index]
        else:
            self.generator = torch.default_generator
        self.saved = None

    def snapshot(self) -> None:
        # on CUDA this is host-side state (seed and philox offset): no device read
        self.saved = self.generator.get_state()

    def restore(self) -> None:
        if self.saved is not None:
            self.generator.set_state(self.saved)


def _grown_length(cache):
    """The positions a growing cache holds (`get_seq_length`: a host int for dynamic layers), or None."""
    try:
        length = cache.get_seq_length()
    except Exception:  # a cache that cannot tell: the controller reads every verdict at once
        return None
    if isinstance(length, torch.Tensor) and length.numel() == 1:
        return length.reshape(1)
    return length if isinstance(length, int) else None


class AsyncStop:
    """Controller of one deferred decoding loop (`_sample` or `_beam_search`).

    The loop calls, per step: `to_side` when the stopping criteria start (they run on the side stream), `record`
    at the end of the step with the step's verdict, and `join` at the next step's logits processors.
    """

    def __init__(self, input_ids: torch.Tensor, max_length: int | None, *, done_when: str, streamer=None,
                 cache_returned: bool = False, loop_undoes_steps: bool = False):
        self.device = device = input_ids.device
        self.cuda = device.type == "cuda"
        self.max_length = max_length
        self.streamer = streamer
        # what the recorded verdict tensor holds: "unfinished" (per-row flags, stop when none is set), "finished"
        # (a bool, stop when true) or "running" (a bool, stop when false)
        self._done_when = done_when
        self.cache_returned = cache_returned
        # 5.17+ loop shape (`_sample` undoes the steps): a returned croppable cache records its past (stop_check.py)
        self.loop_undoes_steps = loop_undoes_steps
        self._flags = None  # two pinned copies of the verdict, allocated at the first step
        self._views = None  # numpy views of them: reading one costs no tensor op
        self._tokens = [torch.zeros(input_ids.shape[0], dtype=torch.long, device="cpu", pin_memory=self.cuda)
                        for _ in range(2)] if streamer is not None else None
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.side = side_stream(device, self.main)
            # `torch.cuda.set_stream` also makes the stream's device current; the caller's may be another one
            # (inputs on cuda:1 while cuda:0 is current): it is put back after each side section
            self._home = torch.cuda.current_device()
            self._on_other_device = self._home != self.main.device_index
            self._ready = torch.cuda.Event()  # main -> side: this step's ids and scores are made
            self._done = [torch.cuda.Event() for _ in range(2)]  # side -> main and host: step's verdict is copied
        self.rng = RngGuard(device)
        self.steps = 0  # steps recorded
        self.read = 0  # steps whose verdict the host has read
        self.last_length = input_ids.shape[-1]
        self.extra = False  # the step running now is the one the flag-off run never made
        self.overran = False  # an exception left the loop after a step stock never reached had run its forward
        self.room = None  # positions a fixed-size cache can hold, or the model's position table if fewer
        self.table = None  # positions the model's forward can reach: its position tables (`watch_positions`)
        self.position_watch = None  # the observation of the call's first forward, until the cache after it is seen
        self.why_table = None  # why `table` is what it is, where it is not a table's size
        self.cacheless = False  # the call runs without a cache (`watch_positions`)
        self._budget = None  # the call's first `MaxLengthCriteria`, read at every step (`follow_max_length`)
        # 4.57-5.3 static layers write where `cache_position` says: the first decode step's (the loop's kwargs
        # after the prefill, a one-element device tensor), from which the extra step's position follows
        self.next_position = None
        self._cache_end = None  # host int: where the first decode forward writes (the cache's end after the prefill)
        self._cache_end_copy = None  # (pinned tensor, event) until it is read
        self.synchronous = False  # read each verdict at once (a returned cache that cannot give a step back)
        self.cache_seen = False
        self.planned = False  # the per-call plans that need the model and its cache were made (masking.py)
        self.kwargs_update = None  # the loop's lean `_update_model_kwargs_for_generation` (kwargs_update.py)
        self._on_side = False
        self.side_ok = True  # the criteria may run on the side stream (`allow_side`)
        self._pending = None  # the side stream's last event, not yet waited for by the main stream
        self._warned: set[str] = set()
        self.peers = None  # synced_gpus: the deferred all-reduce (peers.py)
        self.last_verdict = None
        self.deferred_check = None  # 5.17+: the DeferredStopCheck instance of this loop (stop_check.py)
        self.cleanups = []  # run once by close(): per-call registrations made elsewhere (static_mask.py)
        self.hooks = None  # module_state.HookWatch of the call's model (`watch_hooks`)
        self.first_layer = None  # the cache's first layer, where it can be reset (`_first_sight`)
        self.last_ids = None  # the `input_ids` transformers' loop handed the criteria at the last step that ran them
        self.why_synchronous = None  # why every verdict is read at once (for `last_path()`), where not the cache
        self.padding = None  # padding_check.PendingChecks: the decode forward's padding checks, run at `join`
        # `input_drops.drop_length`: past this sequence length the model's own input preparation may drop the cache
        # (the next forward refills a new one, which no undone extra step may be): each verdict is then read at once
        self.drops_after, self.why_drops = None, None

    # -- the side stream ---------------------------------------------------------------------------------------
    def allow_side(self, carried: torch.Tensor | None) -> None:
        """Before the first step's criteria: `carried` is the loop's first `unfinished_sequences` (made on the main
        stream, read on the side one, then dropped by stock), or None where it is not known: then the criteria
        stay on the main stream for the whole call (another thread could reuse its memory on the main stream before
        the side stream read it)."""
        if carried is None:
            self.side_ok = False
        elif carried.is_cuda:
            carried.record_stream(self.side)

    def to_side(self, input_ids: torch.Tensor, scores) -> None:
        """Run what follows (criteria, the `unfinished_sequences` update, the verdict copy) on the side stream."""
        if not self.cuda or self._on_side or not self.side_ok:
            return
        self._ready.record(self.main)
        self.side.wait_event(self._ready)
        # made on the main stream, read on the side one: keep the allocator from reusing them too early
        input_ids.record_stream(self.side)
        if isinstance(scores, tuple):
            scores = scores[-1] if scores else None
        if isinstance(scores, torch.Tensor):
            scores.record_stream(self.side)
        torch.cuda.set_stream(self.side)
        self._on_side = True

    def _to_main(self) -> None:
        torch.cuda.set_stream(self.main)
        if self._on_other_device:
            torch.cuda.set_device(self._home)
        self._on_side = False

    # -- the verdict -------------------------------------------------------------------------------------------
    def record(self, verdict: torch.Tensor, tokens: torch.Tensor | None, length: int) -> bool:
        """End of a step: copy its verdict (a device tensor) and tokens to pinned memory; whether to stop now.

        Stops now only where stock stops at this same step without a device read (`max_length`), where the host
        already knows this step is the extra one, or where the verdict has to be read at once.
        """
        if self._on_side:
            # made on the side stream, used next on the main one (`unfinished_sequences`)
            verdict.record_stream(self.main)
        if self.extra:
            if self._on_side:
                self._to_main()
            return True
        slot = self.steps & 1
        if self.peers is not None:
            self.last_verdict = verdict  # the peers' all-reduce reads it at the next loop check
        flag = None if self._flags is None else self._flags[slot]
        if flag is None or flag.shape != verdict.shape or flag.dtype != verdict.dtype:
            self._make_slot(slot, verdict)
        self._flags[slot].copy_(verdict, non_blocking=True)
        if self._tokens is not None and tokens is not None:
            if self._on_side:
                tokens.record_stream(self.side)
            self._tokens[slot].copy_(tokens, non_blocking=True)
        if self.cuda:
            event = self._done[slot]
            if self._on_side:
                event.record(self.side)
                self._to_main()
                if self.steps == 0:
                    # The first update read the loop's initial `unfinished_sequences`, made in the main stream's
                    # pool, which the loop has dropped: the main stream waits here, once, before this thread
                    # allocates on it again. Another thread may allocate on it sooner; `allow_side` marked the
                    # tensor as used by the side stream for that. Later verdicts are made on the side stream (and
                    # `record_stream`ed for the main one).
                    self.main.wait_event(event)
                else:
                    self._pending = event
            else:
                event.record(self.main)
        self.steps += 1
        self.last_length = length
        changed = False
        if self._budget is not None:
            # stock's criterion reads `max_length` at every step: user code may raise or lower it mid-call
            now = self._budget.max_length
            changed, self.max_length = now != self.max_length, now
        if not changed and self.max_length is not None and length >= self.max_length:
            # stopped on the host only where the criterion saw this value: one changed during this step's criteria
            # or processors is left to the criterion's own device verdict (read one step late like any other)
            return True
        if not self.synchronous and self.drops_after is not None and length > self.drops_after:
            self.synchronous, self.why_synchronous = True, self.why_drops  # for the rest of the call
        if not self.synchronous and self.hooks is not None and self.hooks.hooked():
            self.synchronous = True
            self.why_synchronous = self.hooks.why  # a forward hook, or a class-level forward wrapper
        if self.first_layer is not None and not self.first_layer.is_initialized:
            # a callback reset the cache this step: where stock stops here its cache stays reset, and the extra
            # forward would initialise it again (an undo crops, it cannot un-initialise): read this one now
            return self._read(self.steps - 1)
        if self.synchronous or (self.room is not None and self._end_of_cache() + self.steps - 1 >= self.room):
            # no extra step allowed: read this verdict now, as stock does (a fixed-size cache with no room for the
            # next forward's position, a position table without its row, or a returned cache that cannot give one
            # back)
            if not self.synchronous and self.table is not None and self._end_of_cache() + self.steps - 1 >= self.table:
                self.synchronous = True  # every later forward is past the table too
                self.why_synchronous = self.why_table or (
                    f"the model's position table holds {self.table} positions: each verdict is read before a forward "
                    "past it")
            return self._read(self.steps - 1)
        self.rng.snapshot()
        return False

    def watch_input_drops(self, model) -> None:
        """No extra step may be the forward that refills a cache the model's own input preparation dropped (Phi-3's
        rope switch, `input_drops.py`): each verdict is read at once past the length where it may."""
        drops = drop_length(model)
        if drops is not None:
            self.drops_after, self.why_drops = drops

    def follow_max_length(self, criteria) -> None:
        """Read `max_length` from the call's first `MaxLengthCriteria` at every step, as stock's criterion does
        (`StoppingCriteriaList.max_length` names the same one)."""
        from transformers.generation.stopping_criteria import MaxLengthCriteria

        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria):
                self._budget = criterion
                self.max_length = criterion.max_length
                return

    def watch_positions(self, model, input_ids=None, model_kwargs=None) -> None:
        """No forward past a table the model's forward reads by position (position_table.py), counted from the cache:
        known per model, or found from the call's first forward, observed until `_first_sight`. Called right before
        the loop's `try`, whose `close` ends the observation."""
        from ..undo.position_table import PositionWatch

        self.table, self.why_table, self.position_watch = PositionWatch.start(model, input_ids, model_kwargs)
        # `use_cache=False` (MPT's default): each forward runs over the whole sequence, its positions counted from it
        self.cacheless = isinstance(model_kwargs, dict) and model_kwargs.get("use_cache") is False

    def _end_position_watch(self, cache) -> None:
        watch, self.position_watch = self.position_watch, None
        if watch is not None:
            self.table, self.why_table = watch.finish(cache)

    def watch_hooks(self, model) -> None:
        """Read every verdict at once while a forward hook is on `model` (module_state.HookWatch)."""
        from ..undo.module_state import HookWatch

        self.hooks = HookWatch(model)

    def _make_slot(self, slot: int, verdict: torch.Tensor) -> None:
        """The pinned copy for `slot`, shaped as this step's verdict: allocated at the first step, and again where a
        criterion changed the verdict's shape (one answering `(batch, 1)` broadcasts stock's `unfinished_sequences`
        to `(batch, batch)`). The slot's last verdict has been read by now: no copy into the old one is in flight."""
        if self._flags is None:
            self._flags, self._views = [None, None], [None, None]
        flag = self._flags[slot] = torch.empty(verdict.shape, dtype=verdict.dtype, device="cpu", pin_memory=self.cuda)
        self._views[slot] = flag.numpy()

    def join(self) -> bool:
        """At a step's logits processors: the main stream waits for the previous step's side-stream work, and the
        host reads the previous step's verdict. True: the flag-off run stopped there, this step is the extra one."""
        if self.position_watch is not None:
            self._end_position_watch(None)  # no processor or criterion runs under the watch, cache seen or not
        self.wait_pending()
        if self.read < self.steps and self._read(self.steps - 1, in_join=True):
            self.extra = True
        if self.padding is not None:
            self.padding.settle(self.extra)  # the forward just queued warns as stock's, unless it is the extra one
        return self.extra

    def wait_pending(self) -> None:
        """The main stream waits (on the device, the host does not) for the side stream's last step."""
        if self._pending is not None:
            self.main.wait_event(self._pending)
            self._pending = None

    def _read(self, step: int, in_join: bool = False) -> bool:
        """Wait for `step`'s copies, stream its tokens, and return whether its verdict says "all finished".
        `in_join`: read at the next step's processors, after that step's forward was queued."""
        slot = step & 1
        if self.cuda:
            self._done[slot].synchronize()  # the run-ahead is bounded here, to about one step
        self.read = step + 1
        if self._tokens is not None:
            try:
                self.streamer.put(self._tokens[slot].clone())
            except BaseException:
                # stock streams these tokens at the end of their own step: if the streamer raises, the next
                # step's forward has already run here, and is undone like an extra step (`abort`)
                self.overran = in_join
                raise
        view = self._views[slot]
        if view.ndim > 1 and self._done_when == "unfinished":
            return not view.any()  # a broadcast `(batch, batch)` verdict: stock stops when all of it is 0 (`max() == 0`)
        value = view.tolist()  # a Python int or list: cheaper to test than a numpy reduction
        if self._done_when == "unfinished":
            return not any(value)
        if self._done_when == "finished":
            return bool(value)
        return not value  # "running"

    def see_cache(self, cache) -> None:
        """The loop's cache, once it exists (after prefill): the room it has, and whether it can give a step back."""
        if not self._first_sight(cache):
            return
        if self.cache_returned and not self.synchronous and self.steps == 0:
            reason = cache_blocks_deferral(cache, self.loop_undoes_steps)
            if reason is not None:
                self.synchronous = True
                warn_stock(reason)

    def _first_sight(self, cache) -> bool:
        """Note the cache's room the first time it is seen (after the prefill); whether this was the first time."""
        if self.position_watch is not None:
            self._end_position_watch(cache)  # the first forward has run: what it read is known
        if self.cacheless and cache is None and self.table is not None and not self.cache_seen:
            # no cache: the next forward's last position is the sequence's length so far (the prompt's, plus a step)
            self.cache_seen = True
            self.room, self._cache_end = self.table, self.last_length
            return True
        if self.cache_seen or cache is None:
            return False
        self.cache_seen = True
        layers = getattr(cache, "layers", None)
        if isinstance(layers, list) and layers and isinstance(getattr(layers[0], "is_initialized", None), bool):
            self.first_layer = layers[0]
        room = fixed = capacity(cache)
        if self.table is not None:
            room = self.table if room is None else min(room, self.table)
        if room is None:
            return True
        end = cache_end(cache, self.next_position)
        if end is None and fixed is None:
            end = _grown_length(cache)  # a growing cache: the positions it holds after the prefill
        if end is None:
            # nowhere to tell how full it is: never risk a forward past its end
            self.synchronous = True
            if fixed is None:
                self.why_synchronous = ("the model has a position table and the cache does not tell how "
                                        "many positions it holds")
        elif isinstance(end, int) or not self.cuda:
            self.room, self._cache_end = room, int(end)  # a host value or a CPU tensor: reading costs nothing
        else:
            # copied now, in stream order after the prefill; read at the first step's end, by which time the host
            # has queued that step's work behind the prefill (no idle device)
            pinned = torch.empty(1, dtype=torch.long, device="cpu", pin_memory=True)
            pinned.copy_(end, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.room, self._cache_end_copy = room, (pinned, event)
        return True

    def cache_end(self) -> int | None:
        """Where the first decode step's forward writes, on the host (None where the cache grows, or is not known)."""
        if self._cache_end is None and self._cache_end_copy is None:
            return None
        return self._end_of_cache()

    def _end_of_cache(self) -> int:
        """Where the first decode step's forward writes (positions the cache held after the prefill)."""
        if self._cache_end is None:
            pinned, event = self._cache_end_copy
            event.synchronize()
            self._cache_end, self._cache_end_copy = int(pinned[0]), None
        return self._cache_end

    def finish(self) -> int:
        """After the loop: drain the copies, stream what is left, return how many steps (0 or 1) to undo, and give
        back the extra step's random draws."""
        self.close()
        if self.peers is not None:
            self.peers.drain()
        if self.read < self.steps and not self.extra:
            self._read(self.steps - 1)  # the last step's tokens (stopped at max_length)
        if self.cuda:
            for event in self._done:
                event.synchronize()
        if self.extra:
            self.rng.restore()
        return 1 if self.extra else 0

    def abort(self) -> None:
        """An exception left the loop: stream the tokens stock had streamed before it, give back the random draws
        of a step stock never reached, leave the streams as found; the loop's stop check (5.17+) first leaves a
        returned cache as stock leaves it."""
        if self.deferred_check is not None:
            self.deferred_check.abort()
        self.close()
        final = False
        pending = self.padding is not None and bool(self.padding.items)
        if self.read < self.steps and not self.extra and (self._tokens is not None or pending):
            final = self._read(self.steps - 1)
        if pending:
            # the forward that raised after its padding check: stock warned there, if it runs that forward at all
            self.padding.settle(self.extra or self.overran or final)
        if self.overran:
            self.rng.restore()

    def close(self) -> None:
        """Leave the streams as found, also after an exception inside the loop; undo per-call registrations."""
        while self.cleanups:
            self.cleanups.pop()()
        if self.position_watch is not None:
            self.position_watch.stop()  # a loop left before its first forward's cache was seen
            self.position_watch = None
        self.deferred_check = None  # it points back here: no cycle may keep the pinned buffers alive
        if self.cuda:
            if self._on_side:
                self._to_main()
            self._pending = None
            self.main.wait_stream(self.side)

    def extra_position(self):
        """The cache position the extra step's forward wrote, for layers that write where `cache_position` says
        (a one-element device tensor: the first decode step's position plus one per step after it), or None. Layers
        with their own counter need none (`cache_rollback.rollback_one_step`)."""
        first = self.next_position
        if isinstance(first, torch.Tensor) and first.numel() == 1:
            return first + (self.steps - 1)
        return None

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
