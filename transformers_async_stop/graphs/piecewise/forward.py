"""The per-call forward of the dynamic-cache loop that replays a model's recorded pieces.

Per step, before any replay, it checks what a replay would otherwise get wrong, and runs the eager forward (the
model's own) where it cannot replay:
- the step's inputs: only `input_ids` / `position_ids` (one column), the cache (`past_key_values` up to 5.23,
  `cache` from 5.24: `cache_kwarg.py`), `use_cache`, `logits_to_keep`,
  `return_dict`, and a mask whose effect on the attention is known on the host (`_attention_mask`);
- staleness (`staleness.py`): a module, parameter or buffer replaced, its storage moved (`.to()`, `.data =`, a dtype
  change) or its shape or stride changed on the same storage, a plain attribute of a module or a config rebound (a
  norm's epsilon, an attention's scaling) or a config's list or dict edited in place: the model's recordings are
  dropped and the step records again; a hook or a wrapped forward added, training mode, an
  attention implementation other than SDPA: the rest of the call runs eagerly;
- threads: while another thread is inside `generate()`, the step runs eagerly (the graphs and their buffers serve one
  forward at a time);
- default-deny: the model is proven (`proven.py`) before each recording, and every module's class is compared before
  each replay (a class swapped mid-call makes the recordings stale, and the model is proven again);
- the key of the recording (batch size, dtypes, device, mask kind, `logits_to_keep`, every torch setting a captured
  kernel was chosen under: `settings.py`): a new key records once (at most `MAX_KEYS` per model, least recently used out).
A family whose base forward starts with `warn_if_padding_and_no_attention_mask` (GPT-2: without a mask it checks the
step's ids for the pad token and warns once) has that check run before each replay, as its forward runs it.
Recordings are kept per model (`staleness.graphs_of`) and freed with it.
"""

from __future__ import annotations

import collections
import itertools
import operator
import sys
import threading

import torch
from transformers import masking_utils

from ...release_checks import cache_kwarg
from ...state import concurrency
from ...sync_free import masking
from . import eligibility, proven, settings
from .graphs import CaptureFailed, NotRecordable, record
from .staleness import ModelGraphs, graphs_of  # noqa: F401 (the per-model store: `forward.graphs_of` for callers)

MAX_KEYS = 4  # recordings per model (batch sizes, mask kinds...): least recently used dropped beyond
_TRAINING = operator.attrgetter("training")
_PLAIN_TABLES = (dict, collections.OrderedDict)
# the step's inputs a recording takes; the cache's keyword is the running release's (`cache_kwarg.name()`)
_INPUTS = frozenset(("input_ids", "position_ids", "attention_mask", "use_cache", "logits_to_keep", "return_dict"))


