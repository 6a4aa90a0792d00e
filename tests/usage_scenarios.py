"""Whole usage scenarios for the usage fuzzer, drawn from a seed, and their shrinking.

A scenario is plain data (a dict, printable and replayable): a model (family, attention), greedy or seeded
sampling, a cache kind, and a list of turns, each one generate() call. Turns continue one conversation on one cache
(a user DynamicCache or StaticCache, or the cache the previous call returned with `return_dict_in_generate=True`):
each feeds the whole conversation so far or only the tokens the cache lacks (with the full-length attention mask, as
transformers documents for chat), ids or `inputs_embeds`, with or without an explicit `cache_position`. A turn may
change the batch (a new conversation, a new cache; or, as a user's mistake, the old cache), the padding and the
prompt length, and brings its own EOS ids, length limits, output flags, streamer, logits processors and stopping
criteria (usage_callbacks.py). A user StaticCache is sized around what the flag-off run needs (`room`: exactly, one
more, one less, or roomy). `threads`: the scenario and a second one run at once in two threads (greedy), on one
model or two, half of the time with a third thread allocating and writing on the default stream (`hammer`).
usage_runner.py runs a scenario; `shrink` makes a failing one minimal.
"""

from __future__ import annotations

import copy
import json
import random

from transformers.generation.utils import GenerationMixin

import usage_dimensions

# generate() takes an explicit `cache_position` up to 5.16 (5.17 builds positions from the cache alone)
TAKES_CACHE_POSITION = hasattr(GenerationMixin, "_get_initial_cache_position")

FAMILIES = ("llama", "qwen2", "gpt2", "mistral")
STATIC_FAMILIES = ("llama", "qwen2", "mistral")
CACHES = ("none", "user_dynamic", "user_static", "returned_dynamic", "returned_static", "config_static")
VOCAB = 48

PROCESSORS = {  # kind: weight
    "keep_ref": 3, "mutate_scores": 3, "mutate_ids": 3, "counter": 2, "prev_scores": 2, "host_read": 2, "raise": 2,
    "dtype": 2, "graph_safe_pure": 2, "nested": 1, "user_temperature": 2, "user_min_new": 2,
}
CRITERIA = {"stop_row": 3, "python_bool": 2, "host_read": 2, "keep_ref": 2, "raise": 2, "anneal": 2,
            "min_new_change": 2, "nested": 1}


def _weighted(rng, table):
    kinds = list(table)
    return rng.choices(kinds, weights=[table[k] for k in kinds])[0]


def _interrupt(spec) -> None:
    # a third of the raises are a KeyboardInterrupt (Ctrl-C inside a callback), picked by the step so that the draw's
    # random stream, and every earlier seed's scenario, stays as it was
    if spec["at"] % 3 == 2:
        spec["interrupt"] = True


def _processor(rng, steps, device):
    kind = _weighted(rng, PROCESSORS)
    if device == "cuda" and kind == "graph_safe_pure" and rng.random() < 0.25:
        kind = "graph_safe_liar"  # issue 16, item 3: a capture that fails (CUDA only)
    spec = {"kind": kind}
    if kind == "raise":
        spec["at"] = rng.randint(0, steps)
        _interrupt(spec)
    elif kind in ("mutate_scores", "counter"):
        spec["token"] = rng.randrange(VOCAB)
    elif kind == "dtype":
        spec["dtype"] = rng.choice(("float64", "float16", "bfloat16"))
    elif kind == "nested":
        spec.update(model=rng.choice(("same", "judge")), flag=rng.random() < 0.3, new=rng.randint(1, 3))
    elif kind == "user_temperature":
        spec["t"] = rng.choice((0.5, 0.8, 1.3))
    elif kind == "user_min_new":
        spec["n"] = rng.randint(1, steps + 2)
    return spec


def _criterion(rng, steps):
    kind = _weighted(rng, CRITERIA)
    spec = {"kind": kind}
    if kind in ("raise", "python_bool", "stop_row", "min_new_change"):
        spec["at"] = rng.randint(0, steps)
    if kind == "raise":
        _interrupt(spec)
    elif kind == "stop_row":
        spec["row"] = rng.randrange(4)
    elif kind == "anneal":
        spec["factor"] = rng.choice((0.5, 0.8, 1.5))
    elif kind == "min_new_change":
        spec["to"] = rng.randint(0, steps + 3)
    elif kind == "nested":
        spec.update(model=rng.choice(("same", "judge")), flag=rng.random() < 0.3, new=rng.randint(1, 3))
    return spec


