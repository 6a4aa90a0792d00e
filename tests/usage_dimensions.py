"""Issue 25's dimensions of a usage scenario (usage_scenarios.py), drawn from their own random streams (seeded by the
scenario's seed and the turn), so that the fields every earlier seed drew stay as they were.

Per scenario: the autograd context around the calls (`grad`: none, `no_grad`, `inference_mode`), a `sliding_window`
on a Llama's or Mistral's config (`window`), a model config with a stateful rotary module (`rope`: `dynamic`, `longrope`, `yarn`, `llama3`, small enough that the tiny model
crosses `max_position_embeddings` / `original_max_position_embeddings` within a call; `longrope` at times on Phi-3,
where real checkpoints ship it), on 5.17+ a "found" family's tiny model (`found_family`: Gemma, GPT-NeoX, Mixtral...,
tests/family_models.py) instead of the drawn hand-read one, on the dynamic-cache loop, or where none is drawn at times
a multi-head latent attention family's (`latent_family`: DeepSeek-V3, DeepSeek-V2, GLM-4-MoE-lite, MiniCPM3,
tests/latent_models.py). Per turn: a context of its own (`grad`), inputs made inside `inference_mode`
(`made_in`), an aliasing probe (`alias_probe`), a change the caller makes before the call (`before`), and one or two
callbacks of usage_mutators.py inserted among the turn's processors and criteria: mid-call mutations of the model,
the cache, the generation config or the processor/criteria lists, in-place edits of `input_ids`, processors with
hidden state, scores narrowed or widened before transformers' own processors. Any criterion (old or new) may return
its verdict as (batch, 1) and / or as long / uint8 (`ret`).

Issue 27's `graphed` (per scenario, for the scenarios the piecewise-graphed forward may take: a dynamic cache, SDPA,
a family it reads, a rope without per-length state): on the CPU `emulated` (the flag run's calls inside
`testing.emulation.emulated()`, so the graphed path records and replays there) or `off`; on CUDA, where the path
is taken as it is, `natural` or `off` (`TRANSFORMERS_ASYNC_STOP_PIECEWISE=0`). Stock's runs are unaffected.
"""

from __future__ import annotations

import random

from models import TRANSFORMERS_VERSION
import usage_assisted_draws
import usage_module_draws

VOCAB = 48
ROPE_TYPES = {"dynamic": 3, "longrope": 3, "yarn": 2, "llama3": 2}
NEW_PROCESSORS = {"hidden": 4, "width": 3, "mutator": 3, "edit_ids": 1}
NEW_CRITERIA = {"mutator": 3, "edit_ids": 2}
MUTATIONS = ("forward_hook", "forward_pre_hook", "set_attn", "class_forward", "param_inplace", "param_replace",
             "cache_crop", "cache_reset", "gen_config", "proc_list", "crit_list")
BEFORE = ("forward_hook", "forward_pre_hook", "set_attn", "class_forward", "param_replace", "gen_config")
HIDDEN = ("attr_scores", "attr_ids", "attr_held", "cpu_rng", "device_rng", "generator", "py_random", "closure",
          "closure_fn", "global", "class_attr")
