"""Issue 32's `assisted` dimension of a usage scenario (usage_scenarios.py): assisted decoding or prompt lookup in
every turn, drawn from its own random stream (seeded by the scenario's seed), so every field drawn before stays as it
was in the scenarios that do not draw it. usage_runner.py builds the assistant (`assistant`), passes it or the lookup
settings to each call (`call_kwargs`), makes the lookup prompts (`tokens`) and records what the caller sees of it
(`observe`).

Per scenario (a fifth of those that can take it: a cache kind of the dynamic-cache loop, transformers 5.x; every
family the fuzzer builds is decoder-only): `assisted` = {"kind", ...}:
- `draft`: a separate small model of the same vocabulary (`family`, `seed`, `attn`: another seed, at times another
  family the graphed forward reads, at times eager attention), built for the run;
- `copy`: `copy.copy(target)`, sharing the target's modules, with the target's own generation config (`shared`) or
  a copy of it;
- `lookup`: prompt lookup (`prompt_lookup_num_tokens` 1-5, `max_matching_ngram_size` at times), its prompts at times
  made of a repeated n-gram (`repeat`) so candidates are found from the first round.
`draft` and `copy` set the assistant's `num_assistant_tokens` (1-6), `num_assistant_tokens_schedule` (constant,
heuristic, heuristic_transient) and `assistant_confidence_threshold` (0 or 0.4) on its generation config. Greedy or
sampling follows the scenario's `do_sample`; `pad`: the left padding of a `left_pad` turn's one row.

The fields of the base draw this dimension changes, in the scenarios drawing it: every turn's batch is 1 and none
asks for several return sequences (stock's assisted decoding takes neither); in 4 of 5 turns a processor changing
the scores' width and, with an assistant, `inputs_embeds` are left out (stock raises on both: the scenario would end
there); `bare` (3 of 5) leaves out the turns' stopping criteria, and for prompt lookup the processors and top-p that
can forbid a candidate (each keeps the call on stock's loop, where nothing of the package's runs); and more of them
run the graphed forward (`graphed`, issue 27's dimension, is set to `emulated` / `natural` in 3 of 5 that draw it).

On the CPU the verify forward replays from (emulated) CUDA graphs where the scenario draws `graphed: emulated`
(usage_dimensions.py): the flag run's calls run inside `testing.emulation.emulated()`; the runner records each call's
`last_path().verify` (`Result.verify`, and `usage_runner.LAST_VERIFY` for scripts/usage_fuzz.py's counts).
"""

from __future__ import annotations

import copy
import random

import torch

from models import TRANSFORMERS_VERSION, build
from transformers_async_stop.config import FIELD

RATE = 0.2
BARE = 0.6  # the share of them whose turns keep no user criteria (and for lookup, no processor it refuses)
LOOKUP_KEEPS = ("repetition_penalty", "min_length", "min_p")  # (config_procs lookup takes)
VOCAB = 48
KINDS = {"draft": 4, "copy": 3, "lookup": 4}
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
THRESHOLDS = (0.0, 0.4)
DRAFT_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "phi3")  # (the graphed forward reads each)
CACHES = ("none", "user_dynamic", "returned_dynamic")  # the dynamic-cache loop's; stock refuses a static one
SUPPORTED = TRANSFORMERS_VERSION >= (5, 0)


def _weighted(rng, table):
    kinds = list(table)
    return rng.choices(kinds, weights=[table[k] for k in kinds])[0]


