"""Runs one usage scenario (usage_scenarios.py) on stock transformers and with `async_stopping_criteria=True`, and
compares everything the caller can observe, bit for bit.

Observed after each turn (each generate() call): the output (sequences, scores, logits, the returned cache's whole
state) or the exception (type and message), the user cache's whole state (`adversarial_helpers.cache_state`: keys,
values, counters), every streamer put and end, what each processor and criterion received at each call (ids and
scores, copied) and what it kept by reference, what nested generate() calls returned, the settings the callbacks
changed, and one `torch.rand(4)` draw (the RNG state); for issue 25's dimensions (usage_dimensions.py) also the
model's module state (buffers, parameters, plain attributes such as a rotary module's cached length; hook counts on a
model built for the run), whether the output's and the cache's tensors are inference tensors, the grad / inference
mode right after the call, one Python `random` draw and the callbacks' module and class globals, what a hook or a
class-level forward installed by the caller saw, and (aliasing probe) which returned / received tensors alias.
The next turn is built from the run's own output and cache, so a cache left wrong by one turn shows in the next. A
turn where stock raises (other than a callback's deliberate `Boom`, or `Interrupt`, a KeyboardInterrupt) ends the
scenario; the flag must raise the same there, and the scenario counts as "stock errs".
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
import threading
import traceback

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

import transformers_async_stop as tas

from adversarial_helpers import Boom, Interrupt, cache_state, config_cache, judge_model, static_cache
from family_models import build_family
from latent_models import build_latent
from models import PAD, build, stock
import usage_assisted_draws
import usage_modules
import usage_mutators
from usage_callbacks import Context, KeepingStreamer, make_criterion, make_processor, observed
from usage_mutators import Mutator
from usage_state import alias_signature, grad_context, graphed_context, module_state, output_tensors, rope_config, \
    rope_family, tensor_flags

VOCAB = 48
ROOMY = 100
LAST_FORWARD: list = []  # the last `check`'s flag run: each call's `last_path().forward` (the fuzzer's counts)
LAST_VERIFY: list = []  # and each call's `last_path().verify` (assisted decoding's verify forward, issue 32)
LAST_ACCEPTANCE: list = []  # and each call's `last_path().acceptance` (a greedy round's acceptance graph, issue 38)


@functools.lru_cache(maxsize=None)
def model_of(family, attn, model_seed, device, dtype="float32"):
    model = build(family, seed=model_seed, device=device, attn=attn, dtype=getattr(torch, dtype))
    model._usage_fresh = set(vars(model)) | {"_usage_fresh"}
    return model


@functools.lru_cache(maxsize=None)
def judge_of(device):
    return judge_model().to(device)


class Result:
    def __init__(self):
        self.trace = []  # one dict per turn
        self.used = []  # per user StaticCache created: the most positions any turn left written
        self.measure = False  # the run that sizes the user caches (`_rooms`): it records each layer's high-water mark
        self.stock_err = None  # (turn, type, message) of a non-Boom exception
        self.where = {}  # turn -> where its exception was raised (the last frames; not compared, printed on a failure)
        self.forward = []  # per turn: `last_path().forward` of the flag run's call (not compared: stock has none)
        self.verify = []  # per turn: `last_path().verify` of the flag run's call (the same)
        self.acceptance = []  # per turn: `last_path().acceptance` of the flag run's call (the same)


def _tokens(seed, shape, device, sc=None):
    repeated = usage_assisted_draws.tokens(sc or {}, seed, shape, device)  # (issue 32: n-grams for prompt lookup)
    if repeated is not None:
        return repeated
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, shape, generator=g).to(device)


def _norm(x):
    """Plain, comparable data: tensors copied to the host, caches flattened to their whole state."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if hasattr(x, "layers") or type(x).__name__.endswith("Cache"):
        return {k: _norm(v) for k, v in cache_state(x).items()}
    if hasattr(x, "keys") and callable(x.keys) and hasattr(x, "__getitem__"):
        return {k: _norm(x[k]) for k in x.keys()}
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    return x