class PiecewiseForward:
    """`model_forward` for one call of the dynamic-cache loop (see the module docstring)."""

    def __init__(self, model, model_forward, report, draft=False):
        self.model, self.eager, self.report = model, model_forward, report
        self.draft = draft  # an assistant's draft loop: batch 1 only, reported with a "draft " prefix
        self.graphs = graphs_of(model)
        self.family = eligibility.family_of(model)
        self._watch()
        self.device = model.get_input_embeddings().weight.device
        self.off = None  # why the rest of the call runs eagerly
        self.replayed = self.eager_steps = 0
        self.last_eager = None

    def _watch(self) -> None:
        """What the per-step checks read, from the model as it is now (again after a change was found and the model
        proven again: a module added mid-call is watched from then on)."""
        model, family = self.model, self.family
        base = eligibility.base_of(model)
        self.modules = family.attentions(base, model.config)
        every = list(model.modules())
        self.hook_tables = [table for module in every for table in (
            module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
            getattr(module, "_backward_pre_hooks", {}))]
        # torch's own tables (dict / OrderedDict, whose truth is their length): `any` tests them without a call each;
        # a table of another type (a user's mapping) keeps the per-table `len`
        self.plain_hook_tables = all(type(table) in _PLAIN_TABLES for table in self.hook_tables)
        self.module_dicts = [module.__dict__ for module in every]
        rebound = eligibility.watched(model, sys.modules[type(base).__module__], family)
        self.rebound = tuple(map(list, zip(*rebound))) if rebound else ([], [], [])
        self.every = every
        # the key's dtype is this module's weight's, read at each step (`get_input_embeddings()` itself costs
        # microseconds: transformers' lookup goes through failed attribute reads). A replaced embedding module is a
        # replaced child, which `ModelGraphs.changed` finds before any replay; `_record` watches again, and keys the
        # recording it makes by the module as it is then
        self.embeddings = model.get_input_embeddings()

    def __call__(self, **inputs):
        # every step compares the model with its recordings' snapshot in full: user code can run between two steps
        # from places the call's processors and criteria do not show (a rebound torch function they call, a value of
        # a user type they hold, a finalizer, another thread; tests/test_changes_between_steps_seen.py)
        if self.off is None:
            why = self._why_not_observed()
            if why is not None:
                self.off = why
        if self.off is not None:
            return self._eager(self.off, inputs)
        if not _alone():
            # a model's graphs and their fixed buffers serve one forward at a time: while another thread is inside
            # generate() (it may use this model), neither thread replays (a thread that entered later sees this one)
            return self._eager("another thread is inside generate()", inputs)
        mask, key, why = self._step(inputs)
        if why is not None:
            return self._eager(why, inputs)
        if self.family.checks_padding and inputs.get("attention_mask") is None:
            # GPT-2's base forward starts with this check of the step's ids (a log where they hold the pad token):
            # a replay skips the forward's Python, and the recording's 4D sentinel mask makes it return at once
            eligibility.base_of(self.model).warn_if_padding_and_no_attention_mask(inputs["input_ids"], None)
        graphs = self.graphs
        if graphs.recordings and graphs.changed():
            graphs.clear()  # weights replaced or moved, an attribute rebound: every recording of this model is stale
            # what changed may be a decision the call's eligibility made once (a config's `sliding_window` set by a
            # criterion): decided again before anything is recorded
            why = eligibility.why_not_model(self.model, self.eager)
            if why is not None:
                self.off = why
                return self._eager(why, inputs)
            self._watch()
        recording = graphs.recordings.get(key)
        if recording is not None:
            graphs.recordings.move_to_end(key)
            return self._replayed(recording.replay(cache_kwarg.get(inputs), inputs["input_ids"],
                                                   inputs["position_ids"], mask, self._attention(), self.modules))
        if key in graphs.failed:
            return self._eager(graphs.failed[key], inputs)
        return self._record(key, mask, inputs)

    def _record(self, key, mask, inputs):
        # a recording bakes in whatever Python runs now: the model is proven again as it is at this step (a class
        # swapped or a module added since the call's start, before any recording could notice, is refused here)
        why = eligibility.why_not_model(self.model, self.eager)
        if why is not None:
            self.off = why
            return self._eager(why, inputs)
        self._watch()
        key = key[:-1] + (self.embeddings.weight.dtype,)  # the embedding module as watched now (`_watch`)
        graphs = self.graphs
        if not graphs.recordings:
            graphs.clear()
            graphs.snapshot(self.model)
        forward_inputs = {name: value for name, value in inputs.items() if name != "return_dict"}
        forward_inputs["return_dict"] = True
        try:
            made = record(self.model, self.eager, forward_inputs, cache_kwarg.get(inputs), self.modules, mask,
                          "sdpa", graphs.pool)
        except NotRecordable as error:
            graphs.failed[key] = f"not recordable: {error}"
            return self._eager(graphs.failed[key], inputs)
        except CaptureFailed as error:
            # a capture the device refused (a host read inside the forward, say); any other exception is the model's
            # or the user's, which `record` lets through: stock's forward raises it here too
            graphs.failed[key] = f"capture failed ({error})"
            return self._eager(graphs.failed[key], inputs)
        if made is None:
            return self._eager("another thread is inside generate()", inputs)
        recording, outputs = made
        graphs.pool = recording.pool
        graphs.recordings[key] = recording
        graphs.sizes = list(map(len, graphs.dicts))  # what transformers' own forward set on its modules while recorded
        while len(graphs.recordings) > MAX_KEYS:
            graphs.recordings.popitem(last=False)
        return self._replayed(outputs)

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
            pieces = len(self.modules) + 1
            tail = f"; {self.eager_steps} eager: {self.last_eager}" if self.eager_steps else ""
            text = f"graphed ({pieces} pieces): {self.replayed} decode steps{tail}"
        else:
            text = f"eager: {self.last_eager}"
        report.forward = f"draft {text}" if self.draft else text

    def _attention(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # `get` rather than `get_interface`: the latter is 5.x-only, and for "sdpa" both read the same two mappings
        return ALL_ATTENTION_FUNCTIONS.get("sdpa")

    def _why_not_observed(self) -> str | None:
        hooks = torch.nn.modules.module
        tables = self.hook_tables
        if (any(tables) if self.plain_hook_tables else any(map(len, tables))) or (
                hooks._global_forward_pre_hooks or hooks._global_forward_hooks):
            return "a hook was added"
        if any(map(operator.contains, self.module_dicts, itertools.repeat("forward"))):
            return "a forward was wrapped"
        if any(map(_TRAINING, self.every)):
            return "training mode"
        owners, names, first = self.rebound
        if any(map(operator.is_not, map(getattr, owners, names), first)):
            return eligibility.why_rebound(zip(owners, names, first))
        if getattr(self.model.config, "_attn_implementation", None) != "sdpa":
            return "the attention implementation changed"
        if not proven.transformers_own(self._attention()):
            # each replay calls it eagerly for every layer: user code there could change what the rest of the step
            # reads, which the recording baked in (red team Q6)
            return "an attention function registered for sdpa that is not transformers' own"
        if not _own_sdpa_mask():
            # stock's `create_causal_mask` calls the mask function registered for "sdpa" at every step; a replay's
            # mask is the one `_attention_mask` worked out for transformers' own
            return "a mask function registered for sdpa"
        return _why_mode()


    def _step(self, inputs):
        """(the attention's mask, the recording key, None), or (None, None, why this step runs eagerly)."""
        cache = cache_kwarg.get(inputs)
        if (not _INPUTS.issuperset(name for name in inputs if name != cache_kwarg.name())
                or inputs.get("return_dict", True) is not True):
            return None, None, "inputs the recording does not take"
        ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
        keep = inputs.get("logits_to_keep", 0)
        if not (_column(ids, self.device) and _column(positions, self.device)
                and positions.shape[0] == ids.shape[0]):
            return None, None, "not a one-token decode step"
        if self.draft and ids.shape[0] != 1:
            return None, None, "a draft batch other than 1"
        if inputs.get("use_cache", True) is not True or type(keep) is not int:
            return None, None, "inputs the recording does not take"
        why = eligibility.why_not_cache(cache)
        if why is not None:
            return None, None, why
        if len(cache.layers) != len(self.modules) or not cache.layers[0].is_initialized:
            return None, None, "a cache not filled by this model's prefill"
        mask, why = _attention_mask(inputs.get("attention_mask"), ids.shape[0], cache)
        if why is not None:
            return None, None, why
        # autocast of the model's device (`is_autocast_enabled()` alone is CUDA's: a CPU model's recording under CPU
        # autocast, emulated, would have replayed its casts in a call without it)
        if torch.is_grad_enabled() or torch.is_autocast_enabled() or torch.is_autocast_enabled(self.device.type):
            return None, None, "gradients or autocast enabled"
        key = (ids.shape[0], ids.dtype, positions.dtype, self.device, mask is None, keep,
               # every torch setting that can change a kernel's choice or its numerics (`settings.py`)
               settings.read(),
               # buffers recorded under inference mode are inference tensors: a replay outside it cannot write them
               # (the CUDA usage fuzzer: seeds 422, 775, 1447, 1899), and the reverse would hand inference-mode
               # callers normal tensors where stock gives inference ones
               torch.is_inference_mode_enabled(),
               # factory calls without a device inside the pieces were recorded on this default device
               _default_device(),
               # the model's dtype, last (`_record` puts the one of the embedding module as it watches it then)
               self.embeddings.weight.dtype)
        return mask, key, None


# torch's mode stacks (private: read by name, and a torch without them keeps the eager forward, `_why_mode`)
_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
try:
    from torch.overrides import _get_current_function_mode_stack as _function_modes
    from torch.utils._device import DeviceContext as _DeviceContext
except ImportError:
    _function_modes = _DeviceContext = None


def _why_mode() -> str | None:
    """A torch function or dispatch mode active around the forward (a profiler's, a debugger's, a counting mode) sees
    every op of stock's forward, and nothing of a replay: the step runs eagerly. `torch.set_default_device` keeps one
    mode on for good (a `DeviceContext`): it only gives factory calls without a device their device, and it is part
    of the recording key (`_default_device`), so it keeps the path."""
    if None in (_FUNCTION_MODES, _DISPATCH_MODES, _function_modes, _DeviceContext):
        return "torch's mode stacks cannot be read"
    if _DISPATCH_MODES():
        return "a torch dispatch mode is active"
    if _FUNCTION_MODES() and any(type(mode) is not _DeviceContext for mode in _function_modes()):
        return "a torch function mode is active"
    return None


def _own_sdpa_mask() -> bool:
    """The mask function registered for "sdpa" is transformers' own `sdpa_mask`."""
    registry = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    own = getattr(masking_utils, "sdpa_mask", None)
    return registry is not None and own is not None and registry.get("sdpa") is own


def _default_device():
    """The default device `torch.set_default_device` put on the mode stack, None without one (a recording key).
    Reached only after `_why_mode` found the stacks readable and holding no other function mode."""
    if not _FUNCTION_MODES():
        return None
    return tuple(str(getattr(mode, "device", None)) for mode in _function_modes())


def _alone() -> bool:
    """No other thread is inside generate() (`concurrency.inside_generate` registers each call's thread)."""
    ident = threading.get_ident()
    return all(other == ident for other in list(concurrency._INSIDE))


def _column(tensor, device) -> bool:
    return (isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor and tensor.dim() == 2
            and tensor.shape[1] == 1 and tensor.dtype == torch.long and tensor.device == device)


def _attention_mask(mask, batch: int, cache):
    """What stock's `create_causal_mask` hands the attention at this decode step, known on the host: (mask, None),
    or (None, why the step runs eagerly).

    - a 4D mask (the loop's grown mask, `dynamic_loop/wide_mask.py`) is returned as it is;
    - no mask, or a 2D mask of ones as long as the cache and this token (the call's host summary says the prompt has
      no padding and no zero column was added), gives None on SDPA's decode step (`_ignore_causal_mask_sdpa`: no
      padding and one query);
    - anything else (a padded 2D mask: stock builds the 4D mask inside the forward) is left to the eager forward."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor) or type(mask) is not torch.Tensor:
        return None, "a mask the recording does not take"
    if mask.dim() == 4:
        if (mask.dtype == torch.bool and mask.shape[0] == batch and mask.shape[1:3] == (1, 1)
                and mask.shape[3] == cache.get_seq_length() + 1):
            return mask, None
        return None, "a 4D mask other than the decode step's"
    if mask.dim() == 2:
        if mask.shape[-1] != cache.get_seq_length() + 1:
            # shorter than the cache + this token (a chunked prefill or a conversation fed again on a continued
            # cache): stock's mask then hides the cache's last positions, SDPA's unmasked decode step would not (CUDA
            # usage fuzzer seeds 51, 177, 1339, 1443 on 5.17; tests/test_piecewise_redteam.py, hole A)
            return None, "a 2D mask whose length is not the cache's + 1"
        tag = masking._tag_of(mask)
        if tag is not None and not tag[0].padded and tag[1] == mask.shape[-1]:
            return None, None
        return None, "a padded 2D mask (the model builds its 4D mask this step)"
    return None, "a mask the recording does not take"
