"""Where a decode forward calls its attention, the function a replay calls there, and how a recording intercepts it.

A recording cuts the forward between each layer's cache update and its attention, and every replay runs the attention
eagerly between the pieces, with the arguments the recording kept (`graphs.py`). So the attention's kernel choice,
its soft-capping, its dropout (off outside training: the forward passes `dropout=0.0`, and training mode sends every
step to the eager forward), its slice of the mask by the key length, whatever the implementation does, is stock's at
every step: it is stock's function, called with this step's query, keys, values and mask. What the recording bakes in
is only where the call is and which scalars it takes. Where the call is (a `Cut`, per attention class):

- **function** (every family of transformers 5.x): the attention module's `forward` looks its function up in its
  modeling module's `ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation`, with the module's own eager function
  (`eager_attention_forward`, a module global) as the default: `get_interface(impl, eager_attention_forward)`. Every
  implementation transformers registers ("sdpa", "flex_attention", "flash_attention_2", ...) is the registry's entry;
  "eager" is the module's function unless someone registered an "eager". A replay looks it up the same way, with
  the same call (`function`);
- **method** (GPT-J up to 5.23): the forward calls a method of the attention module itself, `self._attn(query, key,
  value, attention_mask)`. A replay calls the class's method with the module (an instance-level `_attn` keeps the
  forward eager, `why_not`);
- none: the attention is computed inline in the module's `forward` (BLOOM, MPT, Falcon): there is no call to cut the
  forward at, and the model keeps its eager forward, named.

A cut may also have a **derivation** (`Cut.derive`): a method of the attention module that the forward calls on the
cache update's results, whose own results are the attention's keys and values. Multi-head latent attention
(DeepSeek-V2/V3, GLM-4-MoE-lite, MiniCPM3, Mistral 4 and the other families with an `expand_kv`) caches its compressed
latents and decompresses them after the update, over the whole grown cache (`self.expand_kv(kv_nope, k_rot)`): a
shape that grows every step, so no piece can hold it. A recording runs it eagerly (as the attention), after a
piece of its own holding the forward's fixed-shape ops between the update and that call (the query's concatenation);
every replay calls the class's method, looked up then, on the keys and values the replay's update returned. The
recorder checks the data flow by identity: the method gets exactly the update's results, and the attention exactly
the method's (`recorder._Recorder.derive`).

A cut may also have a **bias** (`Cut.bias`): a method of the attention module that the forward calls after the cache
update, with host lengths, to make a position bias the attention gets as `position_bias=` (T5's `compute_bias(1,
key_length, device=..., past_seen_tokens=...)`, in layer 0 only; the stack hands its result to every later layer).
Its shape grows with the cache, so no piece can hold it: a recording runs it eagerly, checking that it got the host
lengths stock's forward has (the query's length, the grown cache layer's, the cache's before the update) and that
each attention's `position_bias` is its result by identity; every replay calls the class's method, looked up then,
with the step's lengths (`recorder._Recorder.bias`, `recording.Recording.replay`).

A recording replaces exactly the object that lookup finds (the registry entry, the module global or the class's
method) with an interceptor for the length of the recording (`swapped`): a forward that looks its attention up another
way never reaches the interceptor, and the recording fails, named. Every replay looks the function up again, and the
per-step checks (`why_not`) keep the forward eager where it is not transformers' own (a user's function rebound or
registered: stock would run it too, but user code there could change what the rest of the step reads, which the
recording baked in), or where the mask function the implementation's masks come from is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref

from .. import steps
from .default_deny import transformers_own
from .names import code_names

FUNCTION, METHOD = "function", "method"
# the attention module's methods that compute the attention for its `forward` (GPT-J's, up to 5.23)
_METHODS = ("_attn",)
# the attention module's methods that derive the attention's keys and values from the cache update's results
_DERIVATIONS = ("expand_kv",)
# the attention module's methods that make the position bias the attention gets, after the cache update (T5's)
_BIASES = ("compute_bias",)
_REGISTRY = "ALL_ATTENTION_FUNCTIONS"


@dataclasses.dataclass(frozen=True)
class Cut:
    """Where an attention class's `forward` calls its attention."""

    kind: str  # FUNCTION or METHOD
    # FUNCTION: the modeling module's global the forward hands `get_interface` as its default (None: it names none);
    # METHOD: the method's name
    name: str | None
    module: str  # the module whose globals the forward runs with (where a FUNCTION's registry and default are)
    # the method deriving the attention's keys and values from the cache update's results (None: the attention gets
    # the update's results themselves)
    derive: str | None = None
    # the method making the attention's position bias from host lengths after the cache update (None: it has none)
    bias: str | None = None


_CUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention class -> (Cut | None, why)


def cut_of(cls) -> tuple[Cut | None, str | None]:
    """(where `cls.forward` calls its attention, None), or (None, why there is no such call). Remembered per class."""
    try:
        found = _CUTS.get(cls)
    except TypeError:
        found = None
    if found is None:
        found = _find_cut(cls)
        try:
            _CUTS[cls] = found
        except TypeError:
            pass
    return found


def _find_cut(cls) -> tuple[Cut | None, str | None]:
    forward = getattr(cls, "forward", None)
    inner = forward
    while hasattr(inner, "__wrapped__"):  # `deprecate_kwarg`'s wrapper: the globals are the wrapped function's
        inner = inner.__wrapped__
    table = getattr(inner, "__globals__", None)
    if forward is None or table is None:
        return None, f"{cls.__name__} has no forward of its own code"
    names = code_names(forward)
    module = table.get("__name__", "")
    derive = next((name for name in _DERIVATIONS if name in names and callable(getattr(cls, name, None))), None)
    bias = next((name for name in _BIASES if name in names and callable(getattr(cls, name, None))), None)
    if _REGISTRY in names and _REGISTRY in table:
        # the default `get_interface` is handed: the module's eager function (its name varies: `eager_attention_
        # forward`, `simple_eager_attention_forward`...); one found among the names the forward looks up
        defaults = sorted(name for name in names if name.endswith("attention_forward") and "eager" in name
                          and callable(table.get(name)))
        return Cut(FUNCTION, defaults[0] if len(defaults) == 1 else None, module, derive, bias), None
    for name in _METHODS:
        if name in names and callable(getattr(cls, name, None)):
            return Cut(METHOD, name, module, derive, bias), None
    return None, (f"the attention is computed inside {cls.__name__}.forward, not by an attention function: no point "
                  "to cut the forward at")


def function(cut: Cut, impl, cls):
    """The function the forward of an attention module of class `cls` calls under `impl` now, looked up as the forward
    looks it up, as `function(module, query, key, value, mask, **kwargs)`; None where the forward would find none (an
    implementation not registered: its `get_interface` raises)."""
    if cut.kind == METHOD:
        return getattr(cls, cut.name, None)
    module = sys.modules.get(cut.module)
    registry = getattr(module, _REGISTRY, None)
    if registry is None or not _plain_impl(impl):
        return None
    default = getattr(module, cut.name, None) if cut.name is not None else None
    if not hasattr(registry, "get_interface"):  # before `get_interface` (4.57, 5.0): the forward's own two lines
        return default if impl == "eager" else registry.get(impl)
    try:
        return registry.get_interface(impl, default)
    except KeyError:
        return None


def derivation(cls, name: str | None):
    """The cut's method `name` a replay calls (its `derive` on the update's results, its `bias` on host lengths),
    looked up on the class as the forward's `self.<name>(...)` finds it (an instance-level one keeps the forward
    eager: `why_not`); None where the cut has none."""
    return getattr(cls, name, None) if name is not None else None


def _reads_registry(registry, impl: str) -> bool:
    """Whether the forward's lookup under `impl` finds the registry's entry (else the module's eager function).
    `get_interface` reads a registered entry, "eager" included; before it (4.57, 5.0) the forward took its eager
    function for "eager" and `ALL_ATTENTION_FUNCTIONS[impl]` for anything else."""
    if hasattr(registry, "get_interface"):
        return impl in registry
    return impl != "eager"


