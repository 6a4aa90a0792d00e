"""The draft model's loop inside a deferred assisted call: no blocking read per drafted token, none at its end.

`AssistedCandidateGenerator` drafts by calling the assistant's own `generate()` every round. Stock, that call reads
the device about ten times: its stop flag after every drafted token, `ConfidenceCriteria`'s `.item()` after every
drafted token, and, once per call, the special-token tensors (three blocking H2D copies and two reads), 5.23's
encoder-ids check and 5.18+'s "is the mask all ones" check. Inside a deferred assisted call (and only there: the
candidate generator's `_generate_candidates` sets `CallState.drafting` around the assistant's `generate()`, whose
own `CallState.draft` then points to the call's `DraftRun`):

- the assistant's `_sample` runs the package's deferred loop (`generation.patched_sample`), with `DraftStop`, a
  controller that neither drains nor reads the last step at its end: a draft that stops at its length is decided
  on the host; one that stops on EOS or low confidence is seen one token late, and that extra token is undone
  (sequences, scores, the assistant's cache, the random numbers) like any lagged stop;
- `ConfidenceCriteria` becomes `DeviceConfidence`, the same comparison as a device bool;
- the special-token tensors are made in the first round and reused (`patched_prepare_special_tokens`), 5.23's
  logits-processor set-up skips an encoder-ids check that only gates encoder processors
  (`patched_get_logits_processor`), and the mask the assistant is handed is one the package can answer for on the
  host: tagged with the call's mask summary (4.57-5.17, `masking.py`), or on 5.18+ a CPU all-ones mask where stock
  would build an all-ones one and drop it;
- with scikit-learn, the draft probabilities stay on the device and reach the generator with the round's one read.

An assistant cache that cannot give a step back exactly (sliding-window or recurrent layers) makes its draft loop
read each verdict at once, as stock does, with one `StockPathWarning` per call.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
from transformers.generation.stopping_criteria import ConfidenceCriteria, StoppingCriteria, StoppingCriteriaList

from ...release_checks import cache_kwarg
from ...undo.cache_rollback import why_not_rollbackable
from ...state.call_state import CALL, active_draft, compiling
from ...config import _mark
from ...control.stock_path import warn_stock
from ...control.controller import AsyncStop
from ...sync_free.masking import MaskSummary, _tag, _tag_of, _worth_it
from ...release_checks.verified import installed_digests, matches

CONFIDENCE = "assistant confidence on the device"
SPECIAL_TOKENS = "assistant special tokens once per call"
CANDIDATES = "draft probabilities in the round's copy"
ENCODER_IDS = "draft logits processors without the encoder-ids check"
HOST_MASK = "draft attention mask on the host"

# `_generate_candidates` sources whose `_prepare_generation_args` already merged `assistant_kwargs` into the
# arguments (5.0-5.2 call `generate(**generation_args)`; the others add `**self.assistant_kwargs`)
_MERGED_ARGS = {"031a65e6368b"}


class DraftRun:
    """Shared by every round of one deferred assisted call: what the assistant's `generate()` calls need."""

    def __init__(self, generator, mirror, summary):
        self.generator = generator
        self.mirror = mirror  # the call's sequence on the host (lookup.Mirror)
        self.summary = summary  # the call's MaskSummary, or None
        self.special = {}  # the special-token tensors of round 1, by ids and device
        self.pending_probs = None  # scikit-learn: this round's draft probabilities, on the device
        self.slots = None  # the draft controllers' pinned verdict slots and events, reused every round
        self.hooks = None  # the assistant's HookWatch, carried from round to round (`DraftStop.watch_hooks`)
        self._warned = False

    # -- the hooks `generation.patched_sample` calls for a draft loop ------------------------------------------------
    def why_stock(self, reason: str | None) -> str | None:
        """The draft loop runs stock only where `_sample` itself would: silently per round, warned once per call."""
        if reason is None:
            return None
        self.warn_once(f"the assistant's draft loop cannot defer its stop check ({reason})")
        return ""

    def controller(self, *args, **kwargs) -> "DraftStop":
        return DraftStop(self, *args, **kwargs)

    def criteria(self, stopping_criteria: StoppingCriteriaList) -> StoppingCriteriaList:
        if not any(type(c) is ConfidenceCriteria for c in stopping_criteria) or not matches(CONFIDENCE):
            return stopping_criteria
        return StoppingCriteriaList(
            [DeviceConfidence(c) if type(c) is ConfidenceCriteria else c for c in stopping_criteria])

    def warn_once(self, reason: str) -> None:
        if not self._warned:
            self._warned = True
            warn_stock(reason, stacklevel=6)

    # -- the candidate generator ---------------------------------------------------------------------------------
    def install(self) -> None:
        """Route the generator's assistant `generate()` calls through this run (an attribute of this instance)."""
        generator = self.generator
        if matches(CANDIDATES):
            merged = _merges_arguments()
            generator._generate_candidates = types.MethodType(
                lambda cg, args: _generate_candidates(cg, args, self, merged), generator)
        else:
            stock = type(generator)._generate_candidates
            generator._generate_candidates = types.MethodType(
                lambda cg, args: self.drafting(lambda: stock(cg, args)), generator)

    def uninstall(self) -> None:
        self.generator.__dict__.pop("_generate_candidates", None)

    def drafting(self, call):
        state = CALL.get()
        state.drafting = self
        try:
            return call()
        finally:
            state.drafting = None

    def take_probs(self):
        probs, self.pending_probs = self.pending_probs, None
        return probs

    def host_mask(self, assistant, arguments: dict):
        """A mask the package can answer for on the host, to hand the assistant instead (None: keep its own).

        4.57-5.17: the assistant's mask (the prompt's, then ones) is tagged with the call's mask summary, so its
        SDPA mask-skip checks read the host (`masking.py`). 5.18+: where stock builds an all-ones mask, reads
        `(mask == 1).all()` and drops it, a CPU all-ones mask gives the same answer without the read."""
        mask = arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if (self.summary is not None and mask.dim() == 2 and mask.shape[0] == 1 and _tag_of(mask) is None
                    and mask.shape[-1] >= self.summary.prompt_length and _worth_it(mask)):
                _tag(mask, self.summary, mask.shape[-1])
            return None
        if mask is None and arguments.get("position_ids") is not None and self._builds_ones(assistant, arguments):
            return torch.ones((1, arguments[self.generator.input_ids_key].shape[-1]), dtype=torch.long, device="cpu")
        return None

    def _builds_ones(self, assistant, kwargs) -> bool:
        """Would the assistant's `generate()` build an all-ones mask from these inputs (and then drop it)?"""
        if not matches(HOST_MASK) or assistant.config.is_encoder_decoder or self.generator.input_ids_key != "input_ids":
            return False
        if "attention_mask" not in inspect.signature(assistant.forward).parameters:
            return False
        if "flash" in str(getattr(assistant.config, "_attn_implementation", "") or ""):
            return False  # flash attention keeps the mask with a static cache
        config = kwargs.get("generation_config") or self.generator.generation_config
        pad, eos = config.pad_token_id, config.eos_token_id
        if pad is None:
            # 5.21+ fills a field the passed config leaves unset from the assistant's own generation config: its pad
            # id then masks that token in every draft forward where the sequence holds it (fuzzer seed 234). Taken
            # whatever the release: where stock would build ones after all, no mask is handed and the assistant
            # builds its own, as stock does (one read)
            pad = getattr(getattr(assistant, "generation_config", None), "pad_token_id", None)
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if pad is None or (isinstance(pad, int) and pad in eos):
            return True  # no pad id (it becomes the first EOS id), or pad is an EOS id: stock builds ones
        return isinstance(pad, int) and not self.mirror.contains(pad)


