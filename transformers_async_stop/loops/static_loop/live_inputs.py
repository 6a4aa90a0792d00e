"""Whether code inside the forward may keep the tensors it is fed, so that the loop's in-place inputs must not be used.

The static loop feeds every decode step's forward the same input tensors, rewritten in place (`inputs.StepInputs`);
stock feeds new ones each step. Code that keeps a reference to what it was fed (a logging module, a wrapper saving
activations) would see its kept tensors change: such a model gets stock's per-step inputs. Registered hooks are
found by `loop._hooked`; this finds the rest that can run user code inside the forward, once per call:
- an instance-level `forward` (`layer.forward = wrapper`) that is not accelerate's own device hook (its
  `AlignDevicesHook` and kin move inputs between devices and keep none of them);
- a module whose class is neither transformers' nor torch's own (a user `nn.Module` subclass, remote code).
"""

from __future__ import annotations

_OWN = ("transformers.", "torch.")


def why_fresh(model) -> str | None:
    """Why the forward must get stock's new input tensors each step (a reason for `last_path()`), or None."""
    for module in model.modules():
        if "forward" in vars(module) and not _accelerate_hook(module):
            return "a module has an instance-level forward: stock's per-step inputs"
        if not type(module).__module__.startswith(_OWN):
            return f"the model holds a user module ({type(module).__qualname__}): stock's per-step inputs"
    return None


def _accelerate_hook(module) -> bool:
    """Whether the instance `forward` is the one accelerate's `add_hook_to_module` set, with only accelerate's own
    hooks (a user `ModelHook` subclass may keep its inputs)."""
    forward = vars(module)["forward"]
    func = getattr(forward, "func", None)  # `functools.partial(new_forward, module)`
    hook = getattr(module, "_hf_hook", None)
    if getattr(func, "__module__", None) != "accelerate.hooks" or hook is None:
        return False
    hooks = getattr(hook, "hooks", None) if type(hook).__name__ == "SequentialHook" else (hook,)
    return hooks is not None and all(type(h).__module__.startswith("accelerate.") for h in hooks)
