"""The per-call forward of the dynamic-cache loop that replays a model's recorded pieces.

Per step, before any replay, it checks what a replay would otherwise get wrong, and runs the eager forward (the
model's own) where it cannot replay:
- the step's inputs: only `input_ids` / `position_ids` (one column), the cache (`past_key_values` up to 5.23,
  `cache` from 5.24: `cache_kwarg.py`), `use_cache`, `logits_to_keep`,
  `return_dict`, and a mask of a kind a replay can give the attention as stock's forward would (`mask_kind.py`):
  known on the host (SDPA, one token), answered on the host per recorded mask call (sliding-window layers, no
  padding), or made again by stock's mask functions from the step's own mask (K > 1 tokens, a padded batch, any
  other attention implementation);
- staleness (`staleness.py`): a module, parameter or buffer replaced, its storage moved (`.to()`, `.data =`, a dtype
  change) or its shape or stride changed on the same storage, a plain attribute of a module or a config rebound (a
  norm's epsilon, an attention's scaling) or a config's list or dict edited in place: the model's recordings are
  dropped and the step records again; a hook or a wrapped forward added, training mode, an attention or mask
  function that is not transformers' own: the rest of the call runs eagerly. The attention implementation is part of
  the key: one set mid-call records under it (the model proven again);
- threads: while another thread is inside `generate()`, the step runs eagerly (the graphs and their buffers serve one
  forward at a time);
- default-deny: the model is proven (`proof/`) before each recording, and every module's class is compared before
  each replay (a class swapped mid-call makes the recordings stale, and the model is proven again);
- the key of the recording (batch size, dtypes, device, mask kind, `logits_to_keep`, every torch setting a captured
  kernel was chosen under: `settings.py`): a new key records once (at most `MAX_KEYS` per model, least recently used out).
A family whose base forward starts with `warn_if_padding_and_no_attention_mask` (GPT-2: without a mask it checks the
step's ids for the pad token and warns once) has that check run before each replay, as its forward runs it.
Recordings are kept per model (`staleness.graphs_of`) and freed with it.

Roles: "decode" (the dynamic-cache loop's one-token steps), "draft" (an assistant's steps inside assisted decoding,
batch 1: its one-token steps and the two-token prefill of each round) and "verify" (assisted decoding's target
forward of K = candidates + 1 tokens, batch 1, which returns a copy of the logits: stock's loop writes into them and
returns them as scores). A forward of K > 1 tokens (`steps.wide_mask`) is recorded at the second sighting of its key
(the clipped last round's odd width stays eager), at most `MAX_WIDE` such recordings per model, the least replayed
dropped first.
"""

from __future__ import annotations

import sys

import torch

from ...release_checks import cache_kwarg
from . import proof, steps
from .graphs import CaptureFailed, NotRecordable, record
from .staleness import ModelGraphs, graphs_of  # noqa: F401 (the per-model store: `forward.graphs_of`)
from .step_inputs import StepInputs

