"""What a model's recordings were made from, compared before every replay (`ModelGraphs.changed`), and the per-model
store of recordings (`graphs_of`).

A replay repeats what its recording's one run of the forward's Python read: the modules and their classes, every
parameter and buffer (its object, its storage's address, its shape, stride and dtype), the plain attributes of the
modules and of the configs they hold (containers by their contents), the torch names the forward looks up, the
ModuleLists' lengths and the modules' `__dict__` sizes. Any of these changed since the recording (between calls, or by
user code mid-call) makes every recording of the model stale: `forward.PiecewiseForward` drops them, proves the model
again and records anew, as stock's next forward reads the new state. Each comparison is one C-level map over flat
lists made at the snapshot (a few tens of microseconds a step for a 1B model).
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import operator
import threading
import types
import weakref

import torch

from .proof import kernels
from .proof.callables import CallableState

_STORE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STORE_LOCK = threading.Lock()
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_ATOMS = (str, int, float, bool, bytes, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_PLAIN_TABLES = (dict, collections.OrderedDict)
# the objects found under a name whose code state is followed (`proof/callables.py`)
_FOLLOWED = (types.FunctionType, types.MethodType, functools.partial, property, classmethod, staticmethod)
# the fallback's geometry (`_guard` without torch's tensor guard): shape and dtype in one C-level getter, stride apart
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")

try:
    # torch's C++ tensor check (dynamo's guards): dtype, device, requires_grad, dispatch keys, and the sizes and
    # strides given, of a list of tensors in one C call (about one `data_ptr` map: the two maps of shapes and strides
    # it replaces cost twice that); private, so a torch without it keeps the maps
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover (torch builds without dynamo)
    _TensorGuards = None


_SEEN_MAX = 64  # K-token keys counted towards their second sighting (the count starts again beyond)


def _NO_MODEL():  # `ModelGraphs.root` before any snapshot
    return None


class ModelGraphs:
    """One model's recordings, and the state of the model they were made from (no reference to the model itself)."""

    def __init__(self):
        self.recordings: collections.OrderedDict = collections.OrderedDict()
        self.failed: dict = {}  # key -> why its recording failed (not tried again while the model is unchanged)
        self.pool = None
        self.seen: collections.Counter = collections.Counter()  # K-token keys -> sightings before their recording
        # key -> the ops of a first recording not kept, of a family proven per recording (`forward._unproven`): the
        # next recording of the key must run the same; kept across `clear` (no recording kept means a clear at each)
        self.first_runs: dict = {}
        self._reset()

    def sighting(self, key) -> int:
        """Count one more sighting of a K-token key not recorded yet; the sightings so far, this one included."""
        seen = self.seen
        if len(seen) >= _SEEN_MAX and key not in seen:
            seen.clear()  # bounded: a schedule drifting across widths starts counting again
        seen[key] += 1
        return seen[key]

    def _reset(self) -> None:
        self.entries: list = []  # (owner dict, name, object): every submodule, parameter and buffer as recorded
        self.functions: list = []  # (namespace, name, object): the torch names the replayed Python looks up
        # the code of every function the replay skips, and the callables it holds (`proof/callables.py`)
        self.code_roots: list = []
        self.code = CallableState(())
        self.impls = self.impls_size = self.impls_copy = None
        self.host_tensors: list = []
        self.host_values: list = []
        self._functions: list = []  # `functions` by their namespace's type: (its `get`, three lists)
        self._columns: tuple = ([], [], [])  # `entries` as three lists
        self.root, self.root_class = _NO_MODEL, None  # the model (a weak reference) and its class, as recorded
        self.modules: list = []  # every other module of the model as recorded, and its class (`module.__class__ = X`)
        self.classes: list = []
        self.tensors: list = []  # every parameter and buffer (and tensor attribute), and its storage's address
        self.pointers: list = []
        self.shapes: list = []  # (shape, dtype) and stride of each, as recorded (`guards` compares them in one call)
        self.strides: list = []
        self.guards = None  # inference mode on -> torch's tensor guard over `tensors`, or None (the maps compare)
        self.lists: list = []  # the children tables of the model's ModuleLists, and their lengths as recorded
        self.lengths: list = []
        self.dicts: list = []  # every module's `__dict__`, and its size as recorded
        self.sizes: list = []
        self.contents: list = []  # the list/tuple/dict/set attributes of modules and configs, and deep copies
        self.copies: list = []
        # the last call's per-step watch lists (`PiecewiseForward._watch`), for the next call of an unchanged model
        self.watched = None
        # every module's `__dict__` and its children, parameter and buffer tables, whole: their sizes, keys and values
        # as proven (`same_instances`, once per call of an unchanged model), and the hook tables among those values
        self.instances: list = []
        self.instance_sizes: list = []
        self.instance_keys: list = []
        self.instance_values: list = []
        self.hook_tables: list = []

    def clear(self) -> None:
        # `seen` stays: it counts the widths a caller asks for, which a stale model does not change
        self.recordings.clear()
        self.failed.clear()
        self.pool = None
        self._reset()

    def snapshot(self, model, functions, code_roots) -> None:
        """The model's state now, before its first recording (`proof.hand_over` gives `functions`, the torch names
        and internals the replayed Python looks up, and `code_roots`, the functions and callables whose code state is
        compared)."""
        entries, tensors = [], []
        # the model itself by a weak reference: this store is the value of a `WeakKeyDictionary` keyed by the model,
        # and a strong one here would keep the model, its weights and its graph pool alive for good (red team hole 4)
        self.root, self.root_class = weakref.ref(model), type(model)
        every = list(model.modules())
        self.modules = every[1:]
        self.classes = list(map(type, self.modules))
        for module in every:
            for name, child in module._modules.items():
                entries.append((module._modules, name, child))
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    entries.append((table, name, tensor))
                    if tensor is not None:
                        tensors.append(tensor)
            # `module.compile()` (a criterion's, mid-call) sets this private field: stock's next call of the module
            # runs the compiled code, which the recording never ran (proof/default_deny.py refuses a compiled module)
            entries.append((module.__dict__, "_compiled_call_impl", module.__dict__.get("_compiled_call_impl")))
            # the hook tables as objects: the per-step check reads the tables it found (`PiecewiseForward._watch`), so
            # one replaced by another (`m._forward_hooks = OrderedDict(...)`) would go unseen
            entries += [(module.__dict__, name, module.__dict__.get(name)) for name in _HOOK_TABLES]
        attributes, config_dicts, config_classes = _attribute_entries(model)
        entries += attributes
        # a tensor held as a plain attribute (a weight swapped in with `del m.weight; m.weight = t`) is read by the
        # replay at its recorded address, as a parameter is: `t.data = x` keeps the object and moves its storage
        tensors += [value for _, _, value in attributes if type(value) in _TENSORS]
        # each once (tied weights: the embedding's is the LM head's; torch's tensor guard refuses a tensor twice)
        tensors = list({id(tensor): tensor for tensor in tensors}.values())
        self.entries, self.tensors = entries, tensors
        # a container edited in place (`config.layer_types[0] = ...`, red team hole R10) is the same object: its
        # contents are compared, with a deep copy (a list inside a dict), where they are plain values (`==` of
        # anything else, a tensor, may not say equal, or may raise)
        self.contents = [value for _, _, value in attributes if type(value) in _CONTAINERS and _plain(value)]
        self.copies = copy.deepcopy(self.contents)
        # a module appended to a ModuleList (GPT-2's forward runs every block of `self.h`) adds a key, which the
        # entries above (the children as recorded) cannot show
        self.lists = [module._modules for module in every if type(module) is torch.nn.ModuleList]
        self.lengths = list(map(len, self.lists))
        # an attribute added to a module's `__dict__` (red team holes R5b, R14b: an instance function shadowing a
        # method, an unregistered module shadowing a child, set mid-call): the model is proven again
        # a field added to a config (`config.is_causal = False` set by a processor: stock's next forward reads it, a
        # replay keeps what the recording read; red team hole 1 of the verify forward) likewise
        self.dicts = [module.__dict__ for module in every] + config_dicts
        # and the class tables along the method order of every module class: an attribute set on a class (an
        # `_call_impl`, a property shadowing an instance attribute) is what stock's next call runs, and no rebound name
        # names it (red team of the proof-once cut, hole 1)
        self.dicts += [vars(klass) for klass in dict.fromkeys(
            klass for cls in {self.root_class, *self.classes} for klass in cls.__mro__ if klass is not object)]
        # the configs' classes too: every config read goes through `PreTrainedConfig.__getattribute__`, which reads
        # the class (its `attribute_map`, a property set on it): an attribute added there, or one rebound, is what
        # stock's next forward reads (red team of the proof pipeline, hole 6)
        config_tables = [vars(klass) for klass in dict.fromkeys(
            klass for cls in config_classes for klass in cls.__mro__ if klass is not object)]
        self.dicts += config_tables
        config_entries = [(table, name, value) for table in config_tables for name, value in table.items()]
        self.contents += [table["attribute_map"] for table in config_tables
                          if type(table.get("attribute_map")) is dict and _plain(table["attribute_map"])]
        self.copies = copy.deepcopy(self.contents)
        self.sizes = list(map(len, self.dicts))
        # the torch names the replayed Python looks up, and torch's module internals every module call runs
        # (`Module._call_impl`, `__getattr__`...: rebound mid-call, stock's later steps run the new code)
        self.functions = list(functions) + config_entries
        # and the code behind every name a replay skips, with the callables held as plain attributes of the modules
        # (a `functools.partial` activation set on a module: its keywords are compared, issue 43 hole 5)
        # (and torch's own Python functions among those names: their code replaced in place is what stock runs, red
        # team of the proof pipeline, hole 1)
        self.code_roots = [*(value for value in code_roots if type(value) in _FOLLOWED),
                           *(value for _, _, value in self.functions if type(value) in _FOLLOWED),
                           *(value for _, _, value in attributes if callable(value)
                             and not isinstance(value, (torch.nn.Module, torch.Tensor)))]
        self.code = CallableState(self.code_roots, every)
        # the kernels registered through `torch.library` (`proof/kernels.py`): one registered or taken out after the
        # recording is what stock's next forward runs (red team of the proof pipeline, holes 5 and 7)
        self.impls = kernels.registrations()
        self.impls_size = len(self.impls) if self.impls is not None else None
        self.impls_copy = frozenset(self.impls) if self.impls is not None else None
        # a CPU tensor a CUDA model's forward reads (a 0-dim scale set as an attribute) is read on the host at the
        # capture, as a scalar: its value is baked in, so its value is compared (a CPU model's replay reads it anew)
        device = next((tensor.device for tensor in tensors if tensor.device.type != "cpu"), None)
        self.host_tensors = [tensor for tensor in tensors if tensor.device.type == "cpu"] if device else []
        self.host_values = [tensor.detach().clone() for tensor in self.host_tensors]
        self._columns = _columns(entries)
        # a module's dict or a class's (a mappingproxy): each kind's own `get`, mapped from C
        kinds: dict = {}
        for entry in self.functions:
            kinds.setdefault(type(entry[0]), []).append(entry)
        self._functions = [(kind.get, *_columns(group)) for kind, group in kinds.items()]
        # a storage moved (`.to()`, `.data =` to new memory) changes the address a replay reads; a geometry changed on
        # the same storage (`w.data = w.data[:32]`, `w.data = w.data.t()` on a square weight: red team hole R2) keeps
        # it, and the replay would keep the recorded shape and stride
        self.pointers = list(map(torch.Tensor.data_ptr, tensors))
        self.shapes = list(map(_SHAPE_DTYPE, tensors))
        self.strides = list(map(torch.Tensor.stride, tensors))
        self.guards = _guard(tensors, self.shapes, self.strides)
        instances = [table for module in every for table in (
            module.__dict__, module._modules, module._parameters, module._buffers)]
        # torch's own tables only (a user's mapping put in place of one iterates with its own code): any other keeps
        # the proof's walk at every call
        self.instances = instances if all(type(table) in _PLAIN_TABLES for table in instances) else []
        self.hook_tables = [table for module in every for name in _HOOK_TABLES
                            if (table := module.__dict__.get(name)) is not None]
        # taken here only, right after the proof and before the first recording; not after a recording: an edit
        # landing while it ran (another thread's) was proven by no one (red team of the issue-38 cuts, hole 1), and a
        # table the recording's own forward changed walks at every call instead
        self.instance_sizes = list(map(len, self.instances))
        self.instance_keys = list(_chain(self.instances))
        self.instance_values = list(_chain(map(dict.values, self.instances)))

    def registrations_changed(self) -> bool:
        """The kernels registered through `torch.library` are not the set of the snapshot (asked once per call: a
        registration taken out and another made between two calls leaves the count `changed` compares)."""
        return self.impls is not None and self.impls != self.impls_copy

    def same_instances(self) -> bool:
        """Every module's `__dict__`, and its children, parameter and buffer tables, hold the very keys and values
        they held as proven (`snapshot`): identity only, no `==` (a value's `__eq__` is user code, or a
        tensor's elementwise compare). With the same keys in the same order and the same objects, each table is the
        one proven, so the module tree, its attributes, overrides and hook tables are too
        (`proof.admission.why_not_again` asks this once per call instead of walking every module's `__dict__` with the
        proof's tests). A few hundred microseconds for a 1B model: once per call, not per step."""
        tables = self.instances
        if not tables or list(map(len, tables)) != self.instance_sizes:
            return False
        try:
            return not (any(map(operator.is_not, _chain(tables), self.instance_keys))
                        or any(map(operator.is_not, _chain(map(dict.values, tables)), self.instance_values)))
        except RuntimeError:  # a table resized while compared (another thread): not the one proven
            return False

    def watch(self, entries, registries, functions=()) -> None:
        """Compare these too before every replay, until the next snapshot: the names the code a proven recording ran
        looks up ((namespace dict, name, object), `proof/verdict.py`) and the registries it read (by their contents),
        and the code state of the functions among them and in the registries (`proof/callables.py`). Asked for a
        recording kept, and for one whose proof failed (a change to what it ran tries it again)."""
        # each kept recording of the model adds what it ran; one entry per (namespace, name): the per-step compare
        # does not grow with the number of recordings
        seen = {(id(table), name) for table, name, _ in self.functions}
        fresh = [entry for entry in entries if (id(entry[0]), entry[1]) not in seen
                 and not seen.add((id(entry[0]), entry[1]))]
        self.functions = self.functions + fresh
        kinds: dict = {}
        for entry in self.functions:
            kinds.setdefault(type(entry[0]), []).append(entry)
        self._functions = [(kind.get, *_columns(group)) for kind, group in kinds.items()]
        for registry in registries:
            if not any(registry is seen for seen in self.contents):
                self.contents.append(registry)
                self.copies.append(dict(registry.items()))
        # the functions among the names (their code state; a name is any the code mentions, an attribute's too, so
        # other objects under them are compared by identity only), the registries' functions, and the functions and
        # globals the verdict found the run calling (`proof/verdict.py`)
        roots = [value for _, _, value in fresh if type(value) in _FOLLOWED]
        roots += [value for registry in registries for value in registry.values() if callable(value)]
        known = {id(root) for root in self.code_roots}
        roots += [function for function in functions if id(function) not in known]
        if roots:
            self.code_roots = self.code_roots + roots
            # the model's own modules (the model by its weak reference: this store must not keep it alive)
            self.code = CallableState(self.code_roots, [self.root(), *self.modules])

    def changed(self) -> bool:
        # checked before every replay: C-level maps over the flat lists (a few tens of microseconds for a 1B model)
        tables, names, values = self._columns
        if any(map(operator.is_not, map(dict.get, tables, names), values)):
            return True
        for get, tables, names, values in self._functions:
            if any(map(operator.is_not, map(get, tables, names), values)):
                return True
        root = self.root()
        if root is None or type(root) is not self.root_class or list(map(type, self.modules)) != self.classes:
            return True  # a class swapped under the recording (`module.__class__ = Subclass`)
        if list(map(len, self.lists)) != self.lengths:
            return True  # a module added to a ModuleList
        if list(map(len, self.dicts)) != self.sizes:
            return True  # an attribute added to a module
        if self.contents != self.copies:
            return True  # a config's list or dict edited in place
        if self.code.changed():
            return True  # a function's code, defaults or closure, or a partial's arguments (issue 43, holes 4, 5)
        if self.impls is not None and len(self.impls) != self.impls_size:
            return True  # a kernel registered or taken out through `torch.library`
        if self.host_tensors and not all(map(torch.equal, self.host_tensors, self.host_values)):
            return True  # a host scalar the capture read, edited in place
        tensors = self.tensors
        if list(map(torch.Tensor.data_ptr, tensors)) != self.pointers:
            return True
        guards = self.guards
        if guards is not None:
            # the guard made under the running inference mode (its dispatch keys are part of what it compares)
            try:
                return not guards[torch.is_inference_mode_enabled()].check(*tensors)
            except Exception:  # noqa: BLE001 (a private API: whatever it cannot check, the maps below compare)
                self.guards = None
        return list(map(_SHAPE_DTYPE, tensors)) != self.shapes or list(map(torch.Tensor.stride, tensors)) != self.strides