WIDEN_THEN = ("repetition_penalty", "no_repeat_ngram", "min_new_tokens", "sequence_bias", "suppress")
NARROW_THEN = ("min_new_tokens", "suppress")
RET_DTYPES = ("bool", "long", "uint8")
GRADS = ("none", "no_grad", "inference_mode")
GRAPHED = {"cpu": ("emulated", "off"), "cuda": ("natural", "off")}
GRAPHED_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "phi3")  # (piecewise.proof.FAMILIES the fuzzer builds)
GRAPHED_CACHES = ("none", "user_dynamic", "returned_dynamic")
GRAPHED_RATE = {"cpu": 0.6, "cuda": 0.75}  # emulated on the CPU / natural on CUDA; else off
# a `sliding_window` set on the model's config (2026-11-29): Llama's forward ignores it, but its cache's layers become
# sliding ones (the padded-masks red team: the loop's grown 4D mask met keys cut to the window); Mistral's slides
WINDOW_FAMILIES = ("llama", "mistral")
WINDOWS = (3, 4, 6)
# a "found" family's tiny model (tests/family_models.py) in place of the drawn one (2026-11-29): the families the
# piecewise proof graphs from the model (docs/paths.md's table), on the dynamic-cache loop of 5.17+, where they take
# that path. A fixed tuple: a family the installed release lacks is not drawn (the draw is made, and dropped), so
# every other seed draws the same family on every release
FOUND_FAMILIES = ("gemma", "phi", "gpt_neox", "olmo", "olmo2", "granite", "starcoder2", "cohere", "stablelm",
                  "smollm3", "gpt_bigcode", "glm", "ernie4_5", "helium", "arcee", "seed_oss", "hunyuan_v1_dense",
                  "ministral", "exaone4", "mixtral", "qwen2_moe", "gptj", "gemma2")
FOUND_RELEASES = TRANSFORMERS_VERSION >= (5, 17)
FOUND_RATE = 0.5
# (family, user-module target) with no such module in the family's decoder layer (usage_modules.place): the experts'
# block holds no activation module of its own (the experts' is called as a function over the grouped experts)
FOUND_UNPLACED = {("mixtral", "act"), ("qwen2_moe", "act")}
# a multi-head latent attention family's tiny model (tests/latent_models.py, issue 45) in place of the drawn one
# (2026-11-30): where `found_family` could have been drawn and was not, from a stream of its own ('<seed>/latent'), so
# every seed draws `found_family` and every other field as before. A fixed tuple, as FOUND_FAMILIES
LATENT_FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3")
LATENT_RELEASES = FOUND_RELEASES
LATENT_RATE = 0.2
# (family, user-module target) with no such module in the family's decoder layer 1 (usage_modules.place): its routed
# experts' block holds no activation module of its own (MiniCPM3's second layer is a dense MLP)
LATENT_UNPLACED = {("deepseek_v3", "act"), ("deepseek_v2", "act"), ("glm4_moe_lite", "act")}
# an encoder-decoder sub-scenario (tests/usage_encoder_decoder.py: BART and its copies, T5, Whisper on the
# dynamic-cache loop, 5.17+) in place of the decoder-only one (2026-11-30): where no found or latent family, assistant
# or user module was drawn, from a stream of its own ('<seed>/encdec'), so every seed draws every other field as
# before (the runner ignores the decoder-only fields of such a scenario)
ENCDEC_RELEASES = FOUND_RELEASES
ENCDEC_RATE = 0.25


def _weighted(rng, table):
    kinds = list(table)
    return rng.choices(kinds, weights=[table[k] for k in kinds])[0]


def _rope(rng):
    kind = _weighted(rng, ROPE_TYPES)
    orig = rng.choice((6, 8, 10, 12))
    factor = rng.choice((2.0, 4.0))
    # dynamic: the module rescales past max_position_embeddings; the others switch (longrope) or interpolate past
    # original_max_position_embeddings; max_pos stays larger than the original for those
    max_pos = orig if kind == "dynamic" else int(orig * factor)
    return {"type": kind, "factor": factor, "orig": orig, "max_pos": max_pos}


def _builtin(rng, name, narrowed_to=VOCAB):
    value = {"repetition_penalty": rng.choice((0.7, 1.5)), "no_repeat_ngram": rng.choice((1, 2)),
             "min_new_tokens": rng.randint(1, 6), "sequence_bias": rng.randrange(3, narrowed_to),
             "suppress": rng.randrange(3, narrowed_to)}[name]
    return {"kind": "builtin", "name": name, "value": value}