_CANDIDATES_SOURCE = "transformers.generation.candidate_generator:AssistedCandidateGenerator._generate_candidates"


@functools.cache
def _merges_arguments() -> bool:
    """The installed `_generate_candidates` passes the merged arguments (5.0-5.2); read once, like `matches`."""
    return installed_digests(CANDIDATES)[_CANDIDATES_SOURCE] in _MERGED_ARGS


def _generate_candidates(self, generation_args: dict, run: DraftRun, merged: bool):
    """Copied from transformers v4.57.6-v5.24.0 `AssistedCandidateGenerator._generate_candidates` (5.0-5.2 pass the
    merged arguments, the others add `**self.assistant_kwargs`; 4.57 reads the threshold from the assistant's own
    config). Differences:
    - the assistant's `generate()` runs as the draft of the deferred call (`DraftRun.drafting`), with a mask the
      package answers for on the host (`DraftRun.host_mask`, in a shallow copy of the arguments);
    - with scikit-learn, `scores_softmax[range(len(ids)), ids]` (a CPU index into a device tensor: an H2D copy)
      gathers with a device `arange`, and `self.probs.extend(p.tolist())` waits for the round's one read
      (`DraftRun.take_probs`; nothing reads `self.probs` in between).
    """
    generation_args, extra = dict(generation_args), ({} if merged else dict(self.assistant_kwargs))
    mask = run.host_mask(self.assistant_model, {**extra, **generation_args})
    if mask is not None:
        (generation_args if merged else extra)["attention_mask"] = mask
    assistant_output = run.drafting(lambda: self.assistant_model.generate(**generation_args, **extra))
    cache_kwarg.put(self.assistant_kwargs, cache_kwarg.of_output(assistant_output))
    from transformers.generation import candidate_generator

    config = getattr(self, "assistant_generation_config", None) or self.assistant_model.generation_config
    if (
        candidate_generator.is_sklearn_available()
        and config.assistant_confidence_threshold
        and type(self) is candidate_generator.AssistedCandidateGenerator
    ):
        scores_tensor = torch.cat(assistant_output.scores, dim=0)
        scores_softmax = torch.softmax(scores_tensor, dim=-1)
        ids = assistant_output.sequences[-1, -len(assistant_output.scores):]
        run.pending_probs = scores_softmax[torch.arange(len(ids), device=ids.device), ids]
    candidate_logits = torch.stack(assistant_output.scores, dim=1)
    candidate_ids = assistant_output.sequences
    return candidate_ids, candidate_logits


