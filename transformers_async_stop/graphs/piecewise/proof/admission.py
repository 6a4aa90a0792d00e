"""Stage 1 of the proof, continued: what must hold of the model and of the call before anything is recorded.

Decided once per call (and again before each recording, and when the model changed mid-call): a reason, or None.

- the switch (`TRANSFORMERS_ASYNC_STOP_PIECEWISE=0` turns the path off), not compiling, a forward that is the
  model's own `__call__`;
- the family (`family.find`), exactly its causal LM and base classes;
- full-attention or sliding-window layers (a sliding layer's mask is answered on the host at each replay, or made
  again by stock's function), no cross-attention, no bidirectional attention;
- an attention the forward calls as a function (any implementation transformers registers, or the modeling module's
  eager one) or as GPT-J's `_attn` method, transformers' own, as is the mask function of its implementation
  (`proof/attention.py`); each replay calls it eagerly, as stock does (its soft-capping, its dropout, its mask slicing);
- rotary embeddings without per-length state (`dynamic`/`longrope` update their frequencies from the positions), or
  none (GPT-2's learned position table, read in the first piece from the positions buffer);
- no hook anywhere in the model and no instance-level `forward` (accelerate's wrappers, offloading, user hooks, and
  the output-capturing hooks transformers installs once attentions or hidden states were asked for), not training,
  no gradient and no autocast (their state is read in Python per op);
- every parameter and buffer a plain tensor on the model's one CUDA device: no `device_map` across devices, no
  tensor parallelism (DTensor parameters, `tp_size`), no process group, no quantized weights (`hf_quantizer`), no
  meta (offloaded) tensors;
- default-deny (`default_deny.py`): every module of the model is one of transformers' own classes (for a hand-read
  family, one whose sources were read and digested), or one of torch's own modules on a short list, with no
  instance-level override; a user module, a peft adapter layer, a wrapper or a subclass anywhere keeps the forward
  eager, named in the reason. The torch functions the forward's code looks up must be torch's own, and no name a
  replay skips rebound since this process first saw it (`names.py`).
Everything else keeps the eager forward, and `last_path().forward` says why. BLOOM, MPT and Falcon compute their
attention inline in the attention module's forward: "the attention is computed inside BloomAttention.forward, not by
an attention function: no point to cut the forward at".
"""

from __future__ import annotations

import os
import sys

import torch

from ....release_checks.verified import matches, sources_of
from ....state.call_state import compiling
from ...backend import emulates
from . import attention, default_deny, names
from .family import FAMILIES, STATIC_ROPE, base_of, decoding_modules, find
from .observed import why_global_hooks, why_not_tensors, why_observed

PIECEWISE_ENV = "TRANSFORMERS_ASYNC_STOP_PIECEWISE"

# taken unless `TRANSFORMERS_ASYNC_STOP_PIECEWISE=0` (False: taken only with `TRANSFORMERS_ASYNC_STOP_PIECEWISE=1`)
DEFAULT_ON = True


def why_off() -> str | None:
    """Why the environment keeps the path off (None: on)."""
    value = os.environ.get(PIECEWISE_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return f"{PIECEWISE_ENV}={value}"
    if value in ("1", "true", "yes", "on") or DEFAULT_ON:
        return None
    return f"off by default ({PIECEWISE_ENV}=1 turns it on)"


def why_not_model(model, model_forward) -> str | None:
    """Why this model's decode forward cannot be replayed piecewise (None: it can), from what holds for a whole call.
    The device comes last, so every other reason is also told on the CPU."""
    why = _why_not_call(model, model_forward)
    if why is not None:
        return why
    base = base_of(model)
    if getattr(model.config, "is_encoder_decoder", False):
        # its decoder's cache is an `EncoderDecoderCache`, with a cross-attention call per layer that reads no update:
        # Whisper's, BART's and its copies' decoders are read by hand (`family.FAMILIES`); T5's position bias, made
        # after the cache update, is not recorded yet (docs/design/encoder-decoder-graphs.md)
        read = FAMILIES.get(type(base).__name__) if base is not None else None
        if read is None or read.cross_attention is None:
            return "the decoder of an encoder-decoder model (not graphed yet)"
    family, why = find(model)
    if family is None:
        return why
    if (family.cross_attention is not None) != bool(getattr(model.config, "is_encoder_decoder", False)):
        return f"{type(model).__name__} without its encoder-decoder config"
    name, causal_lm = family.name, family.causal_lm
    module = sys.modules.get(family.module)
    if (module is None or type(base) is not getattr(module, type(base).__name__, None)
            or type(model) is not getattr(module, causal_lm, None)):
        return f"{type(model).__name__} is not transformers' own {causal_lm}"
    config = model.config
    if not getattr(config, "is_causal", True):
        return "not a causal model"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention layers"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
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
    why = why_observed(model, decoding_modules(model, family) if family.skipped else None)
    if why is not None:
        return why
    why = names.why_rebound(names.watched(model, module, family, FAMILIES.values()))
    if why is not None:
        return why
    if family.auto:
        # proven per recording, from what it ran (`verdict.py`); here the shared sources a replay relies on must be
        # the ones read, and every module's class transformers' own (or one of torch's own on the list), with no
        # instance-level override
        if not matches("piecewise shared sources"):
            return "transformers' shared sources (masks, cache updates) are not the ones read"
        why = default_deny.why_unread(model, None)
    elif not matches(f"piecewise forward ({name})"):
        return f"transformers' {name} sources are not the ones read"
    else:
        # default-deny: every module's class read and digested (or one of torch's own on the list), and the torch
        # functions the forward's code looks up torch's own (`default_deny.py`)
        why = default_deny.why_unread(model, sources_of(f"piecewise forward ({name})"),
                                      decoding_modules(model, family) if family.skipped else None)
    if why is not None:
        return why
    why = default_deny.why_foreign_functions(names.watched_functions(model, module))
    if why is not None:
        return why
    # after default-deny: every layer is then transformers' own class, holding its attention where the family says
    why = _why_not_attention(family.attentions(base, config), config)
    if why is not None:
        return why
    return _why_not_device(model)


def _why_not_attention(modules, config) -> str | None:
    """Why a replay cannot call the attention of `modules` (the attention modules the forward is cut at) as their
    forward calls it (`proof/attention.py`): the forward computes it inline (no call to cut at), the layers' classes differ,
    or the function the implementation looks up (eager, sdpa, flex, ...) or its mask function is not transformers'
    own. What the function does (soft-capping, dropout, a slice of the mask) runs at every replay as in stock: the
    scalars it is handed are recorded and compared (`staleness.py`), training mode keeps the forward eager."""
    if not modules or any(type(module) is not type(modules[0]) for module in modules):
        return "attention modules of several classes"
    cut, why = attention.cut_of(type(modules[0]))
    return why or attention.why_not(cut, getattr(config, "_attn_implementation", None), modules)


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
        why = why_global_hooks() or (_why_observed_decoding(model) if any(map(len, graphs.hook_tables)) else None)
    else:
        # a module's `__dict__` edited to the same size (an attribute deleted, an override set): the snapshot compares
        # sizes only, so the proof's tests of each module's `__dict__` are asked again
        why = _why_observed_decoding(model) or default_deny.why_instances(model)
    if why is not None:
        return why
    return _why_not_device(model)


def _why_observed_decoding(model) -> str | None:
    """`why_observed` of the modules a decode step runs (a hand-read encoder-decoder's encoder left out)."""
    base = base_of(model)
    family = FAMILIES.get(type(base).__name__) if base is not None else None
    return why_observed(model, decoding_modules(model, family) if family is not None and family.skipped else None)


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
