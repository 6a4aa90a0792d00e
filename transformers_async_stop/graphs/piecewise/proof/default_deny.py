"""Default-deny: the graphed forward replays only code the package has read.

A recording runs the forward's Python once; every replay repeats what that one run did. Python the package has not
read (a user module, a peft LoRA layer, a steering wrapper, a subclass, a monkeypatched torch function) may decide
something per call or per step (a global knob, a step counter, an `_enabled` flag, an adapter switch, a host read)
that a replay would bake in, silently. So a module is replayed only when its class is proven, and every other model
keeps its eager forward, with the module named in `last_path().forward`:

- **transformers' own classes, read and digested**: the class is the one its transformers module defines under its
  name, and every `forward` / `__call__` along its method order is a source of the family's shortcut
  (`targets/piecewise_rows.py`, "piecewise forward (<family>)"), or of a helper shortcut read with it (the
  gradient-checkpointing layer's `__call__`), whose digests match the installed release (`verified.matches`);
- **torch's own leaf and container modules** on a short list (`TORCH_MODULES`), of exactly that class: their forward
  is a fixed composition of ops on the module's parameters, and the code of every `forward` / `__call__` /
  `_call_impl` involved is torch's own file (`_torch_code`), not a user's replacement;
- **no instance-level override**: no `forward`, `_call_impl` or `_wrapped_call_impl` in a module's `__dict__`, and no
  compiled call (`module.compile()` sets `_compiled_call_impl`).

The torch functions and tensor methods the forward's code looks up by name (`names.watched_functions`) must be
torch's own objects too (`why_foreign_functions`): one rebound before the first call would otherwise be recorded as
if it were torch's.

What the forward reads from the state of proven modules (their attributes, the configs, parameters and buffers, the
class of every module) is compared before every replay (`staleness.ModelGraphs.changed`); what a setting of torch's
decides is part of the recording key (`settings.py`).
"""

from __future__ import annotations

import os
import sys
import types
import weakref

import torch

from ....release_checks.verified import matches
from ....undo.module_state import real_path

# torch modules whose forward the families use, each a fixed composition of ops over the module's own parameters
# (Dropout: an identity outside training mode, which steps aside). Exact classes only: a subclass is user code.
TORCH_MODULES = frozenset((torch.nn.Linear, torch.nn.Embedding, torch.nn.ModuleList, torch.nn.Dropout,
                           torch.nn.LayerNorm,
                           # activations: one functional op on the input (OPT's `activation_fn`, ACT2FN's "relu")
                           torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Identity))
# the modules of that list whose forward never reads `self.training` (Dropout does): one left in training mode
# (`resize_token_embeddings` makes new Embedding and Linear modules, in training mode) computes what it computes in
# eval mode
TRAINING_FREE = TORCH_MODULES - {torch.nn.Dropout}
# transformers' helper sources read with every family (present on some releases only: `matches` says where)
HELPER_SHORTCUTS = ("piecewise layer call (gradient checkpointing)",)
_METHODS = ("forward", "__call__")
# what a module call runs besides `forward`: `__call__` -> `_wrapped_call_impl` -> `_call_impl`, `__getattr__` for
# every submodule, parameter and buffer the forward reads (`self.q_proj`), and a ModuleList's iteration and slicing
# (GPT-2 runs `for block in self.h`, Llama `self.layers[: n]`: a patched `__iter__` may skip layers by a knob)
_MODULE_INTERNALS = ("__call__", "_call_impl", "_wrapped_call_impl", "forward", "__getattr__", "__getattribute__",
                     "__iter__", "__getitem__", "__len__")
# torch's internals a transformers class never defines: one set on it is user code in every call of its modules
_NOT_TRANSFORMERS = ("_call_impl", "_wrapped_call_impl", "__getattr__", "__getattribute__")
_INSTANCE_OVERRIDES = ("forward", "_call_impl", "_wrapped_call_impl")
_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_TRANSFORMERS_DIR = os.path.realpath(os.path.dirname(__import__("transformers").__file__)) + os.sep


def why_unread(model, family_sources, decoding=None) -> str | None:
    """The first module of `model` that is not proven (see the module docstring), as a reason; None: all are. The
    family's sources are named in `family_sources`; their digests are checked by the caller (`verified.matches`).
    `family_sources` None (a family found by `discover.py`): any `forward` / `__call__` of transformers' own
    code, each proven by what a recording runs of it (`verdict.py`). `decoding`: the modules a decode step may run
    (`family.decoding_modules`: an encoder-decoder's encoder left out), None: every module."""
    helpers = _helper_sources()
    verdicts: dict = {}
    kept = None if decoding is None else set(map(id, decoding))
    for name, module in model.named_modules(remove_duplicate=False) if kept is not None else model.named_modules():
        if kept is not None and id(module) not in kept:
            continue
        cls = type(module)
        why = verdicts.get(cls, "")
        if why == "":
            why = verdicts[cls] = _why_class(cls, family_sources, helpers)
        if why is None:
            why = _why_instance(module, cls)
        if why is not None:
            where = name or "the model"
            return f"{where} ({cls.__module__}.{cls.__qualname__}): {why}"
    return None