_chain = itertools.chain.from_iterable


def _guard(tensors, shapes, strides):
    """{inference mode on: torch's `TensorGuards` over `tensors`, made under that mode}, each checked to pass now; None
    where torch has none or it does not take these tensors (`ModelGraphs.changed` then maps shapes and strides). Its
    dtype, device, requires_grad and dispatch-key comparisons are stricter than needed: such a change records again."""
    if _TensorGuards is None:
        return None
    sizes = [list(shape) for shape, _ in shapes]
    strides = list(map(list, strides))
    guards = {}
    try:
        for inference in (False, True):
            with torch.inference_mode(inference):
                guard = _TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
                if guard.check(*tensors) is not True:
                    return None
            guards[inference] = guard
    except Exception:  # noqa: BLE001 (a private API: another torch's signature keeps the maps)
        return None
    return guards


def _plain(value) -> bool:
    """`value` holds only strings, numbers, booleans, None and containers of those (compared by `==`)."""
    if type(value) in _ATOMS:
        return True
    if type(value) in (list, tuple, set, frozenset):
        return all(map(_plain, value))
    if type(value) is dict:
        return all(map(_plain, value)) and all(map(_plain, value.values()))
    return False


def _columns(entries) -> tuple:
    """(dict, name, value) triples as three lists, for the per-step C-level maps."""
    return tuple(map(list, zip(*entries))) if entries else ([], [], [])


