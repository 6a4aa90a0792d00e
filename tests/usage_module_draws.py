"""Issue 31's `user_module` dimension of a usage scenario (usage_scenarios.py): a module of the user's own inside the
model (usage_modules.py builds and runs it), drawn from its own random stream (seeded by the scenario's seed), so
every field drawn before stays as it was.

Per scenario (a quarter of them, any cache: the dynamic-cache loop and its graphed forward, the static loop):
`user_module` = {"form", ...}: a wrapper, a hook, a subclass, a steering module with state (a global, a counter, a
flag, a dict, a list), an activation recorder, a torch backend setting, a host read, or peft LoRA. Per turn: a change
the caller makes before the call (`module_before`), a `module_op` processor or criterion making one mid-call at its
call `at`, and for peft `module_ctx: disable_adapter` (the call inside `with model.disable_adapter():`).
"""

from __future__ import annotations

import random

from usage_modules import BACKEND_NAMES

RATE = 0.25
FORMS = {"wrapper": 3, "hook": 2, "subclass": 3, "state": 5, "recorder": 2, "backend": 3, "host_read": 2, "peft": 5}
TARGETS = ("layer", "mlp", "norm", "attn")
STORES = ("global", "counter", "flag", "dict", "list")
VALUES = {"matmul_precision": ("high", "medium", "highest"), "deterministic": ([True, True], [False, False])}
# each form's changes: (op, legal mid-call)
OPS = {
    "wrapper": (("strength", True), ("vector", True), ("unwrap", True), ("rewrap", True)),
    "hook": (("strength", True), ("remove_hook", True), ("add_hook", True)),
    "subclass": (("swap", True), ("unswap", True), ("gain", True)),
    "state:global": (("knob", True),),
    "state:counter": (("reset_counter", True),),
    "state:flag": (("toggle", True),),
    "state:dict": (("dict_set", True),),
    "state:list": (("list_edit", True),),
    "recorder": (("clear", True),),
    "backend": (("backend", True),),
    "host_read": (("threshold", True), ("strength", True)),
    "peft": (("set_adapter", True), ("add_adapter", False), ("delete_adapter", False), ("merge", True),
             ("unmerge", True), ("scale", True), ("unscale", True), ("disable_layers", True), ("enable_layers", True)),
}


def _weighted(rng, table):
    kinds = list(table)
    return rng.choices(kinds, weights=[table[k] for k in kinds])[0]


def _key(spec):
    return "state:" + spec["store"] if spec["form"] == "state" else spec["form"]


def _backend_value(rng, name):
    return rng.choice(VALUES.get(name, (True, False)))


def _spec(rng, device):
    form = _weighted(rng, FORMS)
    spec = {"form": form}
    if form in ("wrapper", "hook", "subclass", "state", "recorder", "host_read"):
        spec["layer"] = rng.randrange(2)
        spec["strength"] = rng.choice((0.5, 1.0, 2.0))
    if form == "wrapper":
        spec["target"] = rng.choice(TARGETS)
        spec["forwards_attrs"] = rng.random() < 0.7
    elif form == "hook":
        spec.update(target=rng.choice(TARGETS), kind=rng.choice(("forward", "pre")), stateful=rng.random() < 0.5)
    elif form == "subclass":
        spec.update(target=rng.choice(("mlp", "attn", "norm", "act")), start=rng.random() < 0.5)
    elif form == "state":
        spec.update(store=rng.choice(STORES), target=rng.choice(TARGETS))
    elif form == "recorder":
        spec.update(via=rng.choice(("hook", "wrap", "pre_kwargs")), target=rng.choice(TARGETS),
                    keep=rng.choice(("copy", "ref")))
    elif form == "host_read":
        spec.update(target=rng.choice(("layer", "mlp", "norm")), read=rng.choice(("item", "bool")))
    elif form == "backend":
        name = rng.choice(BACKEND_NAMES)
        spec.update(setting=name, value=_backend_value(rng, name), start=rng.random() < 0.5)
    elif form == "peft":
        spec.update(targets=rng.choice(("attn", "attn_mlp")), second=rng.random() < 0.6)
    return spec