def _mutation(rng, sc, steps, whats=MUTATIONS):
    what = rng.choice(whats)
    spec = {"kind": "mutator", "what": what, "at": rng.randint(0, max(steps - 1, 0))}
    if what in ("forward_hook", "forward_pre_hook"):
        spec["target"] = rng.choice(("model", "decoder", "layer", "head"))
        spec["perturb"] = what == "forward_hook" and rng.random() < 0.5
        spec["token"] = rng.randrange(3, VOCAB)
    elif what == "class_forward":
        spec["token"] = rng.randrange(3, VOCAB)
    elif what in ("param_inplace", "param_replace"):
        spec["frac"] = round(rng.random(), 3)
    elif what == "gen_config":
        field, value = rng.choice((("eos_token_id", rng.randrange(3, VOCAB)), ("max_new_tokens", rng.randint(1, 4)),
                                   ("repetition_penalty", 1.5), ("min_new_tokens", rng.randint(1, 6)),
                                   ("do_sample", not sc["do_sample"]), ("output_scores", True)))
        spec.update(field=field, value=value, target=rng.choice(("model", "passed")))
    elif what == "proc_list":
        spec["token"] = rng.randrange(3, VOCAB)
    elif what == "crit_list":
        spec["row"] = rng.randrange(4)
    return spec


def _new_processor(rng, sc, steps, device) -> list:
    kind = _weighted(rng, NEW_PROCESSORS)
    if kind == "hidden":
        spec = {"kind": "hidden", "store": rng.choice(HIDDEN), "token": rng.randrange(3, VOCAB)}
        if spec["store"] == "generator":
            spec.update(gen_device=rng.choice(("cpu", "model")), gen_seed=rng.randrange(1000))
        return [spec]
    if kind == "width":
        if rng.random() < 0.6:
            delta = rng.choice((1, 5))
            then = rng.sample(WIDEN_THEN, rng.randint(1, 2))
        else:
            # narrowed by one: a prompt token at V-1 makes stock's own penalty processors index past the width
            # (stock raises: a skipped scenario); by more, only processors that do not index by token follow
            # (on CUDA that index is a device-side assert, which ends the process: never drawn there)
            delta = -rng.choice((1, 1, 4))
            then = rng.sample(WIDEN_THEN if delta == -1 and device == "cpu" else NARROW_THEN, rng.randint(0, 2))
        return [{"kind": "width", "delta": delta}] + [_builtin(rng, name, VOCAB + min(delta, 0)) for name in then]
    if kind == "mutator":
        return [{**_mutation(rng, sc, steps), "role": "processor"}]
    return [{"kind": "edit_ids", "role": "processor", "col": rng.choice((-1, -2, 0)), "at": rng.randint(0, steps),
             "every": rng.random() < 0.4}]


def _new_criterion(rng, sc, steps) -> dict:
    kind = _weighted(rng, NEW_CRITERIA)
    if kind == "mutator":
        return {**_mutation(rng, sc, steps), "role": "criterion"}
    return {"kind": "edit_ids", "role": "criterion", "col": rng.choice((-1, -1, -2, 0)), "at": rng.randint(0, steps),
            "every": rng.random() < 0.4}


def _ret(rng) -> dict:
    r = rng.random()
    shape = "col" if r < 0.5 else "row"
    dtype = rng.choice(RET_DTYPES) if shape == "col" else rng.choice(RET_DTYPES[1:])
    return {"shape": shape, "dtype": dtype}


def _steps(turn) -> int:
    return max(turn.get("max_new_tokens", turn.get("max_length_extra", 1)), 1)


def _window(sc: dict) -> None:
    """A `sliding_window` on the config of the scenario's model (its own random stream), on a dynamic cache or none."""
    if sc["family"] not in WINDOW_FAMILIES or sc["cache"] not in GRAPHED_CACHES or sc.get("rope"):
        return
    rng = random.Random(f"{sc['seed']}/window")
    if rng.random() < 0.3:
        sc["window"] = rng.choice(WINDOWS)


