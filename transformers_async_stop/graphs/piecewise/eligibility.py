"""Which models and calls the piecewise-graphed forward takes, decided once per call: a reason, or None.

A replay runs no Python of the model's forward: every decision the forward makes in Python is baked into the graphs at
the recording. So the path is taken only where each such decision is one the package has proven does not change with
the length or the step:

- a family read by hand (`FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2, Gemma 3 text; the sources behind
  `targets.SHORTCUTS` "piecewise forward (<family>)"), exactly their causal LM and base classes; or any other
  transformers causal LM, found from the model (`auto/discover.py`) and proven per recording from what it ran
  (`auto/proof.py`, docs/design/family-proof.md);
- full-attention or sliding-window layers (a sliding layer's mask is answered on the host at each replay), no
  cross-attention, no bidirectional attention, no attention logit soft-capping, SDPA from transformers' own registry;
- rotary embeddings without per-length state (`dynamic`/`longrope` update their frequencies from the positions), or
  none (GPT-2's learned position table, read in the first piece from the positions buffer);
- no hook anywhere in the model and no instance-level `forward` (accelerate's wrappers, offloading, user hooks, and
  the output-capturing hooks transformers installs once attentions or hidden states were asked for), not training,
  no gradient and no autocast (their state is read in Python per op);
- every parameter and buffer a plain tensor on the model's one CUDA device: no `device_map` across devices, no
  tensor parallelism (DTensor parameters, `tp_size`), no process group, no quantized weights (`hf_quantizer`), no
  meta (offloaded) tensors;
- a forward that is the model's own `__call__` (not compiled), and a `DynamicCache` of `DynamicLayer`s and
  `DynamicSlidingWindowLayer`s;
- default-deny (`proven.py`): every module of the model is one of transformers' own classes (for a hand-read family,
  one whose sources were read and digested), or one of torch's own modules on a short list, with no instance-level
  override; a user module, a peft adapter layer, a wrapper or a subclass anywhere keeps the forward eager, named in
  the reason. The torch functions the forward's code looks up must be torch's own.
Everything else keeps the eager forward, and `last_path().forward` says why. Gemma 2 is found, but transformers
refuses SDPA for it at construction (its soft-capping): "attention implementation 'eager'".
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys

import torch

from ...state.call_state import compiling
from ...release_checks.verified import matches, sources_of
from ..backend import emulates
from . import proven
from .code_names import watched_functions
from .observed import why_global_hooks, why_not_tensors, why_observed

PIECEWISE_ENV = "TRANSFORMERS_ASYNC_STOP_PIECEWISE"

# the modeling module's functions a replay skips, watched for rebinding (those a module does not have are left out)
_WATCHED_GLOBALS = ("apply_rotary_pos_emb", "rotate_half", "create_causal_mask", "ALL_ATTENTION_FUNCTIONS")


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family read for the path: where its attention modules and rotary embedding are, and what else of its
    forward is decided in Python."""

    name: str
    module: str  # the modeling module
    causal_lm: str  # the causal LM class (the base model's class is the `FAMILIES` key)
    layers: str = "layers"  # the base model's attribute holding its decoder layers
    attention: str = "self_attn"  # each layer's attention module (the one that calls the cache update)
    rotary: str | None = "rotary_emb"  # the base model's rotary embedding (None: a learned position table)
    watched: tuple = _WATCHED_GLOBALS
    # the base forward starts with `warn_if_padding_and_no_attention_mask` (GPT-2): run before each replay
    checks_padding: bool = False
    # each layer's window is its `layer_types` entry (Gemma 3: `sliding_window` is set, used by sliding layers only)
    windows_by_layer_type: bool = False
    # found by `auto/discover.py` and proven per recording (`auto/proof.py`), not read by hand
    auto: bool = False

    def attentions(self, base, config) -> list:
        layers = operator.attrgetter(self.layers)(base)  # a dotted path for a nested decoder (OPT's `decoder.layers`)
        return [getattr(layer, self.attention) for layer in layers[: config.num_hidden_layers]]