def _turn(rng, sc, t, batch, device):
    turn = {"batch": batch, "left_pad": rng.random() < 0.4, "prompt_len": rng.randint(2, 8),
            "user_len": rng.randint(1, 5)}
    if t > 0 and rng.random() < 0.12:
        turn["batch"] = rng.randint(1, 4)  # a new conversation (a new cache, or the old one: `stale_cache`)
        if turn["batch"] != batch and sc["cache"] != "none" and rng.random() < 0.2:
            turn["stale_cache"] = True
    elif t > 0 and rng.random() < 0.08:
        turn["restart"] = True  # a new conversation of the same batch (a new cache)
    cached = sc["cache"] != "none"
    turn["feed"] = "new" if cached and t > 0 and rng.random() < 0.5 else "full"
    turn["cache_position"] = cached and rng.random() < 0.15 and TAKES_CACHE_POSITION
    turn["embeds"] = rng.random() < 0.2
    if turn["embeds"] and turn["feed"] == "new" and turn["user_len"] != 1:
        # stock rejects inputs_embeds of only the new tokens (5.23: a reshape of 0 elements): kept in 1 draw of 5
        # to check the flag raises the same, the others feed the whole conversation
        turn["feed"] = "full"
    steps = rng.randint(1, 12)
    r = rng.random()
    if r < 0.8:
        turn["max_new_tokens"] = steps
    elif r < 0.95:
        turn["max_length_extra"] = steps  # max_length = the conversation's length + steps
    else:
        turn["max_length_extra"] = -rng.randint(0, 3)  # max_length at or below the prompt's length
    r = rng.random()
    turn["eos"] = (sorted(rng.sample(range(3, VOCAB), rng.randint(1, 3))) if r < 0.7
                   else None if r < 0.8 else "config")
    if rng.random() < 0.15:
        turn["min_new_tokens"] = rng.randint(1, 14)  # at times more than max_new_tokens
    turn["processors"], turn["criteria"] = [], []
    for _ in range(rng.choices((0, 1, 2), weights=(45, 35, 20))[0]):
        spec = _processor(rng, steps, device)
        if spec["kind"] == "user_temperature" and not sc["do_sample"]:
            continue
        turn["processors"].append(spec)
    for _ in range(rng.choices((0, 1, 2), weights=(50, 35, 15))[0]):
        turn["criteria"].append(_criterion(rng, steps))
    kinds = {c["kind"] for c in turn["criteria"]}
    if "anneal" in kinds and sc["do_sample"] and all(p["kind"] != "user_temperature" for p in turn["processors"]):
        turn["processors"].append({"kind": "user_temperature", "t": rng.choice((0.5, 0.8, 1.3))})
    if "min_new_change" in kinds and all(p["kind"] != "user_min_new" for p in turn["processors"]):
        turn["processors"].append({"kind": "user_min_new", "n": rng.randint(1, steps + 2)})
    if rng.random() < 0.25:
        turn["config_procs"] = _config_procs(rng, sc["do_sample"])
    turn["streamer"] = rng.random() < 0.25
    side = random.Random(f"{sc['seed']}/{t}/streamer")  # its own stream: every earlier seed's draw stays the same
    if turn["streamer"] and side.random() < 0.3:
        # its put() number `at` (0: the prompt) raises: the flag has by then queued the next step, which it must undo
        # as stock never ran it; half of them a KeyboardInterrupt
        turn["streamer_raises"] = {"at": side.randint(0, steps + 1), "interrupt": side.random() < 0.5}
    returned = sc["cache"].startswith("returned")
    turn["return_dict"] = returned or rng.random() < 0.4
    if turn["return_dict"]:
        turn["output_scores"] = rng.random() < 0.5
        turn["output_logits"] = rng.random() < 0.4
        for key in ("output_hidden_states", "output_attentions"):
            if rng.random() < 0.1:
                turn[key] = True
    elif rng.random() < 0.05:
        turn["output_scores"] = True  # without return_dict_in_generate: ignored by stock
    if sc["cache"] == "none" and rng.random() < 0.05:
        turn["use_cache"] = False
    if rng.random() < 0.05:
        turn["pad_omitted"] = True
    if rng.random() < 0.04:
        turn["mask_omitted"] = True  # no attention_mask (stock warns and builds one from the pad token)
    if rng.random() < 0.05:
        turn["in_thread"] = True  # generate() in a worker thread (a TextIteratorStreamer app)
    if rng.random() < 0.05:
        turn["prefill_chunk_size"] = rng.choice((2, 3))
    return turn