def found_available() -> tuple:
    """The found families drawn on the installed release (none before 5.17; those it has a config class for)."""
    if not FOUND_RELEASES:
        return ()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(f for f in FOUND_FAMILIES if f in CONFIG_MAPPING_NAMES)


def _found_family(sc: dict) -> None:
    """A found family's tiny model for the scenario (`found_family`, its own random stream), where the other draws
    make sense for it: a dynamic cache or none (the loop those families take), no rope or window on the config (both
    set on a Llama-style config the runner builds by hand), and a user module it has a place for. Drawn after every
    other dimension, and changes no field of theirs: the runner builds that family's model (usage_runner._model)."""
    if not FOUND_RELEASES or sc["cache"] not in GRAPHED_CACHES or sc.get("rope") or sc.get("window"):
        return
    rng = random.Random(f"{sc['seed']}/family")
    if rng.random() >= FOUND_RATE:
        return
    family = rng.choice(FOUND_FAMILIES)
    module = sc.get("user_module", {})
    if family not in found_available() or (family, module.get("target")) in FOUND_UNPLACED:
        return
    sc["found_family"] = family


def latent_available() -> tuple:
    """The latent-attention families drawn on the installed release (none before 5.17; those it has a config class
    for)."""
    if not LATENT_RELEASES:
        return ()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(f for f in LATENT_FAMILIES if f in CONFIG_MAPPING_NAMES)


def _latent_family(sc: dict) -> None:
    """A multi-head latent attention family's tiny model for the scenario (`latent_family`, its own random stream),
    where `found_family` could have been drawn (the same conditions: a dynamic cache or none, no rope or window, a
    user module it has a place for) and was not. Drawn after `found_family`, and changes no field of any other
    dimension: the runner builds that family's model (usage_runner._model, latent_models.build_latent)."""
    if not LATENT_RELEASES or "found_family" in sc or sc["cache"] not in GRAPHED_CACHES or sc.get("rope") \
            or sc.get("window"):
        return
    rng = random.Random(f"{sc['seed']}/latent")
    if rng.random() >= LATENT_RATE:
        return
    family = rng.choice(LATENT_FAMILIES)
    module = sc.get("user_module", {})
    if family not in latent_available() or (family, module.get("target")) in LATENT_UNPLACED:
        return
    sc["latent_family"] = family


def _encoder_decoder(sc: dict, device: str) -> None:
    """An encoder-decoder sub-scenario (`encoder_decoder`, its own random stream; usage_encoder_decoder.draw) where
    no other dimension replaced or wrapped the model (found / latent family, assistant, user module). Drawn last,
    and changes no field of any other dimension: the runner runs the sub-scenario (usage_encoder_decoder.check)."""
    if not ENCDEC_RELEASES or {"found_family", "latent_family", "assisted", "user_module"} & set(sc):
        return
    rng = random.Random(f"{sc['seed']}/encdec")
    if rng.random() >= ENCDEC_RATE:
        return
    import usage_encoder_decoder

    sc["encoder_decoder"] = usage_encoder_decoder.draw(rng, device)


def _graphed(sc: dict, device: str) -> None:
    """Issue 27: the flag run's piecewise forward, for a scenario it may take (its own random stream)."""
    kind = "cuda" if device != "cpu" else "cpu"
    if (sc["attn"] != "sdpa" or sc["cache"] not in GRAPHED_CACHES or sc["family"] not in GRAPHED_FAMILIES
            or sc.get("rope", {}).get("type") in ("dynamic", "longrope")):
        return
    rng = random.Random(f"{sc['seed']}/graphed")
    sc["graphed"] = GRAPHED[kind][0] if rng.random() < GRAPHED_RATE[kind] else "off"