def _attribute_entries(model) -> list:
    """(dict, name, value) for every plain attribute a forward may read and a replay has baked in: each module's own
    (a norm's epsilon, an attention's scaling, the rotary embedding's attention scaling; torch's private fields, named
    with "_", excluded) and every field of the configs the modules hold (`self.config.num_hidden_layers`...). User
    code that rebinds one, between calls or from a criterion mid-call, makes the recordings stale, as stock reads the
    new value at its next forward. Compared by identity (a rebinding to an equal value only records again), and
    containers also by their contents (`ModelGraphs.contents`). Also the configs' `__dict__`s (a field added)."""
    entries, configs, seen, dicts, classes = [], {}, set(), [], []
    for module in model.modules():
        table = module.__dict__
        for name, value in table.items():
            if not name.startswith("_"):
                entries.append((table, name, value))
        config = table.get("config")
        if config is not None and hasattr(config, "__dict__"):
            configs[id(config)] = config
    while configs:  # the configs, and the sub-configs they hold (a text config)
        key, config = configs.popitem()
        if key in seen:
            continue
        seen.add(key)
        table = config.__dict__
        dicts.append(table)
        classes.append(type(config))
        for name, value in table.items():
            entries.append((table, name, value))
            if type(value).__module__.startswith("transformers") and hasattr(value, "to_dict"):
                configs[id(value)] = value
    return entries, dicts, classes


def graphs_of(model) -> ModelGraphs:
    """The model's recordings, kept in a `WeakKeyDictionary` whose values hold no reference to it: freed with it."""
    with _STORE_LOCK:
        graphs = _STORE.get(model)
        if graphs is None:
            graphs = _STORE[model] = ModelGraphs()
        return graphs