def diff(a, b, path="") -> str | None:
    """Where `a` and `b` differ (None: identical, NaNs compared as equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        if not bool(same.all()):
            bad = (~same).nonzero()[:3].tolist()
            return f"{path}: values differ at {bad} (of {tuple(a.shape)}); stock {a.flatten()[:8].tolist()}, " \
                   f"flag {b.flatten()[:8].tolist()}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} only on one side"
        for k in a:
            d = diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):  # the first differing item before the lengths
            d = diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path}: length {len(a)} vs {len(b)}"
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None  # a host read (`.item()`) of a NaN on both sides (seed 10761: the fuzzer's false failure)
    return None if a == b else f"{path}: stock {a!r} vs flag {b!r}"


def _module_state(model):
    """The model's state after a call, or a note where torch refuses to read it: a forward run by torch.compile's
    CUDA graphs (trees) that kept one of its outputs on the model (a dynamic rope's `inv_freq`) leaves a tensor the
    next run overwrote, and reading it raises (fuzzer seed 367). That is stock's own model: the note is the same in
    both runs, and a run that left it readable differs."""
    try:
        return _norm(module_state(model, hooks=getattr(model, "_usage_own", False)))
    except RuntimeError as exc:
        if "overwritten by a subsequent run" not in str(exc):
            raise
        return "unreadable: a torch.compile CUDA-graph output, overwritten by a later run"


def _positions_used(cache) -> int:
    keys = cache.layers[0].keys
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return 0
    used = (keys != 0).any(-1).any(1).any(0).nonzero()
    return int(used[-1]) + 1 if used.numel() else 0


def _new_cache(sc, model, batch, result, rooms):
    kind = sc["cache"]
    if kind == "user_dynamic":
        return config_cache(model)
    if kind == "user_static":
        i = len(result.used)
        result.used.append(0)
        room = sc.get("room", "roomy")
        size = ROOMY if room == "roomy" or rooms is None else max(rooms[i] + room, 1)
        cache = static_cache(model, size, batch_size=batch)
        if result.measure:
            _track_writes(cache, result.used, i)
        return cache
    return None


def _track_writes(cache, used, i):
    """Record in used[i] the most positions any layer's update wrote: a cache reset mid-call (a mutator) zeroes the
    keys afterwards, so the written keys seen after the turn under-count, and a cache sized from them overflows in
    stock itself (a device-side assert that ends the process on CUDA). Only the sizing run carries this wrapper."""
    for layer in cache.layers:
        def update(*args, _orig=layer.update, _layer=layer, **kwargs):
            out = _orig(*args, **kwargs)
            used[i] = max(used[i], int(_layer.get_seq_length()))
            # (older releases' get_seq_length counts non-zero keys: a written position holding zeros is missed)
            pos = (args[2] if len(args) > 2 else kwargs.get("cache_kwargs") or {}) or {}
            pos = pos.get("cache_position") if isinstance(pos, dict) else None
            if pos is not None and pos.numel():
                used[i] = max(used[i], int(pos.max()) + 1)
            return out

        layer.update = update


def _fresh(model):
    """Drop what generate() left on the model (the static cache it keeps for cache_implementation="static",
    `_cache`, `_previous_max_cache_length`, reused larger in later calls): both runs start from the fresh model."""
    for name in set(vars(model)) - model._usage_fresh:
        delattr(model, name)


def _model(sc, device, model_seed, shared=False):
    """The scenario's model: a cached one, or a fresh one for a scenario whose callbacks change the model (hooks,
    parameters, attention), whose rotary module keeps state (rope), whose config carries a window (`window`), of a
    found family (`found_family`) or a latent-attention one (`latent_family`) or that runs the emulated graphed forward: each run starts from the built model."""
    dtype = sc.get("dtype", "float32")
    mutates = any(t.get("before") or any(c["kind"] == "mutator" for c in t["processors"] + t["criteria"])
                  for t in sc["turns"]) or bool(sc.get("user_module"))  # (issue 31: a user module changes it)
    mutates = mutates or usage_assisted_draws.needs_own_model(sc)  # (issue 32: a copy sharing its config)
    # an emulated graphed scenario (issue 27) too: transformers keeps the output-capturing hooks a call asking for
    # hidden states installed on a shared model, and every later scenario's graphed forward would step aside there
    # (not for two threads: they share the cached model, and each thread's scenario runs with `shared`)
    if sc.get("found_family"):
        model = found_model(sc, device, model_seed)
    elif sc.get("latent_family"):
        model = latent_model(sc, device, model_seed)
    elif not sc.get("rope") and not sc.get("window") and not mutates and (sc.get("graphed") != "emulated" or shared):
        return model_of(sc["family"], sc["attn"], model_seed, device, dtype)
    else:
        model = _hand_read_model(sc, device, model_seed)
    model._usage_own = True  # built for this run alone
    model._usage_fresh = set(vars(model)) | {"_usage_fresh"}
    return model


def _hand_read_model(sc, device, model_seed):
    dtype = sc.get("dtype", "float32")
    family = rope_family(sc["family"], sc.get("rope"))
    config_kwargs = rope_config(family, sc.get("rope"))
    if sc.get("window"):
        config_kwargs["sliding_window"] = sc["window"]  # (usage_dimensions.WINDOW_FAMILIES)
    return build(family, seed=model_seed, device=device, attn=sc["attn"], dtype=getattr(torch, dtype),
                 config_kwargs=config_kwargs)


def found_model(sc, device, model_seed=0):
    """The scenario's found family (usage_dimensions.FOUND_FAMILIES) built from its config class at its defaults
    (tests/family_models.py), its weights from the scenario's seed, built for each run. The drawn attention where the
    release builds the family with it, else eager (transformers refuses SDPA for Gemma 2 on 5.24, for GPT-J before
    5.24): each run builds it the same."""
    dtype = getattr(torch, sc.get("dtype", "float32"))
    seed = sc["seed"] + model_seed
    try:
        return build_family(sc["found_family"], device=device, dtype=dtype, seed=seed, attn=sc["attn"])
    except ValueError:
        if sc["attn"] == "eager":
            raise
        return build_family(sc["found_family"], device=device, dtype=dtype, seed=seed, attn="eager")


def latent_model(sc, device, model_seed=0):
    """The scenario's multi-head latent attention family (usage_dimensions.LATENT_FAMILIES) built from its config class
    at its defaults but for the sizes (tests/latent_models.py), its weights from the scenario's seed, built for each
    run, with the drawn attention (else eager, as `found_model`)."""
    dtype = getattr(torch, sc.get("dtype", "float32"))
    seed = sc["seed"] + model_seed
    try:
        return build_latent(sc["latent_family"], device=device, dtype=dtype, seed=seed, attn=sc["attn"])
    except ValueError:
        if sc["attn"] == "eager":
            raise
        return build_latent(sc["latent_family"], device=device, dtype=dtype, seed=seed, attn="eager")


def _inputs(sc, turn, t, model, device, state, result, rooms, grad):
    """The turn's conversation, mask and cache (`state`: conv, mask, cache, cache_i), made where the turn says (a
    cache made inside `inference_mode` only for a call made inside it too: stock's cache updates outside it raise)."""
    batch = turn["batch"]
    conv, mask, cache = state["conv"], state["mask"], state["cache"]
    if conv is None or turn.get("restart") or batch != conv.shape[0]:
        conv = _tokens(sc["seed"] * 101 + t, (batch, turn["prompt_len"]), device, sc)
        mask = torch.ones_like(conv)
        if turn["left_pad"]:
            for row in range(batch):
                # (a batch-1 assisted scenario pads its row as drawn: issue 32)
                pad = min(row % 3 or usage_assisted_draws.first_row_pad(sc), turn["prompt_len"] - 1)
                conv[row, :pad], mask[row, :pad] = PAD, 0
        if not (turn.get("stale_cache") and cache is not None):
            with contextlib.nullcontext() if grad == "inference_mode" else torch.inference_mode(False):
                cache = _new_cache(sc, model, batch, result, rooms)
            state["cache_i"] = len(result.used) - 1
    else:
        user = _tokens(sc["seed"] * 101 + t, (batch, turn["user_len"]), device, sc)
        conv, mask = torch.cat([conv, user], 1), torch.cat([mask, torch.ones_like(user)], 1)
    state.update(conv=conv, mask=mask, cache=cache)