def _config_procs(rng, sampling) -> dict:
    """Built-in processors switched on through generate()'s own settings (the static loop has its own forms)."""
    tok = rng.randrange(3, VOCAB)
    table = {"repetition_penalty": rng.choice((0.7, 1.3, 2.0)), "no_repeat_ngram_size": rng.choice((1, 2, 3)),
             "bad_words_ids": rng.choice(([[tok]], [[tok, (tok + 1) % VOCAB]])), "suppress_tokens": [tok],
             "sequence_bias": [[[tok], rng.choice((-3.0, 2.0))]], "forced_eos_token_id": tok,
             "renormalize_logits": True, "begin_suppress_tokens": [tok], "encoder_repetition_penalty": 1.5,
             "min_length": rng.randint(2, 20), "exponential_decay_length_penalty": [rng.randint(1, 5), 1.5]}
    if sampling:
        table.update(min_p=rng.choice((0.05, 0.2)), typical_p=0.8, epsilon_cutoff=3e-3, eta_cutoff=3e-3)
    names = rng.sample(sorted(table), rng.randint(1, 2))
    return {name: table[name] for name in names}


def draw(seed: int, device: str = "cpu") -> dict:
    sc = _draw(seed, device)
    if "threads" not in sc:
        usage_dimensions.add(sc, device)  # issue 25's dimensions, from their own random streams
    return sc


def _draw(seed: int, device: str = "cpu") -> dict:
    rng = random.Random(seed)
    family = rng.choice(FAMILIES)
    sc = {"seed": seed, "family": family, "attn": rng.choice(("sdpa", "sdpa", "eager")),
          "do_sample": rng.random() < 0.4}
    if sc["do_sample"]:
        for name, values in (("top_k", (None, 3, 10)), ("top_p", (None, 0.6, 0.9)), ("temperature", (None, 0.7))):
            value = rng.choice(values)
            if value is not None:
                sc[name] = value
    caches = CACHES if family in STATIC_FAMILIES else tuple(c for c in CACHES if "static" not in c)
    weights = {"none": 12, "user_dynamic": 18, "user_static": 30, "returned_dynamic": 12, "returned_static": 20,
               "config_static": 8}
    sc["cache"] = rng.choices(caches, weights=[weights[c] for c in caches])[0]
    if rng.random() < 0.1:
        sc["dtype"] = "bfloat16"
    r = rng.random()
    if r < 0.1:
        sc["flag_via"] = "generation_config"  # a GenerationConfig passed in, the flag set on it
    elif r < 0.17:
        sc["flag_via"] = "model_config"  # model.generation_config.async_stopping_criteria = True
    if sc["cache"] == "user_static":
        # around the positions the flag-off run writes; one less only on CPU (on CUDA stock's own overflow is a
        # device-side assert that ends the process)
        rooms = ("roomy", 0, 0, 0, 1, 1, -1) if device == "cpu" else ("roomy", 0, 0, 1)
        sc["room"] = rng.choice(rooms)
    if device == "cuda" and "static" in sc["cache"]:
        sc["compile"] = rng.random() < 0.015  # the default auto-compile (each new shape compiles: rare); else off
    n = rng.choices((1, 2, 3, 4), weights=(25, 35, 28, 12))[0]
    if device == "cuda" and sc["cache"] == "returned_static":
        # a returned static cache is sized for its first call: a longer later turn overflows it in stock itself,
        # which on CUDA is a device-side assert that ends the process (on CPU, an IndexError both runs must match)
        n = 1
    sc["turns"] = []
    batch = rng.randint(1, 4)
    for t in range(n):
        turn = _turn(rng, sc, t, batch, device)
        batch = turn["batch"]
        sc["turns"].append(turn)
    if sc["do_sample"] and rng.random() < 0.1:
        sc["turns"][-1]["num_return_sequences"] = 2
    if any(p["kind"] == "user_temperature" for t in sc["turns"] for p in t["processors"]):
        sc.pop("temperature", None)  # stock refuses a user warper of a type it also builds from the config
    if rng.random() < 0.06:
        other = _draw(seed + 10_000_000, device)
        other.pop("threads", None)
        mode = rng.choice(("one_model", "two_models"))
        if mode == "one_model":
            other["family"], other["attn"] = family, sc["attn"]
            other.pop("dtype", None)
            if "dtype" in sc:
                other["dtype"] = sc["dtype"]
            # generate() keeps the static cache it builds on the model (`_cache`): two threads on one model each
            # pass their own cache (stock itself shares that one). Per-step hidden states and attentions are
            # recorded by hooks on the shared model's modules in 4.57.6: stock itself mixes the two threads' (seen:
            # a thread's hidden states with the other thread's batch), so neither thread asks for them
            for s in (sc, other):
                for turn in s["turns"]:
                    turn.pop("output_hidden_states", None)
                    turn.pop("output_attentions", None)
                if s["cache"] in ("returned_static", "config_static"):
                    s["cache"], s["room"] = "user_static", "roomy"
                if family not in STATIC_FAMILIES and "static" in s["cache"]:
                    s["cache"] = "user_dynamic"
                    s.pop("room", None)
        sc["threads"] = {"mode": mode, "other": other}
        if rng.random() < 0.5:
            # a third thread allocates and writes small tensors on the default stream meanwhile, with the interpreter
            # switching threads as often as it can: memory one thread frees while another stream still reads it is
            # taken at once (the H100 fuzz found the deferred loop's first `unfinished_sequences` so)
            sc["threads"]["hammer"] = True
    if "threads" in sc:
        for s in (sc, sc["threads"]["other"]):  # greedy only: the two threads share the global RNG
            s["do_sample"] = False
            # an auto-compiled forward (torch.compile's CUDA graphs) in two threads fails in stock itself (a
            # device-side assert, H100, torch 2.11): nothing to compare the flag with
            if s.get("compile"):
                s["compile"] = False
            for name in ("top_k", "top_p", "temperature"):
                s.pop(name, None)
            for turn in s["turns"]:
                turn["processors"] = [p for p in turn["processors"] if p["kind"] != "user_temperature"]
                turn.pop("num_return_sequences", None)
    return sc