MAX_KEYS = 4  # one-token recordings per model (batch sizes, mask kinds...): least recently used dropped beyond
MAX_WIDE = 8  # K-token recordings per model (verify widths, the draft's prefill): least replayed dropped beyond
ROLES = ("decode", "draft", "verify")
class PiecewiseForward(StepInputs):
    """`model_forward` for one call of the dynamic-cache loop (see the module docstring)."""

    def __init__(self, model, model_forward, report, role="decode", watched=None):
        if role not in ROLES:
            raise ValueError(f"role={role!r}: one of {ROLES}")
        self.model, self.eager, self.report = model, model_forward, report
        self.role = role
        self.draft = role == "draft"  # an assistant's draft loop (batch 1)
        self.wide = role != "decode"  # takes forwards of K > 1 tokens (batch 1)
        self.graphs = graphs_of(model)
        self.family = proof.family_of(model)
        if watched is not None:
            # the set an earlier call made of this model, whose snapshot the caller just found unchanged
            # (`forward_for`): the same modules, tables and names (a change since is one `changed` finds)
            self.unbound, self.watching = watched, watched.bind(model)
        else:
            self._watch()
        self.device = model.get_input_embeddings().weight.device
        self.off = None  # why the rest of the call runs eagerly
        # key -> why its recording failed in this call: tried again at a later call once what it ran changed, not in
        # this one (a model whose own eager steps change what it ran would record again at every step)
        self.failed_here: dict = {}
        self.stale = 0  # steps of this call that found the model's snapshot changed
        self.replayed = self.eager_steps = 0
        self.last_eager = None
        self.impl = None  # the attention implementation of the step (`_step`)
        # a one-token step handed a padded 2D mask is recorded with its masks made at each replay by stock's
        # functions (as another implementation's are); off where the loop hands a grown 4D mask from the first decode
        # step on (`dynamic_loop/wide_mask.py`): a step handed the 2D mask again there (a callback changed what the
        # grown mask relies on) stays eager, and no batch size takes two recordings
        self.remakes_padded = True
        # the decoder of an encoder-decoder model (Whisper's: `family.Family.cross_attention`)
        self.encoder_decoder = self.family is not None and self.family.cross_attention is not None
        self.step_length = None  # an encoder-decoder step's: the self-attention cache's host length (`_step`)

    def _watch(self) -> None:
        """The per-step checks' set, from the model as it is now (again after a change was found and the model proven
        again: a module added mid-call is watched from then on), kept with the model's recordings for its next call."""
        self.unbound = proof.WatchSet(self.model, self.family)
        self.graphs.watched = self.unbound
        self.watching = self.unbound.bind(self.model)

    @property
    def modules(self):
        return self.watching.modules

    @property
    def embeddings(self):
        return self.watching.embeddings

    def __call__(self, **inputs):
        # every step compares the model with its recordings' snapshot in full: user code can run between two steps
        # from places the call's processors and criteria do not show (a rebound torch function they call, a value of
        # a user type they hold, a finalizer, another thread; tests/test_changes_between_steps_seen.py)
        if self.off is None:
            why = self.watching.why_eager()
            if why is not None:
                self.off = why
        if self.off is not None:
            return self._eager(self.off, inputs)
        if not steps.alone():
            # a model's graphs and their fixed buffers serve one forward at a time: while another thread is inside
            # generate() (it may use this model), neither thread replays (a thread that entered later sees this one)
            return self._eager("another thread is inside generate()", inputs)
        mask, key, why = self._step(inputs)
        if why is not None:
            return self._eager(why, inputs)
        if self.family.checks_padding and inputs.get("attention_mask") is None:
            # GPT-2's base forward starts with this check of the step's ids (a log where they hold the pad token):
            # a replay skips the forward's Python, and the recording's 4D sentinel mask makes it return at once
            proof.base_of(self.model).warn_if_padding_and_no_attention_mask(inputs["input_ids"], None)
        graphs = self.graphs
        if (graphs.recordings or graphs.failed or graphs.first_runs) and graphs.changed():
            self.stale += 1
            if self.stale > 2:
                # the model changes at every step (a processor setting a config field, a schedule): recording again
                # at each would cost a capture and a proof per step and never replay (red team of the proof pipeline,
                # hole 8)
                self.off = f"the model changed at {self.stale} steps of this call (the rest of it runs eagerly)"
                return self._eager(self.off, inputs)
            # weights replaced or moved, an attribute rebound, code changed: every recording of this model is stale,
            # and a recording that failed is tried again (what made it fail may be what changed: issue 43, retry)
            graphs.clear()
            graphs.first_runs.clear()
            # what changed may be a decision the call's eligibility made once (a config's `sliding_window` set by a
            # criterion): decided again before anything is recorded
            why = proof.why_not_model(self.model, self.eager)
            if why is not None:
                self.off = why
                return self._eager(why, inputs)
            self._watch()
        recording = graphs.recordings.get(key)
        if recording is not None:
            graphs.recordings.move_to_end(key)
            if self.encoder_decoder:
                return self._replayed(recording.replay(cache_kwarg.get(inputs), inputs["decoder_input_ids"],
                                                       self.step_length, mask,
                                                       proof.handover.attention_function(self.modules, self.impl),
                                                       self.modules, encoder_outputs=inputs["encoder_outputs"],
                                                       encoder_mask=inputs.get("attention_mask")))
            return self._replayed(recording.replay(cache_kwarg.get(inputs), inputs["input_ids"],
                                                   inputs["position_ids"], mask,
                                                   proof.handover.attention_function(self.modules, self.impl),
                                                   self.modules,
                                                   fresh_logits=self.role == "verify"))
        failed = graphs.failed.get(key) or self.failed_here.get(key)
        if failed is not None:
            return self._eager(failed, inputs)
        width = key[1]
        if width > 1 and graphs.sighting(key) < 2:
            # a width seen once may never come back (the last round clipped by the length, an EOS among the
            # candidates): it is recorded when it does
            return self._eager(f"width {width} seen once", inputs)
        return self._record(key, mask, inputs)

    def _record(self, key, mask, inputs):
        # a recording bakes in whatever Python runs now: the model is proven again as it is at this step (a class
        # swapped or a module added since the call's start, before any recording could notice, is refused here)
        why = proof.why_not_model(self.model, self.eager)  # stage 1
        if why is not None:
            self.off = why
            return self._eager(why, inputs)
        self._watch()
        key = key[:-1] + (self.embeddings.weight.dtype,)  # the embedding module as watched now (`_watch`)
        graphs = self.graphs
        if not graphs.recordings and not graphs.failed and not graphs.first_runs:
            # the state every recording of the model is made from (stage 4's snapshot), taken before the first one
            # (and after a change cleared them all)
            graphs.clear()
            graphs.watched = self.unbound
            proof.hand_over(graphs, self.model, self.unbound)
        why = graphs.code.unreadable
        if why is not None:
            return self._eager(self._failed(key, f"not proven: {why}"), inputs)
        forward_inputs = {name: value for name, value in inputs.items() if name != "return_dict"}
        forward_inputs["return_dict"] = True
        positions = position_table = cross_mask_module = None
        if self.encoder_decoder:
            # stock's decoder makes these itself from the same host length (`arange(n) + cache_length`); handed to it
            # (Whisper's, repeated over the batch), or to its position table's call (BART's, whose forward takes
            # none), the length it reads reaches no output (`targets/piecewise_rows.py`, whisper, bart). T5's decoder
            # takes none (its position bias is made again at each replay: `attention.Cut.bias`)
            ids = inputs["decoder_input_ids"]
            made = torch.arange(ids.shape[1], device=ids.device) + self.step_length
            if self.family.decoder_positions:
                forward_inputs["decoder_position_ids"] = made.unsqueeze(0).repeat(ids.shape[0], 1)
            elif self.family.position_table is not None:
                positions, position_table = made, self.model.get_submodule(self.family.position_table)
            cross_mask_module = sys.modules[self.family.module]
        # K tokens, one with sliding-window layers or another implementation than SDPA (key[5]): the module's mask
        # calls are recorded (`masks.py`)
        mask_module = sys.modules[self.family.module] if key[1] > 1 or type(key[5]) is tuple else None
        watch, why = proof.watch_for(self.family)  # stage 2
        if why is not None:
            return self._eager(why, inputs)
        # the memory pool of the recordings kept, shared by a new one (replayed in any order: their outputs are
        # copied or consumed before another replay, `Recording.output`); with none kept its graphs are gone, and CUDA
        # has released the pool (a capture into it asserts): a new one then
        pool = graphs.pool if graphs.recordings else None
        try:
            made = record(self.model, self.eager, forward_inputs, cache_kwarg.get(inputs), self.modules, mask,
                          self.impl, pool, mask_module, watch=watch,
                          host_masks=type(key[5]) is tuple and key[5][0] == "sliding",
                          encoder_decoder=self.encoder_decoder, positions=positions, position_table=position_table,
                          cross_mask_module=cross_mask_module)
        except NotRecordable as error:
            graphs.sizes = list(map(len, graphs.dicts))  # what transformers' forward set on its modules meanwhile
            return self._eager(self._failed(key, f"not recordable: {error}"), inputs)
        except CaptureFailed as error:
            graphs.sizes = list(map(len, graphs.dicts))
            # a capture the device refused (a host read inside the forward, say); any other exception is the model's
            # or the user's, which `record` lets through: stock's forward raises it here too
            return self._eager(self._failed(key, f"capture failed ({error})"), inputs)
        if made is None:
            return self._eager("another thread is inside generate()", inputs)
        recording, outputs = made
        graphs.pool = recording.pool
        graphs.sizes = list(map(len, graphs.dicts))  # what transformers' own forward set on its modules while recorded
        if self.role == "verify":
            # the logits are in the pool's memory, which a replay of any recording captured before this one may
            # overwrite (CUDA's allocator hands a later capture what an earlier one freed), kept or not: stock's loop
            # keeps them as the round's scores, so the caller gets its own copy, as from every replay (issue 43,
            # item 1: the recording not kept below returned its buffer, and the next round's replay overwrote it)
            outputs = recording.output(cache_kwarg.get(inputs), fresh_logits=True)
        if watch is not None:
            # the position the recording ran at (the cache's length before this step: a host int): a confirmation
            # must come from another one (a second call with the same prompt records at the same position)
            position = cache_kwarg.get(inputs).get_seq_length() - key[1]
            why = self._unproven(key, watch, position)  # stage 3, and stage 4's additions
            if why is not None:
                # the step's outputs are the forward's own (its kernels ran once, as eagerly): the recording is not kept
                self.eager_steps += 1
                self.last_eager = why
                self._note()
                return outputs
        graphs.recordings[key] = recording
        _evict(graphs.recordings, key)
        return self._replayed(outputs)

    def _unproven(self, key, watch, position) -> str | None:
        """Why the recording just made is not kept (None: it is). A recording that ran a function proven only by the
        rules is kept once a second one, at a later position, ran the same ops (the first's are remembered meanwhile).
        What the run looked up by name is watched from now on, kept or not: a change to it tries a failed proof
        again."""
        graphs = self.graphs
        verdict = proof.judge_recording(watch, self.family)
        graphs.watch(verdict.names, verdict.registries, verdict.functions)
        if verdict.why is not None:
            return self._failed(key, f"not proven: {verdict.why}")
        why = graphs.code.unreadable
        if why is not None:
            return self._failed(key, f"not proven: {why}")
        if not verdict.checked:
            return None
        first = graphs.first_runs.get(key)
        if first is None or first[0] == position:
            # the first recording of the key, or one at the very position of the first: a decision that moves with
            # the position would look the same (red team of the proof pipeline; tests/test_found_family_recordings)
            graphs.first_runs[key] = (position, watch.ops)
            while len(graphs.first_runs) > MAX_KEYS + MAX_WIDE:
                del graphs.first_runs[next(iter(graphs.first_runs))]
            return f"recorded once, to be confirmed at the next position ({len(verdict.checked)} functions checked)"
        del graphs.first_runs[key]
        difference = proof.first_difference(first[1], watch.ops)
        if difference is not None:
            return self._failed(key, f"not proven: two positions ran different ops: {difference}")
        return None

    def _failed(self, key, why: str) -> str:
        """Remember why `key`'s recording failed: in the model's store, until what the model's snapshot holds changes
        (the next step that finds it changed tries again: a registry restored, an experts implementation switched
        back), and for the rest of this call."""
        self.failed_here[key] = why
        return _remember(self.graphs.failed, key, why)

    def _replayed(self, outputs):
        self.replayed += 1
        self._note()
        return outputs

    def _eager(self, why, inputs):
        self.eager_steps += 1
        if why != self.last_eager or self.replayed:  # with replays the note counts the eager steps: kept current
            self.last_eager = why
            self._note()
        return self.eager(**inputs)

    def _note(self) -> None:
        report = self.report
        if report is None:
            return
        if self.replayed:
            # one piece between two attentions; with a derivation (`attention.Cut.derive`) one more per layer, between
            # its cache update and the derivation
            cut, _ = proof.attention.cut_of(type(self.modules[0]))
            pieces = len(self.modules) * (2 if cut is not None and cut.derive is not None else 1) + 1
            tail = f"; {self.eager_steps} eager: {self.last_eager}" if self.eager_steps else ""
            steps = "rounds" if self.role == "verify" else "decode steps"
            text = f"graphed ({pieces} pieces): {self.replayed} {steps}{tail}"
        else:
            text = f"eager: {self.last_eager}"
        tell(report, self.role, text)