def run_scenario(sc, flag, device="cpu", rooms=None, rng_draws=True, model_seed=0, reset=True,
                 measure=False) -> Result:
    model = _model(sc, device, model_seed, shared=not rng_draws)  # (no RNG draws: two threads, one model maybe)
    judge = judge_of(device)  # built before the seed: building it reseeds the RNG
    if reset:
        _fresh(model)
    user = usage_modules.install(sc, model, device)  # issue 31: the user's own modules (None: none drawn)
    target = model if user is None else user.model
    helper = usage_assisted_draws.assistant(sc, target, device)  # issue 32 (None: none, or prompt lookup)
    try:
        return _turns(sc, flag, device, rooms, rng_draws, measure, target, judge, user, helper)
    finally:
        if user is not None:
            user.close()  # (torch's backend settings and the module globals put back)


def _turns(sc, flag, device, rooms, rng_draws, measure, model, judge, user, helper=None) -> Result:
    result = Result()
    result.measure = measure
    torch.manual_seed(sc["seed"])
    if rng_draws:  # (two threads share Python's RNG and the callbacks' globals: their scenarios draw none)
        random.seed(sc["seed"])
        usage_mutators.reset_hidden()
    state = {"conv": None, "mask": None, "cache": None, "cache_i": -1}
    for t, turn in enumerate(sc["turns"]):
        with grad_context(turn.get("made_in")):
            _inputs(sc, turn, t, model, device, state, result, rooms, turn.get("grad", sc.get("grad")))
        conv, mask, cache = state["conv"], state["mask"], state["cache"]
        past = int(cache.get_seq_length()) if cache is not None else 0
        ids = conv[:, past:] if turn["feed"] == "new" and cache is not None else conv
        kwargs = {"do_sample": sc["do_sample"]}
        if not turn.get("mask_omitted"):
            kwargs["attention_mask"] = mask
        for key, value in turn.get("config_procs", {}).items():
            kwargs[key] = ({tuple(k): b for k, b in value} if key == "sequence_bias"
                           else tuple(value) if key == "exponential_decay_length_penalty" else value)
        kwargs.update({k: sc[k] for k in ("top_k", "top_p", "temperature") if k in sc})
        eos = turn["eos"]
        if eos != "config":
            kwargs["eos_token_id"] = eos
        kwargs["pad_token_id"] = None if turn.get("pad_omitted") else PAD
        if "max_new_tokens" in turn:
            kwargs["max_new_tokens"] = turn["max_new_tokens"]
        else:
            kwargs["max_length"] = ids.shape[1] + turn["max_length_extra"]
        for key in ("min_new_tokens", "use_cache", "num_return_sequences", "output_scores", "output_logits",
                    "output_hidden_states", "output_attentions", "prefill_chunk_size"):
            if key in turn:
                kwargs[key] = turn[key]
        kwargs["return_dict_in_generate"] = turn["return_dict"]
        kwargs.update(usage_assisted_draws.call_kwargs(sc, helper))
        if turn.get("alias_probe"):  # the probe looks at the per-step scores and logits: both asked for
            kwargs.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
        if cache is not None:
            kwargs["past_key_values"] = cache
        elif sc["cache"] in ("returned_static", "config_static"):
            kwargs["cache_implementation"] = "static"
        if device != "cpu" and "static" in sc["cache"] and not sc.get("compile"):
            kwargs["disable_compile"] = True
        if turn["cache_position"] and past <= conv.shape[1]:
            # (after a turn that raised, the cache can hold more than the conversation: nothing to give then)
            kwargs["cache_position"] = torch.arange(past, conv.shape[1], device=device)
        ctx = Context(model, judge)
        eos_list = None if eos is None else [2] if eos == "config" else eos
        ctx.cache, ctx.eos, ctx.prompt_len = cache, eos_list, ids.shape[1]
        ctx.alias_probe = bool(turn.get("alias_probe"))
        ctx.user = user
        procs = [make_processor(s, ctx, eos_list, ids.shape[1]) for s in turn["processors"]]
        ctx.processors = procs
        crits = [make_criterion(s, ctx) for s in turn["criteria"]]
        lists = turn.get("before") or any(c["kind"] == "mutator" for c in turn["processors"] + turn["criteria"])
        if procs or lists:  # (a mutator may append to the lists: it gets them even when empty)
            kwargs["logits_processor"] = ctx.plist = LogitsProcessorList(procs)
        if crits or lists:
            kwargs["stopping_criteria"] = ctx.clist = StoppingCriteriaList(crits)
        streamer = KeepingStreamer(turn.get("streamer_raises")) if turn["streamer"] else None
        if streamer is not None:
            kwargs["streamer"] = streamer
        via = sc.get("flag_via", "kwarg")
        if via == "generation_config":  # both runs pass a copy of the model's config; the flag run sets the flag on it
            kwargs["generation_config"] = ctx.gen_config = copy.deepcopy(model.generation_config)
            if flag:
                kwargs["generation_config"].async_stopping_criteria = True
        elif flag and via == "kwarg":
            kwargs["async_stopping_criteria"] = True
        if turn["embeds"]:
            with torch.no_grad(), grad_context(turn.get("made_in")):
                kwargs["inputs_embeds"] = model.get_input_embeddings()(ids)
        before = Mutator(turn["before"], ctx) if turn.get("before") else None
        try:
            if before is not None:
                before.apply()  # the caller changes something between two calls
            if user is not None:
                user.before(turn)
            with graphed_context(sc.get("graphed") if flag else None), \
                    (user.around(turn) if user is not None else contextlib.nullcontext()):  # issue 27 / 31
                out, err, modes, path = _call(model, None if turn["embeds"] else ids, kwargs, turn.get("in_thread"),
                                              flag and via == "model_config", turn.get("grad", sc.get("grad")))
        finally:
            usage_mutators.restore_classes()
        result.forward.append(getattr(path, "forward", None) if flag else None)
        result.verify.append(getattr(path, "verify", None) if flag else None)
        result.acceptance.append(getattr(path, "acceptance", None) if flag else None)
        if err is not None:
            exc, err = err, (type(err).__name__, str(err))
            result.where[t] = "".join(traceback.format_exception(exc)[-4:])
            if not isinstance(exc, (Boom, Interrupt)) and result.stock_err is None:
                result.stock_err = (t,) + err
        entry = {"turn": t, "error": err, "output": _norm(out), "callbacks": _norm(observed(procs + crits, ctx)),
                 "streamer": None if streamer is None else _norm(streamer.observed()), "grad_modes": modes,
                 "flags": tensor_flags(out)}
        if rng_draws:  # (two threads on one model: the other thread's call has hooks of its own on the modules now)
            entry["modules"] = _module_state(model)
        if before is not None:
            entry["before"] = _norm(before.observe())
        if user is not None:
            entry["user"] = _norm(user.observe())
        if helper is not None:  # the assistant's generation config, and a draft's own state
            entry["assistant"] = usage_assisted_draws.observe(helper)
            if sc["assisted"]["kind"] == "draft":
                entry["draft_modules"] = _module_state(helper)
        if ctx.alias_probe:
            entry["alias"] = _aliases(out, procs + crits, streamer)
        if rng_draws:
            entry["rand"] = torch.rand(4, device=device).cpu()
            if device != "cpu":
                entry["rand_cpu"] = torch.rand(4)
            entry["py_rand"] = random.random()
            entry["hidden"] = usage_mutators.hidden_globals()
        if cache is not None:
            entry["cache"] = _norm(cache)
            entry["cache_flags"] = tensor_flags(cache)
            if sc["cache"] == "user_static" and state["cache_i"] >= 0:
                result.used[state["cache_i"]] = max(result.used[state["cache_i"]], _positions_used(cache))
        result.trace.append(entry)
        if err is not None and result.stock_err is not None:
            break
        if out is not None:
            seqs = out if isinstance(out, torch.Tensor) else out.sequences
            if sc["cache"].startswith("returned"):
                state["cache"] = getattr(out, "past_key_values", None)
            if seqs.shape[0] != conv.shape[0]:
                state["conv"] = state["cache"] = None  # num_return_sequences: the next turn starts a new conversation
                continue
            gen = seqs if turn["embeds"] else seqs[:, ids.shape[1]:]
            keep = torch.ones_like(gen)
            if eos_list:  # the pads after a row's EOS are not part of the conversation
                hit = torch.isin(gen, torch.tensor(eos_list, device=gen.device)).long()
                keep = ((hit.cumsum(1) - hit) == 0).long()
            state["conv"], state["mask"] = torch.cat([conv, gen], 1), torch.cat([mask, keep.to(mask.dtype)], 1)
    return result