def add(sc: dict, device: str) -> None:
    """Adds issue 25's and 27's dimensions to the drawn scenario `sc` (in place)."""
    rng = random.Random(f"{sc['seed']}/issue25")
    r = rng.random()
    grad = "inference_mode" if r < 0.35 else "no_grad" if r < 0.5 else "none"
    if grad != "none":
        sc["grad"] = grad
    if sc["family"] in ("llama", "qwen2", "mistral") and rng.random() < 0.3:
        sc["rope"] = _rope(rng)
        if sc["rope"]["type"] == "longrope" and rng.random() < 0.4:
            sc["family"] = "phi3"  # (a static cache works there too: the cache kinds drawn stay valid)
    for t, turn in enumerate(sc["turns"]):
        side = random.Random(f"{sc['seed']}/{t}/issue25")
        steps = _steps(turn)
        if t > 0 and side.random() < 0.1:
            turn["grad"] = side.choice([g for g in GRADS if g != sc.get("grad", "none")])
        if side.random() < 0.15:
            turn["made_in"] = "inference_mode"
        if side.random() < 0.3:
            turn["alias_probe"] = True
        if side.random() < (0.1 if t > 0 else 0.04):
            turn["before"] = _mutation(side, sc, steps, BEFORE)
        for _ in range((side.random() < 0.35) + (side.random() < 0.1)):
            block = _new_processor(side, sc, steps, device)
            at = side.randint(0, len(turn["processors"]))
            turn["processors"][at:at] = block
        if side.random() < 0.3:
            turn["criteria"].insert(side.randint(0, len(turn["criteria"])), _new_criterion(side, sc, steps))
        for crit in turn["criteria"]:
            if crit["kind"] != "python_bool" and side.random() < 0.25:
                crit["ret"] = _ret(side)
                needs_eos = "exponential_decay_length_penalty" in turn.get("config_procs", {})
                if crit["ret"]["shape"] == "col" and turn["eos"] is not None and side.random() < 0.8 \
                        and not needs_eos:
                    # with an EOS id, stock's own loop fails on a (batch, 1) verdict (the unfinished rows become
                    # (batch, batch), then its next tokens 3-D): most such draws run without EOS, where stock
                    # broadcasts it and returns
                    turn["eos"] = None
    _window(sc)
    _graphed(sc, device)
    usage_module_draws.add(sc, device)  # issue 31's user modules (their own random stream)
    usage_assisted_draws.add(sc, device)  # issue 32's assisted decoding and prompt lookup (the same)
    _found_family(sc)  # (last: it reads the other draws)
    _latent_family(sc)  # (after it: drawn only where it was not)
    _encoder_decoder(sc, device)  # (after both: drawn only where neither was)


def candidates(sc: dict, variant):
    """Simpler variants of `sc` along these dimensions (for usage_scenarios.shrink)."""
    if "encoder_decoder" in sc:  # (its decoder-only fields are not run: only the sub-scenario's variants)
        import usage_encoder_decoder

        yield from usage_encoder_decoder.candidates(sc, variant)
        return
    if sc.get("graphed") in ("emulated", "natural"):  # (a failure that stays with the path off is not the path's)
        yield variant(lambda s: s.__setitem__("graphed", "off"))
    yield from usage_assisted_draws.candidates(sc, variant)
    yield from usage_module_draws.candidates(sc, variant)
    for key in ("grad", "rope", "window", "found_family", "latent_family"):
        if key in sc:
            yield variant(lambda s, key=key: s.pop(key))
    if sc["family"] == "phi3":
        yield variant(lambda s: s.__setitem__("family", "llama"))
    for i, turn in enumerate(sc["turns"]):
        for key in ("grad", "made_in", "alias_probe", "before"):
            if key in turn:
                yield variant(lambda s, i=i, key=key: s["turns"][i].pop(key))
        for j, crit in enumerate(turn["criteria"]):
            if "ret" in crit:
                yield variant(lambda s, i=i, j=j: s["turns"][i]["criteria"][j].pop("ret"))
                if crit["ret"]["dtype"] != "bool":
                    yield variant(lambda s, i=i, j=j: s["turns"][i]["criteria"][j]["ret"].__setitem__("dtype", "bool"))


