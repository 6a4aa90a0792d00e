"""Everything a static-cache decode step does on the device after the forward, as one body: eager or replayed.

Copied from transformers v5.17.0-v5.24.0 `GenerationMixin._sample` (the part of the loop body between the logits
copy and `stop_check`) and `EosTokenCriteria.__call__`. Differences, same values:
- where every processor is capturable (`LoopPlan.pure`), the logits land in one fixed fp32 buffer and processors see a
  view of the sequence buffer (stock: a new tensor each step). Where one is not, each step gets a fresh logits tensor
  and a fresh contiguous copy of the sequence, as in stock; an in-place edit of that copy by a processor (or by a
  criterion, through `sequence`/`settle`) is written back into the sequence buffer, since in stock it *is* the
  sequence the next step appends to;
- the new token is written into a preallocated sequence at a device-side length (stock: `torch.cat`); processors
  that read the sequence run in a form that reads this buffer or keeps a device state (`processors/forms.py`);
- an exact `EosTokenCriteria` compares the new token with the EOS ids (stock: `isin` on `input_ids[:, -1]`, the
  same token), updating `unfinished_sequences` in place;
- the next step's inputs are advanced in place (`inputs.StepInputs`).

On CUDA, when every processor is graph-safe (`eligibility.py`), the body runs eagerly the first time a phase is seen
(a phase: the host decisions that can change with the length, such as the minimum-length processors'), is captured
into a CUDA graph the second time and replayed from then on. A captured graph bakes in the processors' Python
settings: before every capture and replay each captured processor's guard (`processors.AttrGuard`, or the one
`purity.guard_for` gave) is checked, and if one reports a change the rest of the call runs eagerly, calling the
processors as stock does. Sampling draws from the device's default generator,
which CUDA graphs advance exactly as the eager ops do. The graphs, their memory pool and the buffers belong to one
call: nothing outlives it.
"""

from __future__ import annotations

import warnings

import torch

from ...graphs.backend import capture