def _aliases(out, callbacks, streamer):
    """Which tensors the caller got are one object or share storage (usage_state.alias_signature): the output's
    scores and logits, what each recording callback received and kept, what the streamer got."""
    named = output_tensors(out)
    for k, cb in enumerate(callbacks):
        for c, (ids, scores) in enumerate(getattr(cb, "objs", ())):
            named += [(f"cb{k}.call{c}.ids", ids), (f"cb{k}.call{c}.scores", scores)]
        named += [(f"cb{k}.kept{r}", ref) for r, ref in enumerate(getattr(cb, "refs", ()))]
    if streamer is not None:
        named += [(f"streamer{i}", ref) for i, ref in enumerate(streamer.refs)]
    return alias_signature(named)


def _call(model, ids, kwargs, in_thread, flag_on_model, grad=None):
    """generate() (in a worker thread if asked) inside the autograd context `grad`: (output, None, modes, path) or
    (None, the exception, modes, path); modes: the grad / inference mode seen right after the call, inside the
    context; path: the call's `last_path()` (read in the calling thread: it is per thread)."""
    box = [None, None, None, None]

    def call():
        with grad_context(grad):
            try:
                box[0] = model.generate(ids, **kwargs)
            except (Exception, Interrupt) as exc:  # noqa: BLE001 - an exception is an observable: type, message
                box[1] = exc
            box[2] = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            box[3] = tas.last_path() if tas.is_patched() else None

    config = model.generation_config
    old = config.__dict__.get("async_stopping_criteria", box)
    if flag_on_model:
        config.async_stopping_criteria = True
    try:
        if in_thread:
            worker = threading.Thread(target=call)
            worker.start()
            worker.join()
        else:
            call()
    finally:
        if flag_on_model and old is box:
            del config.async_stopping_criteria
        elif flag_on_model:
            config.async_stopping_criteria = old
    return box[0], box[1], box[2], box[3]