def _spec(rng, sc) -> dict:
    kind = _weighted(rng, KINDS)
    spec = {"kind": kind}
    if rng.random() < 0.6:
        spec["pad"] = rng.randint(1, 2)  # the left padding of a `left_pad` turn's row (batch 1: none otherwise)
    if kind == "lookup":
        spec["tokens"] = rng.randint(1, 5)
        if rng.random() < 0.4:
            spec["ngram"] = rng.randint(1, 3)
        spec["repeat"] = rng.random() < 0.6
        return spec
    if kind == "draft":
        other = rng.random() < 0.4
        spec.update(family=rng.choice(DRAFT_FAMILIES) if other else sc["family"], seed=rng.randint(1, 3),
                    attn="eager" if rng.random() < 0.3 else "sdpa")
    else:
        spec["shared"] = rng.random() < 0.5
    spec.update(tokens=rng.randint(1, 6), schedule=rng.choice(SCHEDULES), threshold=rng.choice(THRESHOLDS))
    return spec


def add(sc: dict, device: str) -> None:
    """Adds the `assisted` dimension to the drawn scenario `sc` (in place), a fifth of the time where it can."""
    rng = random.Random(f"{sc['seed']}/assisted")
    if rng.random() >= RATE or not SUPPORTED or sc["cache"] not in CACHES:
        return
    spec = sc["assisted"] = _spec(rng, sc)
    if rng.random() < BARE:
        spec["bare"] = True
    if "graphed" in sc and rng.random() < 0.6:
        # more of them on the graphed forward than issue 27's draw gives (the verify forward replays only there)
        sc["graphed"] = "emulated" if device == "cpu" else "natural"
    if spec.get("bare") and spec["kind"] == "lookup":
        sc.pop("top_p", None)  # (top-p can forbid a candidate: prompt lookup with it runs stock's loop)
    for turn in sc["turns"]:
        turn["batch"] = 1
        turn.pop("stale_cache", None)  # (one batch throughout: an old cache of another batch cannot happen)
        turn.pop("num_return_sequences", None)
        # stock refuses, so both runs raise and the scenario ends there, in 4 of 5 draws kept out: a processor that
        # changes the scores' width (stock's verify writes them back into a (1, K, vocab) tensor), and inputs_embeds
        # with an assistant (the draft's prefill gets no ids); prompt lookup takes them
        if any(p["kind"] == "width" for p in turn["processors"]) and rng.random() < 0.8:
            turn["processors"] = [p for p in turn["processors"] if p["kind"] != "width"]
        if turn["embeds"] and spec["kind"] != "lookup" and rng.random() < 0.8:
            turn["embeds"] = False
        if spec.get("bare"):
            # the package's own loop, where the verify forward replays: a user criterion keeps the call on stock's
            # loop, and so does any processor but transformers' few that prompt lookup checks on the host
            turn["criteria"] = []
            if spec["kind"] == "lookup":
                turn["processors"] = [p for p in turn["processors"] if p["kind"] == "builtin"
                                      and p["name"] in ("repetition_penalty", "min_new_tokens")]
                turn["config_procs"] = {k: v for k, v in turn.get("config_procs", {}).items() if k in LOOKUP_KEEPS}
                if not turn["config_procs"]:
                    turn.pop("config_procs")


def candidates(sc: dict, variant):
    """Simpler variants along this dimension (for usage_scenarios.shrink)."""
    spec = sc.get("assisted")
    if not spec:
        return
    yield variant(lambda s: s.pop("assisted"))
    if spec["kind"] == "draft":
        yield variant(lambda s: s.__setitem__("assisted", {**_plain(s["assisted"]), "kind": "copy", "shared": False}))
    for key, value in (("schedule", "constant"), ("threshold", 0.0), ("attn", "sdpa"), ("family", sc["family"]),
                       ("shared", False), ("repeat", False)):
        if key in spec and spec[key] != value:
            yield variant(lambda s, key=key, value=value: s["assisted"].__setitem__(key, value))
    for key in ("pad", "ngram"):
        if key in spec:
            yield variant(lambda s, key=key: s["assisted"].pop(key))
    if spec["tokens"] > 1:
        yield variant(lambda s: s["assisted"].__setitem__("tokens", s["assisted"]["tokens"] - 1))


