"""Issue 31's user modules for the usage fuzzer (drawn by usage_module_draws.py, run by usage_runner.py): code of the
user's own inside the model, which a recording of the forward would bake in.

`install(sc, model, device)` builds the scenario's `user_module` on a model built for the run and returns a `User`
handle (None when none is drawn): `before(turn)` applies the turn's `module_before` change between calls,
`around(turn)` is the context the call runs in (peft's `disable_adapter()`), `apply(op)` is a change made mid-call by a
`module_op` processor or criterion (`op_callback`), `observe()` is what the user sees after each call (recorded
activations, counters, host-read values, settings, peft's adapter state, what each change did), and `close()` puts the
process back (torch's backend settings, the module globals). Forms (`form`):
- `wrapper`: a repeng-style ControlModule holding a decoder layer / MLP / norm / attention and adding a steering
  vector; `forwards_attrs` False: it does not forward attribute access (`layer.self_attn` fails on it);
- `hook`: a forward hook or pre-hook adding the vector, its strength in the hook's state (scheduled by its call count
  when `stateful`);
- `subclass`: a subclass of the transformers class of an MLP / attention / norm / activation, reading the module
  global `SUB_GAIN`, swapped in with `module.__class__ = Sub` (at install when `start`, or by a change);
- `state`: a steering module reading a module global (`KNOB`), a per-forward step counter, a dict or a list of
  settings, or a hand-written LoRA on a projection switched by a private `_enabled` flag;
- `recorder`: activations appended to a list (copied, or the tensors themselves: `keep` `ref`), by a hook, a wrapper,
  or a pre-hook keeping the layer's keyword tensors (positions, masks);
- `backend`: one of torch's kernel settings (`BACKEND`) set at install or between / during calls;
- `host_read`: a steering module reading its activation on the host (`.item()` or `bool(tensor)`) each forward,
  counting its calls;
- `peft`: real peft LoRA adapters (usage_peft.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import LogitsProcessor, StoppingCriteria

import usage_peft
import usage_user_classes as classes
from usage_user_classes import ControlModule, ForwardingControl, HandLoRA, HostRead, Recording, Steer, \
    _first, _steer, subclass_of
from usage_mutators import shaped

def _get_deterministic():
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())


def _set_deterministic(value):
    on, warn = value if isinstance(value, (tuple, list)) else (value, True)
    torch.use_deterministic_algorithms(bool(on), warn_only=bool(warn))


def _attr(owner, name):
    return (lambda: getattr(owner, name)), (lambda v: setattr(owner, name, v))


_MATMUL, _CUDNN, _CUDA = torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.cuda
def _read(get):
    """A setting as the user reads it, or the error its getter raises (torch refuses `get_float32_matmul_precision`
    once the legacy and the new fp32-precision APIs disagree: seed 31396), compared like any other reading."""
    try:
        return get()
    except RuntimeError as error:
        return ("raises", type(error).__name__)


BACKEND = {  # name: (getter, setter, values drawn)
    "tf32": (*_attr(_MATMUL, "allow_tf32"), (True, False)),
    "bf16_reduced": (*_attr(_MATMUL, "allow_bf16_reduced_precision_reduction"), (False, True)),
    "fp16_reduced": (*_attr(_MATMUL, "allow_fp16_reduced_precision_reduction"), (False, True)),
    "matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision,
                         ("high", "medium", "highest")),
    "cudnn_tf32": (*_attr(_CUDNN, "allow_tf32"), (False, True)),
    "cudnn_benchmark": (*_attr(_CUDNN, "benchmark"), (True, False)),
    "cudnn_deterministic": (*_attr(_CUDNN, "deterministic"), (True, False)),
    "cudnn_enabled": (*_attr(_CUDNN, "enabled"), (False, True)),
    "deterministic": (_get_deterministic, _set_deterministic, ((True, True), (False, False))),
    "flash_sdp": (_CUDA.flash_sdp_enabled, _CUDA.enable_flash_sdp, (False, True)),
    "math_sdp": (_CUDA.math_sdp_enabled, _CUDA.enable_math_sdp, (False, True)),
    "mem_efficient_sdp": (_CUDA.mem_efficient_sdp_enabled, _CUDA.enable_mem_efficient_sdp, (False, True)),
}
if hasattr(_MATMUL, "allow_fp16_accumulation"):  # (torch 2.7+)
    BACKEND["fp16_accumulation"] = (*_attr(_MATMUL, "allow_fp16_accumulation"), (True, False))
BACKEND_NAMES = ("tf32", "bf16_reduced", "fp16_reduced", "matmul_precision", "cudnn_tf32", "cudnn_benchmark",
                 "cudnn_deterministic", "cudnn_enabled", "deterministic", "flash_sdp", "math_sdp",
                 "mem_efficient_sdp", "fp16_accumulation")  # (drawn from this fixed tuple: draws do not depend on torch)


# --- where the modules go -----------------------------------------------------------------------------------------------
def _layers(model):
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith(("layers", ".h")):
            return module
    raise LookupError("no decoder layers")


# (the names after the first ones found: the found families' (usage_dimensions.FOUND_FAMILIES), each tried after
# every name a family read by hand has, so their modules are placed as before: GPT-NeoX's `attention` and its
# `query_key_value`, OLMo 2's and EXAONE 4's norms after the attention only; the latent-attention families'
# (usage_dimensions.LATENT_FAMILIES) projection that decompresses the cached latents, inside their `expand_kv`)
_NAMES = {"mlp": ("mlp",), "norm": ("input_layernorm", "ln_1", "post_attention_layernorm"),
          "attn": ("self_attn", "attn", "attention"), "act": ("act_fn", "act", "activation_fn"),
          "proj": ("q_proj", "qkv_proj", "c_attn", "query_key_value", "kv_b_proj"),
          "mlp_proj": ("up_proj", "gate_up_proj", "c_fc")}


def place(model, target, layer):
    """(parent, attribute name, module) of `target` in decoder layer `layer`."""
    layers = _layers(model)
    block = layers[layer % len(layers)]
    if target == "layer":
        return layers, str(layer % len(layers)), block
    parent = block
    if target in ("act", "mlp_proj"):
        parent = block.mlp if target == "act" else block.mlp
    elif target == "proj":
        parent = next(getattr(block, name) for name in _NAMES["attn"] if hasattr(block, name))
    for name in _NAMES[target]:
        if name in parent._modules:
            return parent, name, parent._modules[name]
    raise LookupError(f"no {target} in {type(block).__name__}")


def _vector(model, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    hidden = model.config.hidden_size
    return (torch.randn(hidden, generator=g) * 0.5).to(device=model.device, dtype=model.dtype)


# --- the handle -------------------------------------------------------------------------------------------------------
class User:
    def __init__(self, spec, model, device):
        classes.KNOB = 1.0
        classes.SUB_GAIN["value"] = 0.25
        self.spec, self.model, self.device = spec, model, device
        self.saved = {name: get() for name, (get, _, _) in BACKEND.items()}
        self.log = []  # per change: (op, what it did or the exception it raised)
        self.module = None  # the installed module (wrapper, steering, recorder, host read, LoRA)
        self.hooks = []  # [handle, state]
        self.kept = []  # the pre-hook recorder's kept tensors
        self.peft = None
        self.where = None  # (parent, name, original module) where a module was put
        form = spec["form"]
        target, layer = spec.get("target", "layer"), spec.get("layer", 0)
        if form == "peft":
            self.peft = usage_peft.Adapters(spec, model)
            self.model = self.peft.model
            return
        if form == "backend":
            if spec.get("start"):
                self._backend(spec["setting"], spec["value"])
            return
        if form == "subclass":
            self.where = place(model, target, layer)
            self.sub = subclass_of(type(self.where[2]))
            if spec.get("start"):
                self.where[2].__class__ = self.sub
            return
        if form == "hook" or (form == "recorder" and spec.get("via") in ("hook", "pre_kwargs")):
            self._hook(target, layer)
            return
        parent, name, original = self.where = place(model, "proj" if spec.get("store") == "flag" else target, layer)
        vector, strength = _vector(model, layer), spec.get("strength", 1.0)
        if form == "wrapper":
            cls = ForwardingControl if spec.get("forwards_attrs", True) else ControlModule
            self.module = cls(original, vector, strength)
        elif form == "state" and spec["store"] == "flag":
            self.module = HandLoRA(original)
        elif form == "state":
            self.module = Steer(original, vector, strength, spec["store"])
        elif form == "recorder":
            self.module = Recording(original, vector, spec.get("keep", "copy"))
        elif form == "host_read":
            self.module = HostRead(original, vector, strength, spec.get("read", "item"))
        else:
            raise ValueError(form)
        self.module.train(original.training)  # (a new nn.Module is in training mode; the user wraps an eval model)
        parent._modules[name] = self.module

    def _hook(self, target, layer):
        s = self.spec
        module = place(self.model, target, layer)[2]
        state = {"calls": 0, "strength": s.get("strength", 1.0), "seen": []}
        vector = _vector(self.model, layer)
        if self.spec["form"] == "recorder" and s.get("via") == "pre_kwargs":
            def keep(mod, args, kwargs):
                state["calls"] += 1
                self.kept.append([(k, v) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)])
            handle = module.register_forward_pre_hook(keep, with_kwargs=True)
        elif self.spec["form"] == "recorder":
            def record(mod, args, out):
                h = _first(out)
                state["calls"] += 1
                state["seen"].append(h.detach().clone() if s.get("keep", "copy") == "copy" else h)
            handle = module.register_forward_hook(record)
        elif s.get("kind") == "pre":
            def pre(mod, args, kwargs):
                state["calls"] += 1
                strength = state["strength"] * (1 + state["calls"] % 3 if s.get("stateful") else 1)
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": _steer(kwargs["hidden_states"], vector, strength)}
                if args:
                    return (_steer(args[0], vector, strength),) + tuple(args[1:]), kwargs
                return None
            handle = module.register_forward_pre_hook(pre, with_kwargs=True)
        else:
            def post(mod, args, out):
                state["calls"] += 1
                strength = state["strength"] * (1 + state["calls"] % 3 if s.get("stateful") else 1)
                return _steer(out, vector, strength)
            handle = module.register_forward_hook(post)
        self.hooks.append([handle, state])

    def _backend(self, name, value):
        if name not in BACKEND:
            self.log.append(("backend", name, "not in this torch"))
            return
        BACKEND[name][1](value)

    # the changes ---------------------------------------------------------------------------------------------------
    def before(self, turn):
        if turn.get("module_before"):
            self.apply(turn["module_before"])

    @contextlib.contextmanager
    def around(self, turn):
        """The call's context: `with model.disable_adapter():` for a peft turn that asks (what entering it raised, with
        the active adapter deleted, is logged and the call made without it, in both runs)."""
        if turn.get("module_ctx") != "disable_adapter" or self.peft is None:
            yield
            return
        cm = self.model.disable_adapter()
        try:
            cm.__enter__()
        except Exception as exc:  # noqa: BLE001
            self.log.append(("disable_adapter", f"{type(exc).__name__}: {exc}"))
            yield
            return
        try:
            yield
        finally:
            cm.__exit__(None, None, None)

    def apply(self, op):
        try:
            self.log.append((op["op"], self._apply(op)))
        except Exception as exc:  # noqa: BLE001 - what a change raised is observed (both runs make the same change)
            self.log.append((op["op"], f"{type(exc).__name__}: {exc}"))

    def _apply(self, op):
        what, value = op["op"], op.get("value")
        if self.peft is not None:
            return self.peft.apply(op)
        if what == "backend":
            self._backend(op["setting"], value)
        elif what == "strength":
            if self.hooks:
                self.hooks[0][1]["strength"] = value
            elif self.module is not None:
                self.module.strength = value
        elif what == "vector":
            with torch.no_grad(), torch.inference_mode(False):
                if self.module is not None and hasattr(self.module, "vector"):
                    self.module.vector.mul_(value)
        elif what == "unwrap":
            parent, name, original = self.where
            parent._modules[name] = original
        elif what == "rewrap":
            parent, name, _ = self.where
            parent._modules[name] = self.module
        elif what == "remove_hook":
            for handle, _ in self.hooks:
                handle.remove()
        elif what == "add_hook":
            self._hook(self.spec.get("target", "layer"), self.spec.get("layer", 0) + 1)
        elif what == "swap":
            self.where[2].__class__ = self.sub
        elif what == "unswap":
            self.where[2].__class__ = self.sub.__mro__[1]
        elif what == "gain":
            classes.SUB_GAIN["value"] = value
        elif what == "knob":
            classes.KNOB = value
        elif what == "reset_counter":
            self.module.steps = 0
        elif what == "toggle":
            self.module._enabled = not self.module._enabled
        elif what == "dict_set":
            self.module.settings[op["key"]] = value
        elif what == "list_edit":
            if op.get("key") == "append":
                self.module.schedule.append(value)
            elif op.get("key") == "clear":
                self.module.schedule.clear()
            elif self.module.schedule:
                self.module.schedule[0] = value
        elif what == "clear":
            for seen in [getattr(self.module, "seen", None), self.kept] + [st["seen"] for _, st in self.hooks]:
                if seen is not None:
                    seen.clear()
        elif what == "threshold":
            self.module.threshold = value
        else:
            raise ValueError(what)
        return "done"

    # what the user sees ----------------------------------------------------------------------------------------------
    def observe(self):
        out = {"log": list(self.log), "knob": classes.KNOB, "gain": classes.SUB_GAIN["value"]}
        out["backend"] = {name: _read(get) for name, (get, _, _) in BACKEND.items()}
        m = self.module
        if m is not None:
            out["module"] = {k: getattr(m, k) for k in ("strength", "steps", "calls", "threshold", "_enabled")
                             if k in vars(m)}
            for k in ("settings", "schedule", "values"):
                if k in vars(m):
                    out["module"][k] = list(getattr(m, k).items()) if k == "settings" else list(getattr(m, k))
            if hasattr(m, "seen"):
                out["seen"] = [t.detach().clone() for t in m.seen]
        out["hooks"] = [(st["calls"], st["strength"], [t.detach().clone() for t in st["seen"]])
                        for _, st in self.hooks]
        out["kept"] = [[(k, v.detach().clone()) for k, v in kws] for kws in self.kept]
        if self.where is not None:
            out["class"] = type(self.where[2]).__name__
        if self.peft is not None:
            out["peft"] = self.peft.observe()
        return out

    def close(self):
        for name, (_, setter, _) in BACKEND.items():
            setter(self.saved[name])
        for handle, _ in self.hooks:
            handle.remove()
        classes.KNOB = 1.0
        classes.SUB_GAIN["value"] = 0.25


def install(sc, model, device):
    spec = sc.get("user_module")
    if not spec:
        return None
    torch.manual_seed(10_000 + sc["seed"])  # (LoRA weights: the same in both runs; the scenario's seed is set after)
    return User(spec, model, device)


class ModuleOp:
    """A processor or criterion making the change `spec["op"]` to the user module at its call `at`."""

    def __init__(self, spec, ctx):
        self.spec, self.ctx, self.calls = spec, ctx, 0

    def _tick(self):
        call, self.calls = self.calls, self.calls + 1
        user = getattr(self.ctx, "user", None)
        if call == self.spec["at"] and user is not None:
            user.apply(self.spec["op"])

    def observe(self):
        return ("module_op", self.spec["op"]["op"], self.calls)


class ModuleOpProc(ModuleOp, LogitsProcessor):
    def __call__(self, input_ids, scores):
        self._tick()
        return scores


class ModuleOpCrit(ModuleOp, StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        self._tick()
        return shaped(torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device), self.spec)


def op_callback(spec, ctx, role):
    return (ModuleOpCrit if role == "criterion" else ModuleOpProc)(spec, ctx)
