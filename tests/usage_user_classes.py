"""The user modules of issue 31's usage-fuzzer dimension (usage_modules.py installs and changes them): a repeng-style
ControlModule (with and without attribute forwarding), steering modules whose strength comes from a module global,
a step counter, a dict or a list, a host-reading module, an activation recorder, a hand-written LoRA switched by a
private flag, and user subclasses of transformers' classes reading a global."""

from __future__ import annotations

import functools

import torch
from torch import nn

KNOB = 1.0  # the module global a `state: global` module reads (set by the `knob` change; reset at install)
SUB_GAIN = {"value": 0.25}  # what the `subclass` classes read



def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _map_first(out, fn):
    """`out` with `fn` applied to its hidden states (a tensor, or the first item of a tuple: an attention's output)."""
    if isinstance(out, tuple):
        return (fn(out[0]),) + out[1:]
    if isinstance(out, list):
        return [fn(out[0])] + out[1:]
    return fn(out) if isinstance(out, torch.Tensor) else out


def _steer(out, vector, strength):
    if not strength:
        return out
    return _map_first(out, lambda h: h + strength * vector.to(h.dtype))


# --- the modules ------------------------------------------------------------------------------------------------------
class ControlModule(nn.Module):
    """repeng's ControlModule: holds a block, adds `strength * vector` to its output. Attribute access is not forwarded
    (a caller reading `layer.self_attn` through it fails, as with repeng's)."""

    def __init__(self, block, vector, strength):
        super().__init__()
        self.block = block
        self.register_buffer("vector", vector)
        self.strength = strength

    def scale(self):
        return self.strength

    def forward(self, *args, **kwargs):
        return _steer(self.block(*args, **kwargs), self.vector, self.scale())


class ForwardingControl(ControlModule):
    """A ControlModule forwarding unknown attributes to the block (so `layer.self_attn`, `layer.attention_type` work)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)


class Steer(ForwardingControl):
    """A steering module whose strength comes from state: the module global KNOB, a per-forward step counter, a dict
    of settings or a list of per-step strengths."""

    SCHEDULE = (0.0, 0.5, 1.0, -0.5)

    def __init__(self, block, vector, strength, store):
        super().__init__(block, vector, strength)
        self.store = store
        self.steps = 0
        self.settings = {"strength": strength, "on": True}
        self.schedule = [strength, 0.0, -strength]

    def scale(self):
        step, self.steps = self.steps, self.steps + 1
        if self.store == "global":
            return self.strength * KNOB
        if self.store == "counter":
            return self.strength * self.SCHEDULE[step % len(self.SCHEDULE)]
        if self.store == "dict":
            return self.settings["strength"] if self.settings["on"] else 0.0
        if self.store == "list":
            return self.schedule[step % len(self.schedule)] if self.schedule else 0.0
        raise ValueError(self.store)


class HostRead(ForwardingControl):
    """Reads its block's output on the host each forward (`.item()` or `bool(tensor)`) and steers by it."""

    def __init__(self, block, vector, strength, read):
        super().__init__(block, vector, strength)
        self.read = read
        self.threshold = 0.0
        self.calls = 0
        self.values = []

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        self.calls += 1
        h = _first(out)
        if self.read == "item":
            value = float(h.float().mean().item())
            self.values.append(value)
            on = value > self.threshold
        else:
            on = bool(h.float().mean() > self.threshold)
            self.values.append(on)
        return _steer(out, self.vector, self.strength if on else -self.strength)


class Recording(ForwardingControl):
    """Appends its block's output (a copy, or the tensor itself) to `seen`, and changes nothing."""

    def __init__(self, block, vector, keep):
        super().__init__(block, vector, 0.0)
        self.keep = keep
        self.seen = []

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        h = _first(out)
        self.seen.append(h.detach().clone() if self.keep == "copy" else h)
        return out


class HandLoRA(nn.Module):
    """A hand-written LoRA around a projection (nn.Linear or GPT-2's Conv1D), switched by a private `_enabled`."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        weight = base.weight
        fan_in = getattr(base, "in_features", None) or weight.shape[0]
        fan_out = getattr(base, "out_features", None) or weight.shape[1]
        self.lora_a = nn.Parameter(torch.randn(rank, fan_in, dtype=weight.dtype, device=weight.device) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(fan_out, rank, dtype=weight.dtype, device=weight.device) * 0.3)
        self._enabled = True

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    def forward(self, x):
        y = self.base(x)
        if self._enabled:
            y = y + (x @ self.lora_a.t()) @ self.lora_b.t()
        return y


@functools.lru_cache(maxsize=None)
def subclass_of(base):
    """A user subclass of transformers' `base` class whose forward scales its output by 1 + SUB_GAIN (a global)."""

    def forward(self, *args, **kwargs):
        out = base.forward(self, *args, **kwargs)
        return _map_first(out, lambda h: h * (1.0 + SUB_GAIN["value"]))

    return type("User" + base.__name__, (base,), {"forward": forward, "__module__": __name__})