def _plain_impl(impl) -> bool:
    # None makes `get_interface` log a warning, and a "paged|" one runs over a paged cache (never a DynamicCache)
    return type(impl) is str and not impl.startswith("paged|")


def why_not(cut: Cut, impl, modules) -> str | None:
    """Why a replay may not call the attention of `modules` (the model's attention modules, in order) under `impl`
    now (None: it may). Asked before the call is recorded (`admission.py`) and at every step (`handover.py`)."""
    if not _plain_impl(impl):
        return f"attention implementation {impl!r}"
    cls = type(modules[0])
    attention = function(cut, impl, cls)
    if attention is None:
        return f"no attention function for {impl!r}"
    if not transformers_own(attention):
        # each replay calls it eagerly for every layer: user code there could change what the rest of the step reads,
        # which the recording baked in (red team Q6)
        if cut.kind == METHOD:
            return f"{cls.__name__}.{cut.name} is not transformers' own"
        return f"an attention function for {impl} that is not transformers' own"
    if cut.kind == METHOD and any(cut.name in vars(module) for module in modules):
        return f"an instance-level {cut.name} on an attention module"
    for name in (cut.derive, cut.bias):
        if name is None:
            continue
        # each replay calls it eagerly (for every layer; the bias for its layer), as the attention: stock's code, or
        # the forward stays eager
        derive = derivation(cls, name)
        if derive is None or not transformers_own(derive):
            return f"{cls.__name__}.{name} is not transformers' own"
        if any(name in vars(module) for module in modules):
            return f"an instance-level {name} on an attention module"
    if impl == "sdpa":
        if not steps.own_sdpa_mask():
            # stock's `create_causal_mask` calls the mask function registered for "sdpa" at every step; a replay's
            # one-token mask is the one `steps.attention_mask` worked out for transformers' own
            return "a mask function registered for sdpa"
    elif not steps.own_mask(impl):
        # every replay makes the masks with stock's mask functions (`masks.mask_call`), which call it
        return f"a mask function for {impl} that is not transformers' own"
    return None


@contextlib.contextmanager
def swapped(cut: Cut, impl, cls, intercept):
    """The object the attention's lookup finds under `impl` (the registry's entry, the module's default function, the
    class's method) replaced by `intercept(original)` for a recording; restored whatever happens. A registration or
    rebinding by another thread meanwhile stays (red team hole 3): only the interceptor is undone."""
    if cut.kind == METHOD:
        with swapped_attribute(cls, cut.name, intercept):
            yield
        return
    module = sys.modules[cut.module]
    registry = getattr(module, _REGISTRY)
    if _reads_registry(registry, impl):
        with swapped_entry(registry, impl, intercept):
            yield
    else:  # the lookup returns its default, the module's eager function
        with swapped_attribute(module, cut.name, intercept):
            yield


@contextlib.contextmanager
def swapped_derivation(cls, name: str | None, intercept):
    """The class's method `name` (the cut's `derive` or `bias`) replaced by `intercept(original)` for a recording;
    restored whatever happens. None (the cut has no such method): nothing is swapped."""
    if name is None:
        yield
        return
    with swapped_attribute(cls, name, intercept):
        yield


@contextlib.contextmanager
def swapped_entry(registry, impl: str, intercept):
    """`registry`'s entry `impl` replaced by `intercept(original)` in its local mapping, which the lookup reads
    first; restored whatever happens."""
    local = registry._local_mapping
    had, before = impl in local, local.get(impl)
    mine = local[impl] = intercept(registry[impl])
    try:
        yield
    finally:
        if local.get(impl) is mine:
            if had:
                local[impl] = before
            else:
                local.pop(impl, None)


@contextlib.contextmanager
def swapped_attribute(owner, name: str, intercept):
    """`owner.name` replaced by `intercept(original)` for a recording; restored whatever happens (another thread's
    rebinding meanwhile stays: only the interceptor is undone)."""
    had, before = name in vars(owner), vars(owner).get(name)
    mine = intercept(getattr(owner, name))
    setattr(owner, name, mine)
    try:
        yield
    finally:
        if vars(owner).get(name) is mine:
            if had:
                setattr(owner, name, before)
            else:
                delattr(owner, name)