def tell(report, role: str, text: str) -> None:
    """Write a forward's path into the call's report: the verify forward's in `verify`, the others' in `forward` (a
    draft's prefixed "draft ")."""
    if role == "verify":
        report.verify = text
    else:
        report.forward = f"draft {text}" if role == "draft" else text


def _remember(failed: dict, key, why: str) -> str:
    """Remember why `key`'s recording failed, for at most `MAX_KEYS + MAX_WIDE` keys (the oldest forgotten: tried
    again once)."""
    failed[key] = why
    while len(failed) > MAX_KEYS + MAX_WIDE:
        del failed[next(iter(failed))]
    return why


def _evict(recordings, made) -> None:
    """Drop recordings beyond the caps after `made` was recorded: one-token keys least recently used first
    (`MAX_KEYS`); K-token keys (`MAX_WIDE`) least replayed first, the least recently used of those on a tie, never the
    one just made (it has had no replay yet: dropping it would record it again at every sighting, red team hole 2).
    Each eviction halves the others' counts first, so widths an earlier call used often give way to the ones in use
    now (a "heuristic" schedule drifts across calls)."""
    narrow = [key for key in recordings if key[1] == 1]
    while len(narrow) > MAX_KEYS:
        del recordings[narrow.pop(0)]
    if made[1] == 1:
        return
    wide = [key for key in recordings if key[1] != 1 and key != made]
    if len(wide) >= MAX_WIDE:
        for key in wide:
            recordings[key].uses //= 2
    while len(wide) >= MAX_WIDE:
        least = min(wide, key=lambda key: recordings[key].uses)  # `min` keeps the first (least recent) on a tie
        wide.remove(least)
        del recordings[least]