def reached(sc: dict) -> set:
    """The values of issue 25's dimensions that `sc` draws, as strings (for the coverage tests and the fuzzer's
    per-dimension counts). An encoder-decoder scenario: the sub-scenario's values alone (its other fields not run)."""
    if "encoder_decoder" in sc:
        import usage_encoder_decoder

        return usage_encoder_decoder.reached(sc)
    out = {"grad:" + sc.get("grad", "none")}
    if "rope" in sc:
        out.add("rope:" + sc["rope"]["type"])
    if sc["family"] == "phi3":
        out.add("family:phi3")
    if "window" in sc:
        out.add("window:" + sc["family"])
    if "found_family" in sc:
        out.add("found_family:" + sc["found_family"])
    if "latent_family" in sc:
        out.add("latent_family:" + sc["latent_family"])
    if "graphed" in sc:
        out.add("graphed:" + sc["graphed"])
    for turn in sc["turns"]:
        out.update("turn:" + key for key in ("grad", "made_in", "alias_probe") if key in turn)
        if "before" in turn:
            out.add("before:" + turn["before"]["what"])
        after_width = False
        for p in turn["processors"]:
            if p["kind"] == "hidden":
                out.add("hidden:" + p["store"])
            elif p["kind"] == "width":
                out.add("width:" + ("widen" if p["delta"] > 0 else "narrow"))
            elif p["kind"] == "builtin" and after_width:
                out.add("after_width:" + p["name"])
            elif p["kind"] == "mutator":
                out.add("mutation:" + p["what"])
                out.add("mutator:processor")
            elif p["kind"] == "edit_ids":
                out.add(f"edit_ids:processor:{p['col']}")
            after_width = p["kind"] in ("width", "builtin") and (after_width or p["kind"] == "width")
        for c in turn["criteria"]:
            if c["kind"] == "mutator":
                out.add("mutation:" + c["what"])
                out.add("mutator:criterion")
            elif c["kind"] == "edit_ids":
                out.add(f"edit_ids:criterion:{c['col']}")
            if "ret" in c:
                out.update(("ret_shape:" + c["ret"]["shape"], "ret_dtype:" + c["ret"]["dtype"]))
    return out | usage_module_draws.reached(sc) | usage_assisted_draws.reached(sc)


def every_value(device: str = "cpu") -> set:
    """Every value `reached` can report for scenarios drawn for `device`."""
    out = {"graphed:" + g for g in GRAPHED["cuda" if device != "cpu" else "cpu"]}
    out |= {"grad:" + g for g in GRADS} | {"rope:" + r for r in ROPE_TYPES} | {"family:phi3"}
    out |= {"window:" + f for f in WINDOW_FAMILIES}
    out |= {"found_family:" + f for f in found_available()}
    out |= {"latent_family:" + f for f in latent_available()}
    if ENCDEC_RELEASES:
        import usage_encoder_decoder

        out |= usage_encoder_decoder.every_value(device)
    out |= {"turn:grad", "turn:made_in", "turn:alias_probe", "mutator:processor", "mutator:criterion"}
    out |= {"before:" + w for w in BEFORE} | {"mutation:" + w for w in MUTATIONS} | {"hidden:" + h for h in HIDDEN}
    out |= {"width:widen", "width:narrow"} | {"after_width:" + n for n in WIDEN_THEN}
    out |= {f"edit_ids:{role}:{col}" for role in ("processor", "criterion") for col in (-1, -2, 0)}
    out |= {"ret_shape:col", "ret_shape:row"} | {"ret_dtype:" + d for d in RET_DTYPES}
    return out | usage_assisted_draws.every_value()