def _op(rng, spec, mid):
    ops = [op for op, legal in OPS[_key(spec)] if legal or not mid]
    op = {"op": rng.choice(ops)}
    what = op["op"]
    if what == "strength":
        op["value"] = rng.choice((0.0, 0.5, -1.0, 3.0))
    elif what == "vector":
        op["value"] = rng.choice((0.0, -1.0, 2.0))
    elif what == "gain":
        op["value"] = rng.choice((0.0, -0.5, 1.0))
    elif what == "knob":
        op["value"] = rng.choice((0.0, -1.0, 2.5))
    elif what == "dict_set":
        op["key"] = rng.choice(("strength", "on"))
        op["value"] = rng.choice((0.0, -1.5, 3.0)) if op["key"] == "strength" else rng.random() < 0.5
    elif what == "list_edit":
        op["key"] = rng.choice(("set", "append", "clear"))
        op["value"] = rng.choice((0.0, 2.0, -1.0))
    elif what == "threshold":
        op["value"] = rng.choice((-10.0, 0.1, 10.0))
    elif what == "backend":
        name = spec["setting"] if rng.random() < 0.7 else rng.choice(BACKEND_NAMES)
        op.update(setting=name, value=_backend_value(rng, name))
    elif what in ("set_adapter", "delete_adapter"):
        op["value"] = rng.choice(("a", "b", "c"))
    elif what == "add_adapter":
        op["value"] = rng.choice(("b", "c"))
    elif what in ("scale", "unscale"):
        op["value"] = rng.choice((0.0, 0.5, 3.0)) if what == "scale" else rng.choice((None, 0.5, 3.0))
    return op


def add(sc: dict, device: str) -> None:
    """Adds the `user_module` dimension to the drawn scenario `sc` (in place), a quarter of the time."""
    rng = random.Random(f"{sc['seed']}/user_module")
    if rng.random() >= RATE:
        return
    spec = sc["user_module"] = _spec(rng, device)
    for turn in sc["turns"]:
        steps = max(turn.get("max_new_tokens", turn.get("max_length_extra", 1)), 1)
        if rng.random() < 0.4:
            turn["module_before"] = _op(rng, spec, mid=False)
        if rng.random() < 0.45:
            role = rng.choice(("processor", "criterion"))
            cb = {"kind": "module_op", "role": role, "at": rng.randint(0, max(steps - 1, 0)),
                  "op": _op(rng, spec, mid=True)}
            key = role + "s" if role == "processor" else "criteria"
            turn[key].insert(rng.randint(0, len(turn[key])), cb)
        if spec["form"] == "peft" and rng.random() < 0.3:
            turn["module_ctx"] = "disable_adapter"


def candidates(sc: dict, variant):
    """Simpler variants along this dimension (for usage_scenarios.shrink)."""
    if "user_module" not in sc:
        return
    yield variant(lambda s: s.pop("user_module"))
    spec = sc["user_module"]
    for key, value in (("start", False), ("stateful", False), ("second", False), ("forwards_attrs", True),
                       ("targets", "attn"), ("target", "layer")):
        if key in spec and spec[key] != value:
            yield variant(lambda s, key=key, value=value: s["user_module"].__setitem__(key, value))
    for i, turn in enumerate(sc["turns"]):
        for key in ("module_before", "module_ctx"):
            if key in turn:
                yield variant(lambda s, i=i, key=key: s["turns"][i].pop(key))


def reached(sc: dict) -> set:
    spec = sc.get("user_module")
    if not spec:
        return set()
    out = {"user_module:" + spec["form"], "user_module:" + _key(spec)}
    for turn in sc["turns"]:
        if "module_before" in turn:
            out.add("user_module:before")
        if "module_ctx" in turn:
            out.add("user_module:ctx")
        if any(c["kind"] == "module_op" for c in turn["processors"] + turn["criteria"]):
            out.add("user_module:mid")
    return out


def every_value() -> set:
    return ({"user_module:" + f for f in FORMS} | {"user_module:state:" + s for s in STORES}
            | {"user_module:before", "user_module:ctx", "user_module:mid"})


def ops_reached(sc: dict) -> set:
    """`form:op` for each change `sc` draws (mid-call ones marked `mid`), for the coverage test."""
    spec = sc.get("user_module")
    if not spec:
        return set()
    out = set()
    for turn in sc["turns"]:
        if "module_before" in turn:
            out.add(f"{_key(spec)}:{turn['module_before']['op']}")
        for c in turn["processors"] + turn["criteria"]:
            if c["kind"] == "module_op":
                out.add(f"{_key(spec)}:{c['op']['op']}:mid")
    return out


def every_op() -> set:
    return ({f"{key}:{op}" for key, ops in OPS.items() for op, _ in ops}
            | {f"{key}:{op}:mid" for key, ops in OPS.items() for op, legal in ops if legal})