def _is_user(processor) -> bool:
    """Whether a processor is user code (it may edit `input_ids` in place); the package's forms and transformers'
    own processors (exact types) never do."""
    from ...control.step_lists import _EosMask
    from .processors import forms

    if isinstance(processor, (_EosMask, forms._Form)):
        return False
    return not type(processor).__module__.startswith("transformers.")


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
        # per exact `EosTokenCriteria`: (its ids tensor, shape, data pointer). The body reads that very tensor (eager or
        # replayed): stock's criterion reads `eos_token_id` at every call, so an in-place edit by other user code counts
        # from the next step; a rebound or resized one is picked up by `_follow_eos` (a copy would keep the old ids)
        self.eos = None
        if plan.eos:
            self.eos = [self._eos_of(criterion) for criterion in plan.eos]
        self.inputs = None  # the loop's `StepInputs`, once the first decode step's inputs are known
        self.capture = plan.capture
        self.graphs: dict = {}
        self.outputs: dict = {}  # per phase: the graph's processed-scores tensor (rewritten by each replay)
        self.seen: set = set()
        self.pool = None
        self.processors = plan.processors  # stock's own processors instead, once a guard failed (`_go_eager`)
        self.forms = plan.forms
        for form in self.forms:
            form.bind(self)
        self.started = False
        self.guards = None  # made at the first capture (`_guards_hold`)
        # a new logits tensor and sequence copy per step, as stock hands them out, while a processor may keep or edit
        # them: one not capturable, or one `purity` has yet to observe
        self.fresh = not plan.pure or bool(plan.observed)
        self.pending = plan.observed  # (index, purity guard): observed on their real call at the first step
        self.held = None  # (tensor, length): the sequence as user code last got it (`sequence`)
        # per processor: user code, which may edit the ids it is handed (built-ins never do)
        self.user = [_is_user(p) for p in plan.processors]
        self.left = None  # why the tail left its plan mid-call (`last_path()`)

    def load(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's last-position logits into the fixed fp32 buffer (eager: the forward's output moves), or, where a
        processor is not capturable, into a new tensor as stock makes it (a processor may keep or edit it)."""
        if self.fresh:
            self.logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=self.seq.device)
            return self.logits
        last = logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty(last.shape, dtype=torch.float32, device=self.seq.device)
        self.logits.copy_(last)
        return self.logits

    def run(self, length: int, advance: bool) -> torch.Tensor:
        """One step's processors, token, EOS check, sequence write and (`advance`) next inputs; the processed scores.
        `length`: the sequence length before this step's token (what stock's processors see)."""
        if not self.started:
            self._start(length)
        if self.eos is not None:
            self._follow_eos()
        key = (self.plan.phase(length), advance)
        if self.capture:
            graph = self.graphs.get(key)
            if graph is not None or key in self.seen:
                if not self._guards_hold():
                    self._go_eager()
                elif graph is not None:
                    graph.replay()
                    return self.outputs[key]
                else:
                    scores = self._capture(key, length, advance)
                    if scores is not None:
                        return scores
        self.seen.add(key)
        if self.pending:
            return self._observe(length, advance)
        if self.fresh:  # user code may keep, read or edit the sequence: hand out stock's kind of tensor
            return self._body(self.sequence(length), advance, watch=True)
        return self._body(self.seq[:, :length], advance)

    def _observe(self, length: int, advance: bool) -> torch.Tensor:
        """The call's first step, where each processor `purity` is to judge runs through `guard.observe` (its real
        call: same arguments, result and side effects). Proven pure, the rest of the call uses the fixed buffers and
        may capture; otherwise it stays as stock hands tensors out, and eager."""
        pending, self.pending = self.pending, ()
        processors = list(self.plan.processors)
        for index, guard in pending:
            processors[index] = guard.observe
        self.processors = processors
        try:
            scores = self._body(self.sequence(length), advance, watch=True)
        finally:
            self.processors = self.plan.processors
        if not all(guard.capturable is True for _, guard in pending):
            self.capture = False
        elif self.plan.pure:
            self.fresh = False
            self.logits = None  # the next step's logits go to a new fixed buffer, not the tensor this step handed out
        return scores

    def _eos_of(self, criterion) -> torch.Tensor:
        # stock's `EosTokenCriteria.__call__` moves its ids to the sequence's device (the same object where they are)
        criterion.eos_token_id = ids = criterion.eos_token_id.to(self.seq.device)
        return ids, ids.shape, ids.data_ptr()

    def _follow_eos(self) -> None:
        """Before each step: a criterion's `eos_token_id` rebound to another tensor (by a criterion, a streamer) is
        the one this step compares with, as in stock. One identity check per criterion on the host. The graphs read
        the old tensor's memory: the rest of the call runs eagerly."""
        for index, criterion in enumerate(self.plan.eos):
            ids, (was, shape, where) = criterion.eos_token_id, self.eos[index]
            if ids is not was or ids.shape != shape or ids.data_ptr() != where:  # rebound, or resized in place
                self.eos[index] = self._eos_of(criterion)
                if self.graphs:
                    self._go_eager()
                    self.left = "an EosTokenCriteria's eos_token_id was rebound mid-call: eager tail from then on"

    def _start(self, length: int) -> None:
        self.started = True
        pad = self.pad if self.plan.has_eos else None
        for form in self.forms:
            form.start(self.seq, length, self.logits.shape[-1], pad)

    def _guards_hold(self) -> bool:
        """Whether the captured processors' settings are still the ones the graphs baked in (made at the first
        capture: from then on a change sends the call eager)."""
        if self.guards is None:
            if not all(form.capturable for form in self.forms):
                return False
            self.guards = [make() for make in self.plan.guards]
            return all(guard is not None for guard in self.guards)
        for guard in self.guards:
            if not guard.unchanged():
                return False
        return True

    def _go_eager(self) -> None:
        """A captured processor changed mid-call: no replay from now on; the rest of the call calls the processors
        (the minimum-length ones as stock's own, which read their settings each step)."""
        from ...control.step_lists import _EosMask

        self.capture = False
        self.processors = [p.processor if isinstance(p, _EosMask) else p for p in self.plan.processors]
        if self.graphs:
            self.left = "a captured processor changed mid-call: eager tail from then on"

    def keep(self, scores, logits, want_scores: bool, want_logits: bool):
        """The step's processed scores and raw logits as the call returns them: stock's own tensors, sharing what
        they share in stock (with no processor, or one returning its input or a view of it, the scores *are* the
        logits or a view of them). Fresh tensors are kept as they are; the fixed buffers are copied (a replay
        rewrites them), the scores as the same view of the logits' copy where they were one."""
        if self.fresh or not (want_scores or want_logits):
            return scores, logits
        shares = want_logits and want_scores and (
            scores is logits or scores.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr())
        kept_logits = logits.clone() if want_logits else None
        if not shares:
            return (scores.clone() if want_scores else None), kept_logits
        if scores is logits:
            return kept_logits, kept_logits
        return kept_logits.as_strided(scores.size(), scores.stride(), scores.storage_offset()), kept_logits

    def fold(self, is_done: torch.Tensor) -> None:
        """`unfinished & ~is_done`, as stock computes it. In place where the shape stays (every call but a
        criterion's odd answer); a verdict that broadcasts to another shape (a criterion answering (batch, 1)) is
        stock's new `unfinished_sequences`, which the rest of the call uses as stock does, eagerly."""
        if is_done.shape == self.unfinished.shape:
            self.unfinished.bitwise_and_(~is_done)
            return
        merged = self.unfinished & ~is_done
        if merged.shape == self.unfinished.shape and merged.dtype == self.unfinished.dtype:
            self.unfinished.copy_(merged)
            return
        self.unfinished = merged  # the graphs captured the old tensor: no replay from now on
        self._go_eager()
        self.left = "a criterion's verdict changed the shape of unfinished_sequences: eager tail from then on"

    def verdict(self) -> torch.Tensor:
        """The per-row verdict for the stop check: `unfinished_sequences` itself, or, where a criterion broadcast it
        to another shape, one value per row that is all zeros exactly when it is (stock: `max() == 0`)."""
        unfinished = self.unfinished
        rows = self.tokens.shape[0]
        if unfinished.shape == (rows,):
            return unfinished
        return unfinished.reshape(-1).amax(0, keepdim=True).expand(rows)

    def sequence(self, length: int) -> torch.Tensor:
        """The sequence of `length` tokens as stock hands it to user code: a fresh contiguous tensor, the same one for
        a step's criteria and the next step's processors (stock's `input_ids` between two `torch.cat`s)."""
        held = self.held
        if held is not None and held[1] == length:
            return held[0]
        ids = self.seq[:, :length].clone(memory_format=torch.contiguous_format)
        self.held = (ids, length)
        return ids

    def settle(self, length: int) -> None:
        """After user code ran on `sequence(length)`: whatever it wrote into that tensor lands in the sequence buffer,
        the device states made from it and the next forward's input token, as it does in stock (where it is the
        sequence). Copied back unconditionally, on the device: no host read tells whether it was edited (a tensor's
        version counter is private, and raises for inference tensors), and the copy is one small kernel."""
        held = self.held
        if held is None or held[1] != length:
            return  # not handed out at this length: the sequence buffer is the only copy
        self.seq[:, :length].copy_(held[0])
        for form in self.forms:
            form.rebuild(length)
        if self.inputs is not None:
            self.inputs.ids.copy_(self.seq[:, length - 1:length])

    def _body(self, input_ids: torch.Tensor, advance: bool, watch: bool = False) -> torch.Tensor:
        plan = self.plan
        scores = self.logits
        for processor, user in zip(self.processors, self.user):
            scores = processor(input_ids, scores)
            if watch and user:
                self.settle(input_ids.shape[1])
        if plan.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if plan.has_eos:
            next_tokens = next_tokens * self.unfinished + self.pad * (1 - self.unfinished)
            if next_tokens.shape != self.tokens.shape:  # a broadcast `unfinished` (`fold`): stock's cat raises
                torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        self.tokens.copy_(next_tokens)
        self.seq.index_copy_(1, self.length, next_tokens[:, None])
        for form in self.forms:  # before the length moves on: `self.length` is the token's position
            form.after_token(next_tokens, self.length)
        self.length.add_(1)
        if self.eos is not None:
            rows = next_tokens.shape[0]
            for eos, _, _ in self.eos:  # stock: `isin(input_ids[:, -1], eos_token_id)`, whatever the ids' shape
                hit = (next_tokens.reshape(rows, *([1] * eos.dim())) == eos).reshape(rows, -1).any(-1)
                self.unfinished.bitwise_and_(~hit)
        if advance:
            self.inputs.advance(next_tokens)
        return scores

    def _capture(self, key, length: int, advance: bool):
        """Capture the body for `key` and replay it once (this step); None if it was not captured (then this step runs
        eagerly; after a failed capture, every step of this call does).

        Whatever happens inside the capture, nothing global is left behind: a capture that fails, or is interrupted,
        leaves the device's random generator as it found it (`_heal_generator`), so this step's eager run draws what
        stock draws, and so does every later random op in the process."""
        try:
            made = capture(self.seq.device, self.pool, lambda: self._body(self.seq[:, :length], advance))
        except Exception as error:  # KeyboardInterrupt, SystemExit propagate (after the generator is healed)
            # a processor declared graph-safe that is not: run eagerly from now on
            self.capture = False
            warnings.warn(f"async_stopping_criteria=True: the decode step could not be captured into a CUDA "
                          f"graph ({type(error).__name__}: {error}); it runs eagerly for the rest of this call "
                          "(identical output).", UserWarning, stacklevel=4)
            return None
        if made is None:
            return None  # another thread is inside generate(): eager this step, try again at the next
        graph, scores = made
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