def _plain(spec):
    return {k: v for k, v in spec.items() if k not in ("family", "seed", "attn")}


def reached(sc: dict) -> set:
    spec = sc.get("assisted")
    if not spec:
        return set()
    out = {"assisted:" + spec["kind"], "assisted:" + ("sample" if sc["do_sample"] else "greedy")}
    if spec["kind"] == "lookup":
        out.update("assisted:" + key for key in ("ngram", "repeat") if spec.get(key))
        return out
    out.add("assisted:schedule:" + spec["schedule"])
    if spec["threshold"]:
        out.add("assisted:threshold")
    if spec["kind"] == "draft":
        if spec["family"] != sc["family"]:
            out.add("assisted:draft_other_family")
        if spec["attn"] == "eager":
            out.add("assisted:draft_eager")
    elif spec["shared"]:
        out.add("assisted:copy_shared_config")
    return out


def every_value() -> set:
    if not SUPPORTED:
        return set()
    return ({"assisted:" + k for k in KINDS} | {"assisted:schedule:" + s for s in SCHEDULES}
            | {"assisted:" + v for v in ("sample", "greedy", "ngram", "repeat", "threshold", "draft_other_family",
                                         "draft_eager", "copy_shared_config")})


# --- the runner's side ----------------------------------------------------------------------------------------------
def needs_own_model(sc: dict) -> bool:
    # a copy sharing the target's generation config writes the heuristic schedule's length into it: the target must
    # be the run's own (a cached one would carry it into the next run)
    return sc.get("assisted", {}).get("kind") == "copy"


def assistant(sc: dict, model, device: str):
    """The run's assistant model (None for prompt lookup or no `assisted`): built before the run seeds its RNG."""
    spec = sc.get("assisted")
    if not spec or spec["kind"] == "lookup":
        return None
    if spec["kind"] == "draft":
        helper = build(spec["family"], seed=spec["seed"], device=device, attn=spec["attn"],
                       dtype=getattr(torch, sc.get("dtype", "float32")))
    else:
        helper = copy.copy(model)
        if not spec["shared"]:
            helper.generation_config = copy.deepcopy(model.generation_config)
    config = helper.generation_config
    config.num_assistant_tokens = spec["tokens"]
    config.num_assistant_tokens_schedule = spec["schedule"]
    config.assistant_confidence_threshold = spec["threshold"]
    return helper


def call_kwargs(sc: dict, helper) -> dict:
    spec = sc.get("assisted")
    if not spec:
        return {}
    if spec["kind"] != "lookup":
        return {"assistant_model": helper}
    out = {"prompt_lookup_num_tokens": spec["tokens"]}
    if "ngram" in spec:
        out["max_matching_ngram_size"] = spec["ngram"]
    return out


def first_row_pad(sc: dict) -> int:
    return sc.get("assisted", {}).get("pad", 0)


def tokens(sc: dict, seed: int, shape, device):
    """A lookup scenario's new tokens made of a repeated n-gram (2-4 tokens, one changed now and then), so prompt
    lookup finds candidates in the prompt; None where the runner's random tokens are used."""
    if not sc.get("assisted", {}).get("repeat"):
        return None
    g = torch.Generator().manual_seed(seed)
    gram = torch.randint(3, VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)
    out = gram.repeat(shape[1] // gram.numel() + 1)[: shape[1]].repeat(shape[0], 1)
    noise = torch.rand(shape, generator=g) < 0.15
    return torch.where(noise, torch.randint(3, VOCAB, shape, generator=g), out).to(device)


def observe(helper):
    """What the caller sees of its assistant after a call: its generation config (the heuristic schedule writes its
    final length there)."""
    if helper is None:
        return None
    # (a config made while the package is applied holds its field unset, None; one made by stock's run lacks it)
    return {k: v for k, v in helper.generation_config.to_dict().items()
            if k != "transformers_version" and not (k == FIELD and v is None)}