class DeviceConfidence(StoppingCriteria):
    """`ConfidenceCriteria` as a device bool.

    Copied from transformers v4.57.6-v5.24.0 `ConfidenceCriteria.__call__` (same body). Differences: the
    probability is gathered and compared on the device, in float64, instead of `.item()` (a blocking read every
    drafted token) and a Python comparison. Stock compares the float32 value, converted exactly to a Python float,
    with the threshold (a Python or numpy float64): a float64 comparison of the same two numbers. The threshold is
    read at every call, as stock's criterion object holds it.
    """

    def __init__(self, criterion: ConfidenceCriteria):
        self.criterion = criterion

    def __call__(self, input_ids, scores, **kwargs):
        probs = scores[-1].softmax(-1)
        p = probs[0].gather(0, input_ids[0, -1:])
        return p.double() < float(self.criterion.assistant_confidence_threshold)


class DraftStop(AsyncStop):
    """`AsyncStop` for a draft loop: one step late like any deferred loop, and nothing to wait for at its end.

    - `finish()` neither reads the last step's verdict (the loop stopped at its length, decided on the host, or
      already read it) nor synchronizes the events: the outer round's one read comes after all of it;
    - the assistant's cache must give the extra step back exactly, without restricting a sliding window's
      recorded past: full-attention layers only, else this loop reads each verdict at once (stock's reads).
    """

    drafting = True

    def __init__(self, run: DraftRun, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._run = run
        if run.slots is not None:
            # the previous round's pinned verdict slots and events: every copy into them has landed by now (the
            # outer round's read waited on an event recorded after them)
            self._flags, self._views, self._done = run.slots

    def watch_hooks(self, model) -> None:
        """The previous round's watch of the same assistant, where there is one: between two rounds it checks what it
        checks between two steps (a module swapped, the class's `forward` replaced, a hook handle made anywhere in
        the process since its last look, which sends it over every module again), so its first look, a walk of
        every module and its class's file, is made once per call instead of once per round (issue 38: 0.26 ms of a
        2-layer draft's round on an H200, 0.57 ms when the target drafts for itself). A watch that noticed something
        (its verdicts were read at once), or whose listed hook tables are no longer empty, is made again."""
        watch = self._run.hooks
        if watch is None or watch.model is not model or not watch.quiet():
            super().watch_hooks(model)
            self._run.hooks = self.hooks
        else:
            self.hooks = watch

    def see_cache(self, cache) -> None:
        if not self._first_sight(cache):
            return
        reason = why_not_rollbackable(cache)
        if reason is not None and self.steps == 0:
            self.synchronous = True
            self._run.warn_once(f"the assistant's cache cannot give back a drafted token ({reason}), so its draft "
                                "loop reads its stop verdict every token")

    def finish(self) -> int:
        self.close()
        if self.extra:
            self.rng.restore()
        if self._flags is not None:
            self._run.slots = (self._flags, self._views, getattr(self, "_done", None))
        return 1 if self.extra else 0


# --- the assistant's generate() preamble ------------------------------------------------------------------------
def _draft_run():
    return None if compiling() else active_draft()


def patched_prepare_special_tokens(original, target):
    def _prepare_special_tokens(self, generation_config, *args, **kwargs):
        run = _draft_run()
        if run is None or not matches(SPECIAL_TOKENS):
            return original(self, generation_config, *args, **kwargs)
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        key = _special_key(self, generation_config, device)
        saved = run.special.get(key) if key is not None else None
        if saved is None:
            original(self, generation_config, *args, **kwargs)
            if key is not None:
                run.special[key] = (generation_config._bos_token_tensor, generation_config._eos_token_tensor,
                                    generation_config._pad_token_tensor,
                                    generation_config._decoder_start_token_tensor)
            return None
        (generation_config._bos_token_tensor, generation_config._eos_token_tensor,
         generation_config._pad_token_tensor, generation_config._decoder_start_token_tensor) = saved
        return None

    return _mark(_prepare_special_tokens, original)


def _special_key(model, generation_config, device):
    """What the special-token tensors depend on: the ids (ints or lists of ints), the device, and the model kind.
    None (no reuse) for anything else."""
    ids = []
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(generation_config, name, None)
        if isinstance(value, list) and all(type(v) is int for v in value):
            value = tuple(value)
        elif value is not None and type(value) is not int:
            return None
        ids.append(value)
    return (*ids, str(device if device is not None else model.device), model.config.is_encoder_decoder)


def patched_get_logits_processor(original, target):
    def _get_logits_processor(self, *args, **kwargs):
        run = _draft_run()
        if run is not None and kwargs.get("encoder_input_ids") is not None and matches(ENCODER_IDS):
            config = kwargs.get("generation_config", args[0] if args else None)
            penalty = getattr(config, "encoder_repetition_penalty", None)
            ngram = getattr(config, "encoder_no_repeat_ngram_size", None)
            if (penalty is None or penalty == 1.0) and not ngram:
                # `(encoder_input_ids < 0).any()` is read only to gate the two encoder processors, not asked for
                kwargs["encoder_input_ids"] = None
        return original(self, *args, **kwargs)

    return _mark(_get_logits_processor, original)


def outer_mask_summary(model_kwargs):
    """The call's MaskSummary (one read per call, as `masking.py` would make it at the first update), tagging the
    call's mask with it; None where the package leaves masks alone."""
    mask = model_kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not _worth_it(mask):
        return None
    tag = _tag_of(mask)
    if tag is not None:
        return tag[0]
    summary = MaskSummary(mask)
    _tag(mask, summary, mask.shape[-1])
    return summary