def why_instances(model) -> str | None:
    """`why_unread`'s checks of each module's own `__dict__` alone (its classes proven before): asked again at each
    call of a model whose recordings' snapshot is unchanged (`admission.why_not_again`), as the snapshot compares a
    `__dict__`'s size, not which names it holds (red team of the proof-once cut, hole 2)."""
    for name, module in model.named_modules():
        why = _why_instance(module, type(module))
        if why is not None:
            cls = type(module)
            return f"{name or 'the model'} ({cls.__module__}.{cls.__qualname__}): {why}"
    return None


def _why_instance(module, cls) -> str | None:
    table = module.__dict__
    why = next((f"an instance-level {attr}" for attr in _INSTANCE_OVERRIDES if attr in table), None)
    if why is None:
        # red team hole R5b: an instance attribute shadowing a method of its class (`norm._norm = f`)
        why = next((f"an instance-level {attr}" for attr, value in table.items()
                    if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor))
                    and _function_of(getattr(cls, attr, None)) is not None), None)
    if why is None:
        # a module kept out of `_modules` (`object.__setattr__(layer, "mlp", wrapper)`) is found by the
        # forward's `self.mlp` before the registered child, and `named_modules()` never lists it
        why = next((f"an unregistered module in its {attr!r}" for attr, value in table.items()
                    if isinstance(value, torch.nn.Module)), None)
    if why is None and table.get("_compiled_call_impl") is not None:
        why = "a compiled module (module.compile())"
    return why


def classes_read(classes, family_sources) -> bool:
    """Whether every one of `classes` is proven by the family's read sources (`_why_class`), as `why_unread` proves
    them; False where any is not (a class no one read with the family, or one that is no module of transformers')."""
    helpers = _helper_sources()
    return all(_why_class(cls, family_sources, helpers) is None for cls in classes)


def _helper_sources() -> frozenset:
    from ....release_checks.targets import SHORTCUTS

    return frozenset(source for shortcut in SHORTCUTS if shortcut.name in HELPER_SHORTCUTS
                     and matches(shortcut.name) for source in shortcut.sources)


def _why_class(cls, family_sources, helpers) -> str | None:
    if cls in TORCH_MODULES:
        return _why_torch_class(cls)
    module = sys.modules.get(cls.__module__)
    if not cls.__module__.startswith("transformers.") or getattr(module, cls.__name__, None) is not cls:
        return "not a module the graphed forward has read"
    for klass in cls.__mro__:
        if klass is object:
            continue
        if klass.__module__.startswith("torch."):
            why = _why_torch_class(klass) if klass in TORCH_MODULES or klass is torch.nn.Module else (
                "a torch class the graphed forward has not read")
            if why is not None:
                return why
            continue
        for attr in _METHODS:
            if attr in vars(klass):
                source = f"{klass.__module__}:{klass.__qualname__}.{attr}"
                if family_sources is not None and source not in family_sources and source not in helpers:
                    return f"its {klass.__qualname__}.{attr} is not a source the graphed forward has read"
        for attr in _NOT_TRANSFORMERS:
            if attr in vars(klass):
                return f"its {klass.__qualname__}.{attr} is not a source the graphed forward has read"
        # red team hole R5b: a helper the digested forward calls (`Gemma3RMSNorm._norm`) or a property it reads,
        # replaced on the class by code outside transformers' files (`PreTrainedModel` and its mixins, which this
        # package patches and whose methods no forward calls, left out)
        for attr, value in ([] if _model_base(klass) else vars(klass).items()):
            function = _function_of(value)
            if function is not None and not _transformers_code(function):
                return f"its {klass.__qualname__}.{attr} is not transformers' own code"
    return None


def transformers_methods(classes) -> list:
    """(class, name) of every function, property and class/static method defined by the transformers classes along the
    method order of `classes`: watched for rebinding before each replay (`names.watched`)."""
    pairs = set()
    for cls in set(classes):
        for klass in cls.__mro__:
            if klass.__module__.startswith("transformers.") and not _model_base(klass):
                # a classmethod is looked up as a new bound method each time: its rebinding is proven per call only
                pairs.update((klass, attr) for attr, value in vars(klass).items()
                             if _function_of(value) is not None and not isinstance(value, classmethod))
    return sorted(pairs, key=lambda pair: (pair[0].__qualname__, pair[1]))