def _rooms(sc, device, model_seed=0):
    if sc["cache"] != "user_static" or sc.get("room", "roomy") == "roomy":
        return None
    with stock():
        return run_scenario(sc, False, device, None, model_seed=model_seed, measure=True).used


def _raised(result) -> str:
    """Where the flag run's exceptions were raised, for a failure's detail."""
    return "".join(f"\n  turn {t} raised at:\n{where}" for t, where in sorted(result.where.items()))


def check(sc, device="cpu"):
    """('pass' | 'fail' | 'stock_err', detail) for one scenario."""
    LAST_FORWARD.clear()
    LAST_VERIFY.clear()
    if "encoder_decoder" in sc:  # (an encoder-decoder sub-scenario: usage_dimensions._encoder_decoder)
        from usage_encoder_decoder import check as check_encoder_decoder

        status, detail, LAST_FORWARD[:] = check_encoder_decoder(sc, device)
        return status, detail
    if "threads" in sc:
        from usage_threads import check_threads  # (it runs this module's scenarios)

        return check_threads(sc, device)
    rooms = _rooms(sc, device)
    with stock():
        ref = run_scenario(sc, False, device, rooms)
    on = run_scenario(sc, True, device, rooms)
    LAST_FORWARD[:] = on.forward
    LAST_VERIFY[:] = on.verify
    LAST_ACCEPTANCE[:] = on.acceptance
    d = diff(ref.trace, on.trace, "turns")
    if d:
        return "fail", d + _raised(on)
    if ref.stock_err is not None:
        return "stock_err", f"turn {ref.stock_err[0]}: {ref.stock_err[1]}: {ref.stock_err[2][:200]}"
    return "pass", ""