def dumps(sc: dict) -> str:
    return json.dumps(sc, sort_keys=True)


# --- shrinking ------------------------------------------------------------------------------------------------------
def _candidates(sc: dict):
    """Simpler variants of `sc`, the biggest cuts first."""
    def variant(fn):
        new = copy.deepcopy(sc)
        fn(new)
        return new

    if "threads" in sc:
        yield variant(lambda s: s.pop("threads"))
    yield from usage_dimensions.candidates(sc, variant)
    turns = sc["turns"]
    for i in reversed(range(len(turns))):
        if len(turns) > 1:
            yield variant(lambda s, i=i: s["turns"].pop(i))
    for i, turn in enumerate(turns):
        for key in sorted(turn.get("config_procs", {})):
            if len(turn["config_procs"]) > 1:
                yield variant(lambda s, i=i, key=key: s["turns"][i]["config_procs"].pop(key))
        for key in ("processors", "criteria"):
            for j in range(len(turn[key])):
                yield variant(lambda s, i=i, key=key, j=j: s["turns"][i][key].pop(j))
    for key, value in (("do_sample", False), ("attn", "sdpa"), ("family", "llama"), ("room", "roomy"),
                       ("compile", False)):
        if key in sc and sc[key] != value and not (key == "family" and sc["cache"] == "none"):
            yield variant(lambda s, key=key, value=value: s.__setitem__(key, value))
    for key in ("top_k", "top_p", "temperature", "dtype", "flag_via"):
        if key in sc:
            yield variant(lambda s, key=key: s.pop(key))
    if any(t["batch"] > 1 for t in turns):
        yield variant(lambda s: [t.__setitem__("batch", 1) for t in s["turns"]])
    for i, turn in enumerate(turns):
        for key, value in (("streamer", False), ("return_dict", False), ("output_scores", False),
                           ("output_logits", False), ("feed", "full"), ("cache_position", False), ("embeds", False),
                           ("left_pad", False), ("eos", None)):
            if turn.get(key, value) != value:
                yield variant(lambda s, i=i, key=key, value=value: s["turns"][i].__setitem__(key, value))
        for key in ("min_new_tokens", "num_return_sequences", "stale_cache", "restart", "pad_omitted", "use_cache",
                    "config_procs", "mask_omitted", "in_thread", "prefill_chunk_size", "output_hidden_states",
                    "output_attentions", "streamer_raises"):
            if key in turn:
                yield variant(lambda s, i=i, key=key: s["turns"][i].pop(key))
        for key, low in (("max_new_tokens", 1), ("prompt_len", 2), ("user_len", 1)):
            if turn.get(key, low) > low:
                yield variant(lambda s, i=i, key=key: s["turns"][i].__setitem__(key, s["turns"][i][key] - 1))
        if isinstance(turn.get("eos"), list) and len(turn["eos"]) > 1:
            for j in range(len(turn["eos"])):
                yield variant(lambda s, i=i, j=j: s["turns"][i]["eos"].pop(j))


def shrink(sc: dict, fails, budget: int = 120) -> dict:
    """The smallest variant of the failing `sc` that `fails(variant)` still says fails (greedy, `budget` tries)."""
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for candidate in _candidates(sc):
            tries += 1
            if fails(candidate):
                sc, progress = candidate, True
                break
            if tries >= budget:
                break
    return sc