# base model class -> its family
FAMILIES = {
    "LlamaModel": Family("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "MistralModel": Family("mistral", "transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "Qwen2Model": Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    # fused qkv_proj / gate_up_proj, a partial rotary (static): pieces like Llama's. Its own input preparation is
    # called at every step by the dynamic-cache loop (`dynamic_loop/eligibility._OWN_INPUTS`)
    "Phi3Model": Family("phi3", "transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM",
                        watched=(*_WATCHED_GLOBALS, "create_sliding_window_causal_mask")),
    # a learned position table (`wpe`, in piece 0) instead of a rotary embedding, Conv1D projections, a fused c_attn
    # split into q/k/v; cross-attention (an `EncoderDecoderCache`) steps aside
    "GPT2Model": Family("gpt2", "transformers.models.gpt2.modeling_gpt2", "GPT2LMHeadModel", layers="h",
                        attention="attn", rotary=None, watched=("create_causal_mask", "ALL_ATTENTION_FUNCTIONS"),
                        checks_padding=True),
    # Gemma 3 (text): full-attention layers only (`layer_types`; the released configs' sliding layers keep it off the
    # dynamic-cache loop), one rope per layer type (each static), q/k norms, a scaled embedding, the final logit
    # soft-capping in the last piece (a config branch); the sliding mask it also makes is unused by full layers
    "Gemma3TextModel": Family("gemma3", "transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM",
                              watched=(*_WATCHED_GLOBALS, "create_sliding_window_causal_mask"),
                              windows_by_layer_type=True),
}
# rope types whose frequencies are fixed at init (the `dynamic_rope_update` decorator does nothing for them)
STATIC_ROPE = frozenset(("default", "linear", "llama3", "yarn"))


# taken unless `TRANSFORMERS_ASYNC_STOP_PIECEWISE=0` (False would take it only with `TRANSFORMERS_ASYNC_STOP_PIECEWISE=1`)
DEFAULT_ON = True


def why_off() -> str | None:
    """Why the environment keeps the path off (None: on)."""
    value = os.environ.get(PIECEWISE_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return f"{PIECEWISE_ENV}={value}"
    if value in ("1", "true", "yes", "on") or DEFAULT_ON:
        return None
    return f"off by default ({PIECEWISE_ENV}=1 turns it on)"


def base_of(model):
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def why_not_model(model, model_forward) -> str | None:
    """Why this model's decode forward cannot be replayed piecewise (None: it can), from what holds for a whole call.
    The device comes last, so every other reason is also told on the CPU."""
    why = _why_not_call(model, model_forward)
    if why is not None:
        return why
    base = base_of(model)
    family, why = _family(model)
    if family is None:
        return why
    name, causal_lm = family.name, family.causal_lm
    module = sys.modules.get(family.module)
    if (module is None or type(base) is not getattr(module, type(base).__name__, None)
            or type(model) is not getattr(module, causal_lm, None)):
        return f"{type(model).__name__} is not transformers' own {causal_lm}"
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(config, '_attn_implementation', None)!r} (only sdpa is proven)"
    if not getattr(config, "is_causal", True):
        return "not a causal model"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention layers"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (SDPA refuses it)"
    # sliding-window layers (a window for every layer, or hybrid `layer_types`) take the path: which mask each
    # layer's attention gets is observed at the recording (its mask calls intercepted), and each replay answers them
    # on the host from the cache's sliding layer (`masks.host_mask`; a padded batch stays eager, `steps.sliding_step`)
    if any(kind not in ("full_attention", "sliding_attention") for kind in getattr(config, "layer_types", None) or ()):
        return "layers other than full or sliding-window attention"
    # a found family may keep a rotary embedding anywhere (per layer, inside the attention): every one is asked
    rotaries = [module for module in model.modules() if hasattr(module, "rope_type")] if family.auto else [
        getattr(base, family.rotary, None)] if family.rotary is not None else []
    for rotary in rotaries:
        rope = getattr(rotary, "rope_type", None)
        for kind in rope.values() if isinstance(rope, dict) else (rope,):  # Gemma 3: one per layer type
            if not isinstance(kind, str) or kind not in STATIC_ROPE:
                return f"rope type {kind!r} has per-length state"
    why = _why_not_running(model)
    if why is not None:
        return why
    why = why_not_tensors(model)
    if why is not None:
        return why
    why = why_observed(model)
    if why is not None:
        return why
    why = why_rebound(watched(model, module, family))
    if why is not None:
        return why
    if family.auto:
        # proven per recording, from what it ran (`auto/proof.py`); here the shared sources a replay relies on must be
        # the ones read, and every module's class transformers' own (or one of torch's own on the list), with no
        # instance-level override
        if not matches("piecewise shared sources"):
            return "transformers' shared sources (masks, cache updates) are not the ones read"
        why = proven.why_unread(model, None)
    elif not matches(f"piecewise forward ({name})"):
        return f"transformers' {name} sources are not the ones read"
    else:
        # default-deny: every module's class read and digested (or one of torch's own on the list), and the torch
        # functions the forward's code looks up torch's own (`proven.py`)
        why = proven.why_unread(model, sources_of(f"piecewise forward ({name})"))
    if why is not None:
        return why
    why = proven.why_foreign_functions(watched_functions(model, module))
    if why is not None:
        return why
    return _why_not_device(model)


def why_not_again(model, model_forward, graphs) -> str | None:
    """`why_not_model` for a model whose recordings' snapshot is unchanged (`ModelGraphs.changed()` is False): it was
    proven when recorded, and everything that proof read of the model (classes, modules, parameters, attributes,
    configs, hooks' tables, rebound names, torch functions) is what the snapshot and the per-step checks compare
    before every replay, any change sending it back to `why_not_model`. What a call can change without touching the
    model is asked again: the switch, compilation, the forward handed in, the placement attributes the snapshot does
    not compare (a quantizer, a device map, a mesh), a process group, training, gradients, hooks (added to tables the
    snapshot holds), the device. An assistant's draft is a call per round (issue 38: its proof was 1.2-3.4 ms of
    every round)."""
    why = _why_not_call(model, model_forward) or _why_not_running(model)
    if why is not None:
        return why
    if graphs.same_instances():
        # every module's `__dict__` and children table holds the very keys and objects it held as proven: no module,
        # override, instance-level forward or hook table came or went; a hook added to a table it holds is found here,
        # as the first step would find it
        why = why_global_hooks() or (why_observed(model) if any(map(len, graphs.hook_tables)) else None)
    else:
        # a module's `__dict__` edited to the same size (an attribute deleted, an override set): the snapshot compares
        # sizes only, so the proof's tests of each module's `__dict__` are asked again
        why = why_observed(model) or proven.why_instances(model)
    if why is not None:
        return why
    return _why_not_device(model)


def _why_not_call(model, model_forward) -> str | None:
    off = why_off()
    if off is not None:
        return off
    if compiling():
        return "inside torch.compile"
    if model_forward != model.__call__:
        return "a compiled forward"
    return None


def _why_not_running(model) -> str | None:
    """Where the model runs and how: placement, a process group, training, gradients."""
    why = _why_not_placed(model)
    if why is not None:
        return why
    if model.training:
        return "training mode"
    if torch.is_grad_enabled():
        return "gradients enabled"
    return None


def _why_not_placed(model) -> str | None:
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        return "quantized weights"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "device_map across devices"
    if getattr(model, "tp_size", None) or getattr(model, "_device_mesh", None) is not None:
        return "tensor parallelism"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "a process group (distributed)"
    return None


def _why_not_device(model) -> str | None:
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda" and not emulates(device):  # emulated: CPU tests only
        return f"not CUDA ({device.type})"
    return None


# (owner, attribute) -> the object first seen there by this process: a replay runs none of these, so one rebound since
# (a class-level forward wrapper, a patched module function) must send the call to the eager forward. A wrapper made
# with `functools.wraps` has the original's source (`inspect.getsource` unwraps it), so the digests cannot see it.
_FIRST_SEEN: dict = {}


def family_of(model) -> Family | None:
    return _family(model)[0]


def _family(model):
    """(the model's family, None) or (None, why it has none): a hand-read one (`FAMILIES`), else the layout found
    from the model (`auto/discover.py`), proven per recording."""
    base = base_of(model)
    family = FAMILIES.get(type(base).__name__) if base is not None else None
    if family is not None:
        # a hand-read family whose model runs a class no one read with it (an activation of another family, Llama
        # with `hidden_act="gelu"`), or whose sources drifted on a newer release, is proven per recording instead,
        # where the shared sources are the ones read (elsewhere, an older release, it keeps its own reason)
        if _read_covers(model, family) or not matches("piecewise shared sources"):
            return family, None
        return dataclasses.replace(family, auto=True), None
    from .auto.discover import family_for

    return family_for(model, Family, _WATCHED_GLOBALS)


_COVERED: dict = {}  # (family name, the model's module classes) -> every class is read with the family


def _read_covers(model, family: Family) -> bool:
    name = f"piecewise forward ({family.name})"
    if not matches(name):
        return False
    classes = frozenset(map(type, model.modules()))
    key = (family.name, classes)
    covered = _COVERED.get(key)
    if covered is None:
        if len(_COVERED) >= 64:  # bounded: user classes are not kept alive for good
            _COVERED.clear()
        covered = _COVERED[key] = proven.classes_read(classes, sources_of(name))
    return covered


def watched(model, module, family: Family) -> list:
    """(owner, attribute, the object first seen there) for every class method and module function a replay skips:
    `forward` and `__call__` of each module class of the model, and the modeling module's functions it calls."""
    pairs = [(cls, name) for cls in {type(m) for m in model.modules()} for name in ("forward", "__call__")]
    pairs += [(module, name) for name in family.watched if hasattr(module, name)]
    pairs += _looked_up(module, family)
    pairs += proven.transformers_methods({type(m) for m in model.modules()})
    return [(owner, name, _FIRST_SEEN.setdefault((owner, name), getattr(owner, name))) for owner, name in pairs]


_LOOKED_UP: dict = {}


def _looked_up(module, family: Family) -> list:
    """(module, name) for every global the read code looks up by name (red team holes R4, R9): the modeling module's
    own functions and classes' methods (`slice_logits_to_keep`, the output dataclass...), and each digested source
    outside it (`masking_utils`' `_ignore_causal_mask_sdpa`, `causal_mask_function`...) with the names its code looks
    up in its own module. A name rebound there since it was first seen sends the step eager, as a hand-listed one did
    (`family.watched`). Computed once per (module, family): a pass over the code objects."""
    key = (module.__name__, family.name)
    found = _LOOKED_UP.get(key)
    if found is not None:
        return found
    from ...release_checks.verified import resolve_source, sources_of
    from .code_names import code_names

    pairs = set()
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != module.__name__:
            continue
        functions = [value] if callable(value) and hasattr(value, "__code__") else [
            attribute for attribute in vars(value).values() if hasattr(attribute, "__code__")
        ] if isinstance(value, type) else []
        for function in functions:
            pairs.update((module, name) for name in code_names(function) if name in vars(module))
    # a family found by discovery runs the read families' shared sources (the mask functions, the cache update...)
    read = [family] if not family.auto else FAMILIES.values()
    for source in sorted({source for each in read for source in sources_of(f"piecewise forward ({each.name})")}):
        owner_name, _, qualname = source.partition(":")
        owner = sys.modules.get(owner_name)
        if owner is None or owner is module:
            continue
        try:
            function, holder, attr = resolve_source(source)
        except (ImportError, AttributeError):
            continue
        pairs.add((holder, attr))
        pairs.update((owner, name) for name in code_names(function) if name in vars(owner))
    patched = patched_targets()
    pairs = [(owner, name) for owner, name in pairs if (id(owner), name) not in patched]
    found = _LOOKED_UP[key] = sorted(pairs, key=lambda pair: (getattr(pair[0], "__name__", ""), pair[1]))
    return found


def patched_targets() -> set:
    """(id of the owner, attribute) of the package's own patch targets (the SDPA mask-skip check...): they change with
    `apply()` / `unpatch()`, and what they compute is the stock function's (tests/test_patching.py), so they are not a
    user's rebinding."""
    from ...release_checks.targets import TARGETS

    patched = set()
    for target in TARGETS:
        try:
            patched.add((id(target.resolve_owner()), target.attr))
        except (ImportError, AttributeError):
            continue
    return patched


def why_rebound(entries) -> str | None:
    for owner, name, first in entries:
        if getattr(owner, name, None) is not first:
            return f"{getattr(owner, '__name__', owner)}.{name} was replaced"
    return None