def _model_base(klass) -> bool:
    """`PreTrainedModel`, one of its bases, or a mixin that is no module (generation, hub, ...)."""
    from transformers import PreTrainedModel

    return klass in PreTrainedModel.__mro__ or not issubclass(klass, torch.nn.Module)


def _function_of(value):
    """The function behind a class attribute (a function, a property's getter, a class/static method), or None."""
    if isinstance(value, property):
        value = value.fget
    elif isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    return value if hasattr(value, "__code__") else None


def _transformers_code(function) -> bool:
    """transformers' code, through any decorators of transformers' or torch's (`@torch.no_grad()` on the rotary
    embeddings' forward up to 5.23)."""
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is None or not real_path(code.co_filename).startswith((_TRANSFORMERS_DIR, _TORCH_DIR)):
            return False
        function = getattr(function, "__wrapped__", None)
    return True


# function -> (its code object, `_transformers_code`'s verdict), asked per step; weak keys: a user's attention
# function (a closure over a model, say) is not kept alive by having been asked about
_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def transformers_own(function) -> bool:
    """`function` is transformers' own code (as `_transformers_code`), remembered per function and code object: the
    per-step checks ask it of the cache's `update` and of the attention function registered for "sdpa", which every
    replay calls eagerly (user code there could change what the rest of the step reads; red team Q6)."""
    code = getattr(function, "__code__", None)
    try:
        seen = _OWN.get(function)
    except TypeError:  # not weakly referenceable or unhashable: asked each time
        seen = None
    if seen is not None and seen[0] is code:
        return seen[1]
    verdict = code is not None and _transformers_code(function)
    try:
        _OWN[function] = (code, verdict)
    except TypeError:
        pass
    return verdict


def torch_internals(classes) -> list:
    """(class table, name, object) for torch's module internals (`_MODULE_INTERNALS`) of `torch.nn.Module` and of the
    torch classes among `classes`, as they are now: compared before each replay (`staleness.ModelGraphs.changed`), as
    `why_unread` proves them only before a recording (a criterion rebinding `Module._call_impl` mid-call)."""
    owners = [torch.nn.Module, *(cls for cls in set(classes) if cls in TORCH_MODULES)]
    return [(vars(owner), attr, vars(owner).get(attr)) for owner in owners for attr in _MODULE_INTERNALS]


def _why_torch_class(cls) -> str | None:
    """Every forward / call entry of `cls` and of `torch.nn.Module` is torch's own code."""
    for klass in (cls, torch.nn.Module):
        for attr in _MODULE_INTERNALS:
            function = vars(klass).get(attr)
            if function is not None and not _torch_code(function):
                return f"{klass.__name__}.{attr} is not torch's own"
    return None


def _torch_code(function) -> bool:
    """A Python function (and every function it wraps) whose code lives in torch's own files."""
    while function is not None:
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is None or not real_path(code.co_filename).startswith(_TORCH_DIR):
            return False
        function = getattr(function, "__wrapped__", None)
    return True


def why_foreign_functions(entries) -> str | None:
    """`names.watched_functions` entries (namespace dict, name, object): each must be torch's own object, as torch
    defines it (a Python function in torch's files, or a builtin of that name), or, for `torch.Tensor`'s table, no
    Python override at all (the method of `torch._C.TensorBase`) or torch's own."""
    for table, name, value in entries:
        if value is None and isinstance(table, types.MappingProxyType):
            continue  # `torch.Tensor`'s table: no Python override, the C method of `torch._C.TensorBase`
        if not callable(value) or isinstance(value, (types.ModuleType, type, torch.dtype)):
            continue  # a dtype, a submodule, a class: looked up, not called as an op
        if hasattr(value, "__code__") or hasattr(getattr(value, "__func__", None), "__code__"):
            if _torch_code(value):
                continue
        elif _builtin_of_torch(value, name):
            continue
        elif _torch_descriptor(value):
            continue
        return f"torch's {name} was replaced by code that is not torch's"
    return None


def _builtin_of_torch(value, name: str) -> bool:
    """A builtin of torch's C modules bound under its own name (`torch.special.softmax` is `special_softmax`): not
    another torch builtin put under this name (`F.silu = torch.relu`)."""
    if not isinstance(value, types.BuiltinFunctionType):
        return False
    module = getattr(value, "__module__", None)
    owner = getattr(value, "__self__", None)
    return (str(getattr(value, "__name__", "")).endswith(name)
            and (module is None or module == "torch" or module.startswith("torch."))
            and (owner is None or isinstance(owner, types.ModuleType) and owner.__name__.startswith("torch")
                 or type(owner).__module__.startswith("torch")))


def _torch_descriptor(value) -> bool:
    """A slot wrapper or method descriptor of torch's tensor type (an operator defined in C)."""
    owner = getattr(value, "__objclass__", None)
    return owner is not None and owner.__module__.startswith("torch")
