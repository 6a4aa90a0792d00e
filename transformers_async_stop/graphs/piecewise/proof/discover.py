"""A transformers causal LM's layout, found from the model itself: the family a hand read would have written down.

`family.Family` names where a family keeps its decoder layers and their attention modules (the modules whose
forward calls the cache update and the attention function, between which a recording cuts the pieces), and the
modeling module whose globals the forward looks up. For a family no one read, `family_for` finds them:
- the model's class is transformers' own `<Prefix>ForCausalLM`, defined in `transformers.models.<x>.modeling_<x>`
  under its name, and its base model (`base_model_prefix`) is a class of the same module;
- the decoder layers: the one `ModuleList` of the base model as long as `config.num_hidden_layers`;
- each layer's attention: its one child module whose class name ends in `Attention` (of several, the self-attention:
  `self_attn`, `attn`...), under the same attribute in every layer.
What it finds is checked again by the recording: each layer's attention must call the cache update and the attention
function once, in order, with this module (`recorder._Recorder`); anything else is not recordable, named.
"""

from __future__ import annotations

import sys
import weakref

import torch

from .names import code_names

_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model class -> (Family | None, why)
_SELF_ATTENTION = frozenset(("self_attn", "attn", "attention", "self_attention"))


def family_for(model, family_type, watched_globals):
    """(the model's `family_type` instance, None) or (None, why none was found). Remembered per model class."""
    cls = type(model)
    try:
        found = _FOUND.get(cls)
    except TypeError:
        found = None
    if found is not None and found[0] is not None:
        return found
    found = _find(model, family_type, watched_globals)
    if found[0] is not None:
        try:
            _FOUND[cls] = found
        except TypeError:
            pass
    return found


def _find(model, family_type, watched_globals):
    cls = type(model)
    module_name = cls.__module__
    module = sys.modules.get(module_name)
    if not (module_name.startswith("transformers.models.") and module_name.rpartition(".")[2].startswith("modeling_")
            and getattr(module, cls.__name__, None) is cls and cls.__name__.endswith("ForCausalLM")):
        return None, f"model family {cls.__name__} not proven (not a transformers causal LM class)"
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if not isinstance(base, torch.nn.Module) or base is model or type(base).__module__ != module_name:
        return None, f"model family {cls.__name__} not proven (no base model of its module)"
    config = model.config
    count = getattr(config, "num_hidden_layers", None)
    lists = [(name, child) for name, child in base.named_modules()
             if type(child) is torch.nn.ModuleList and len(child) == count and name]
    if len(lists) != 1:
        return None, f"model family {cls.__name__} not proven ({len(lists)} lists of {count} decoder layers)"
    layers_name, layers = lists[0]
    names = {name for name, child in layers[0].named_children() if type(child).__name__.endswith("Attention")}
    if len(names) > 1:
        # a decoder with cross-attention too (Whisper's `encoder_attn`): the self-attention is the one that calls the
        # cache update at every step; a cross-attention that runs makes the recording fail, named
        names &= _SELF_ATTENTION
    if len(names) != 1:
        return None, f"model family {cls.__name__} not proven ({len(names)} attention modules per layer)"
    attention = names.pop()
    if not all(isinstance(getattr(layer, attention, None), torch.nn.Module) for layer in layers):
        return None, f"model family {cls.__name__} not proven (a layer without its {attention!r})"
    base_forward = getattr(type(base), "forward", None)
    family = family_type(
        name=getattr(config, "model_type", None) or cls.__name__, module=module_name, causal_lm=cls.__name__,
        layers=layers_name, attention=attention,
        rotary="rotary_emb" if isinstance(getattr(base, "rotary_emb", None), torch.nn.Module) else None,
        watched=tuple(name for name in dict.fromkeys((*watched_globals, *(
            name for name in vars(module) if name.startswith("create_") and name.endswith("_mask"))))),
        checks_padding=base_forward is not None and "warn_if_padding_and_no_attention_mask" in code_names(
            base_forward),
        windows_by_layer_type=bool(getattr(config, "layer_types", None)),
        auto=True,
    )
    return family, None
