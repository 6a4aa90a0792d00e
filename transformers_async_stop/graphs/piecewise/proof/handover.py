"""Stage 4 of the proof: the set of things to watch, handed over to the replays.

A replay is sound only for the code the proof saw run and for the state that code can read. Everything of it that
user code can change after the proof is compared before every replay, in one of two places:

- `WatchSet.why_eager()`, per step, what sends the rest of the call to the eager forward: a hook added to a module
  or globally, a `forward` set on an instance, a module whose forward reads it put in training mode (torch's Linear,
  Embedding, norms and activations left in training mode by `resize_token_embeddings` compute the same), a name
  the replay skips rebound since this process first saw it (`names.watched`), an attention function (looked up
  under the step's implementation) or a mask function that is not transformers' own (`attention.why_not`), a torch
  function or dispatch mode active;
- `staleness.ModelGraphs.changed()`, per step, what makes the model's recordings stale (they are dropped, the model
  is proven again and recorded anew): the modules, their classes, parameters, buffers and attributes, the configs,
  the torch names the replayed Python looks up (`functions`), the names the code that ran looks up and the registries
  it read (each verdict's, `ModelGraphs.watch`), and the code itself (`callables.CallableState`: every watched
  function's `__code__`, defaults, keyword defaults and closure cells, and the state of the partials it holds).

`WatchSet(model, family)` takes the first from the model as it is now, and names the functions whose code state
the snapshot takes (`functions`). A check added here, or in `ModelGraphs.changed`, guards every replay.
"""

from __future__ import annotations

import collections
import copy
import itertools
import operator
import sys

import torch

from .. import steps
from . import attention, default_deny, names
from .family import FAMILIES, base_of, decoding_modules

_TRAINING = operator.attrgetter("training")
_PLAIN_TABLES = (dict, collections.OrderedDict)


class WatchSet:
    """What the per-step checks read, from the model as it is now (see the module docstring). Kept with the model's
    recordings for its next call (`ModelGraphs.watched`) without the model itself (the store is keyed by the model,
    weakly: red team hole 4): `bind` puts the model's own entries back."""

    def __init__(self, model, family):
        base = base_of(model)
        self.family = family
        self.modules = family.attentions(base, model.config)  # the attention modules, in the replay's order
        # the modules a decode step runs: an encoder-decoder's encoder ran once, before the decode steps (as in stock),
        # and no decode step runs it, so its hooks, wrapped forward or training mode change no step
        every = decoding_modules(model, family)
        tables = [table for module in every for table in _hook_tables(module)]
        # torch's own tables (dict / OrderedDict, whose truth is their length): `any` tests them without a call each;
        # a table of another type (a user's mapping) keeps the per-table `len`
        self.plain_hook_tables = all(type(table) in _PLAIN_TABLES for table in tables)
        rebound = names.watched(model, sys.modules[type(base).__module__], family, FAMILIES.values())
        self.rebound = tuple(map(list, zip(*rebound))) if rebound else ([], [], [])
        # the key's dtype is this module's weight's, read at each step (`get_input_embeddings()` itself costs
        # microseconds: transformers' lookup goes through failed attribute reads). A replaced embedding module is a
        # replaced child, which `ModelGraphs.changed` finds before any replay
        self.embeddings = model.get_input_embeddings()
        # the model's own entries (the first of `every` and of the module dicts, its four hook tables) are left out:
        # `bind` puts them back in a copy for one call
        self._tables, self._dicts = tables[4:], [module.__dict__ for module in every[1:]]
        # the modules whose training mode the forward reads (torch's Linear, Embedding, norms and activations do not)
        self._rest = [module for module in every[1:] if type(module) not in default_deny.TRAINING_FREE]
        self.model = self.hook_tables = self.module_dicts = self.every = None

    def bind(self, model) -> "WatchSet":
        """This set for one call of `model` (a copy holding the model; the set itself holds none)."""
        bound = copy.copy(self)
        bound.model = model
        bound.hook_tables = [*_hook_tables(model), *self._tables]
        bound.plain_hook_tables = self.plain_hook_tables and all(
            type(table) in _PLAIN_TABLES for table in bound.hook_tables[:4])
        bound.module_dicts = [model.__dict__, *self._dicts]
        bound.every = [model, *self._rest]
        return bound

    def why_eager(self) -> str | None:
        """Why the rest of the call runs eagerly (None: it may replay)."""
        hooks = torch.nn.modules.module
        tables = self.hook_tables
        if (any(tables) if self.plain_hook_tables else any(map(len, tables))) or (
                hooks._global_forward_pre_hooks or hooks._global_forward_hooks):
            return "a hook was added"
        if any(map(operator.contains, self.module_dicts, itertools.repeat("forward"))):
            return "a forward was wrapped"
        if any(map(_TRAINING, self.every)):
            return "training mode"
        owners, attrs, first = self.rebound
        if any(map(operator.is_not, map(getattr, owners, attrs), first)):
            return names.why_rebound(zip(owners, attrs, first))
        # the attention function each replay calls eagerly for every layer, looked up under the step's implementation
        # (part of the recording key: one set mid-call records again), and the mask function its masks come from:
        # transformers' own (`attention.why_not`; red team Q6)
        cut, why = attention.cut_of(type(self.modules[0]))
        why = why or attention.why_not(cut, getattr(self.model.config, "_attn_implementation", None), self.modules)
        if why is not None:
            return why
        return steps.why_mode()

    def functions(self) -> list:
        """The functions whose code state the snapshot compares (`callables.CallableState`): every object the
        replay skips under a watched name."""
        return list(self.rebound[2])


def attention_function(modules, impl):
    """The attention function a replay calls for `modules` (the model's attention modules) under `impl`, looked up as
    their forward looks it up (`attention.function`)."""
    cut, _ = attention.cut_of(type(modules[0]))
    return attention.function(cut, impl, type(modules[0])) if cut is not None else None


def _hook_tables(module) -> tuple:
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
            getattr(module, "_backward_pre_hooks", {}))
