"""The usage fuzzer's encoder-decoder scenarios: the `encoder_decoder` dimension (usage_dimensions._encoder_decoder,
its own random stream '<seed>/encdec', 5.17+), drawn here as a sub-scenario (plain data) and run here against
unpatched stock with usage_runner's comparison (`diff`, `_norm`, `_call`).

Where drawn, the scenario's model is one of the encoder-decoders the dynamic-cache loop takes (and graphs: T5's
decoder stays eager), built tiny from the configs of tests/test_dynamic_loop_encoder_decoder.py (`build`), its
weights from the scenario's seed, with the drawn attention, fresh for each run. Every decoder-only field of the
scenario (family, cache kind, turns, user modules...) is left as drawn and ignored: the sub-scenario says what runs.

A sub-scenario: the family; batch 1-3; the source (text: 3-9 token ids and an encoder `attention_mask`: none, ones,
left-padded rows; Whisper: `input_features`, with a language, a task, timestamps); greedy or sampling; the autograd
context (none, no_grad, inference_mode); the flag run's graphed forward (`emulated` on the CPU / `natural` on CUDA,
or `off`); how the flag is passed; a user EncoderDecoderCache or the one generate() builds; and one or two calls,
the second continuing the first's cache with `decoder_input_ids=<the first call's sequences>` (and maybe its mask,
and another encoder mask, or the same tensor the first call's criterion edited). Per call: max_new_tokens, EOS ids,
output flags, a streamer (maybe raising), user processors and criteria of usage_callbacks (recording what they
receive), and `mask_edit`: a criterion editing the encoder mask in place mid-call.

Observed per call: the output or the exception, the user cache, the encoder mask afterwards, the callbacks' records,
the streamer's, the model's module state, grad modes, inference flags, and the RNG state (torch and Python).
"""

from __future__ import annotations

import copy
import random
import traceback

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from adversarial_helpers import Boom, Interrupt
from usage_callbacks import Context, Crit, KeepingStreamer, Proc, observed
from usage_state import graphed_context, tensor_flags

FAMILIES = {"bart": 3, "mbart": 1, "marian": 2, "pegasus": 1, "blenderbot": 1, "blenderbot_small": 1, "t5": 2,
            "whisper": 3}
MASKS = ("none", "ones", "left_pad")
GRADS = {"none": 5, "no_grad": 2, "inference_mode": 3}
PROCESSORS = {"keep_ref": 2, "mutate_scores": 2, "counter": 2, "prev_scores": 1, "host_read": 2, "raise": 2}
CRITERIA = {"mask_edit": 4, "raise": 3, "stop_row": 3, "python_bool": 1, "keep_ref": 1, "host_read": 1}
EDITS = ("zero_prefix", "ones", "zero_col")
LANGUAGES, TASKS = (None, "en", "fr"), (None, "transcribe", "translate")
TEXT_VOCAB, WHISPER_TEXT = 48, 40  # the text families' vocabulary; Whisper's text tokens (below its EOT)
TIMESTAMP_BEGIN = 50  # Whisper's first timestamp token
PREV_SOT = 47  # Whisper's previous-text token (test_dynamic_loop_encoder_decoder.build_whisper)
PAD = 0


def _weighted(rng, table):
    return rng.choices(list(table), weights=list(table.values()))[0]


def draw(rng: random.Random, device: str) -> dict:
    """A sub-scenario from `rng` (the '<seed>/encdec' stream)."""
    family = _weighted(rng, FAMILIES)
    ed = {"family": family, "batch": rng.randint(1, 3), "attn": rng.choice(("sdpa", "sdpa", "eager")),
          "do_sample": rng.random() < 0.4, "grad": _weighted(rng, GRADS),
          "graphed": ("emulated" if device == "cpu" else "natural") if rng.random() < 0.7 else "off",
          "cache": rng.choice(("returned", "returned", "user")),
          "flag_via": rng.choices(("kwarg", "generation_config", "model_config"), weights=(8, 1, 1))[0]}
    if ed["do_sample"]:
        ed["top_k"] = rng.choice((0, 5, 10))
        if rng.random() < 0.3:
            ed["temperature"] = 0.7
    whisper = family == "whisper"
    if whisper:
        ed["whisper"] = {"language": rng.choice(LANGUAGES), "task": rng.choice(TASKS),
                         "timestamps": rng.random() < 0.3}
        if rng.random() < 0.25:  # a text prompt before the start token (`prompt_ids`: the previous-text token first)
            ed["whisper"]["prompt"] = [PREV_SOT] + [rng.randrange(3, WHISPER_TEXT) for _ in range(rng.randint(1, 3))]
    else:
        ed["src_len"] = rng.randint(3, 9)
        ed["mask"] = _mask(rng, ed)
        if rng.random() < 0.2:
            ed["encoder_outputs"] = True  # the first call given the encoder's outputs, run by the user beforehand
    ed["turns"] = [_turn(rng, ed, 0)]
    if rng.random() < 0.6:
        ed["turns"].append(_turn(rng, ed, 1))
    if "whisper" not in ed and rng.random() < 0.35:
        ed["turns"][0]["config_procs"] = _config_procs(rng)
    return ed


def _config_procs(rng) -> dict:
    """generate()'s own processors, those of encoder-decoders among them (they read the encoder's input ids)."""
    tok = rng.randrange(3, TEXT_VOCAB)
    table = {"forced_bos_token_id": tok, "encoder_repetition_penalty": rng.choice((0.7, 1.5)),
             "encoder_no_repeat_ngram_size": rng.choice((1, 2)), "no_repeat_ngram_size": 2,
             "repetition_penalty": 1.3, "min_length": rng.randint(2, 8),
             "suppress_tokens": [tok + 1 if tok + 1 < TEXT_VOCAB else 3],  # (not the forced one: stock refuses)
             "bad_words_ids": [[tok]], "forced_eos_token_id": tok}
    names = rng.sample(sorted(table), rng.randint(1, 2))
    return {name: table[name] for name in names}


def _mask(rng, ed) -> dict:
    kind = rng.choice(MASKS)
    out = {"kind": kind}
    if kind == "left_pad":
        out["pads"] = [rng.randint(0, ed["src_len"] - 1) for _ in range(ed["batch"])]
    if kind != "none" and rng.random() < 0.2:
        out["bool"] = True  # a bool mask (a tokenizer's is long)
    return out


def _turn(rng, ed, t) -> dict:
    whisper = "whisper" in ed
    turn = {"max_new_tokens": rng.randint(1, 10), "return_dict": ed["cache"] == "returned" or rng.random() < 0.5}
    vocab = WHISPER_TEXT if whisper else TEXT_VOCAB
    r = rng.random()
    if whisper and ed["whisper"]["timestamps"]:
        turn["eos"] = "config"  # (the timestamp processor takes one EOS id: the config's)
    else:
        turn["eos"] = sorted(rng.sample(range(3, vocab), rng.randint(1, 3))) if r < 0.6 else \
            None if r < 0.75 else "config"
    if turn["return_dict"]:
        turn["output_scores"] = rng.random() < 0.6
        turn["output_logits"] = rng.random() < 0.4
    if rng.random() < 0.15:
        turn["min_new_tokens"] = rng.randint(1, 6)
    if rng.random() < 0.3:
        turn["streamer"] = {"raises": None}
        if rng.random() < 0.3:
            turn["streamer"]["raises"] = {"at": rng.randint(0, turn["max_new_tokens"] + 1),
                                          "interrupt": rng.random() < 0.5}
    steps = turn["max_new_tokens"]
    turn["processors"] = [_callback(rng, PROCESSORS, steps, ed) for _ in range(rng.choice((0, 0, 1, 2)))]
    turn["criteria"] = [_callback(rng, CRITERIA, steps, ed) for _ in range(rng.choice((0, 1, 1, 2)))]
    if t > 0:
        turn["decoder_mask"] = rng.random() < 0.5  # decoder_attention_mask of ones with the first call's sequences
        if not whisper:
            turn["mask"] = "same" if rng.random() < 0.5 else _mask(rng, ed)  # the same tensor, or another one
    return turn


def _callback(rng, table, steps, ed) -> dict:
    kind = _weighted(rng, table)
    if kind == "mask_edit" and "whisper" in ed:
        kind = "stop_row"  # (no encoder mask to edit)
    spec = {"kind": kind}
    if kind in ("raise", "stop_row", "python_bool", "mask_edit"):
        spec["at"] = rng.randint(0, steps)
    if kind == "raise" and spec["at"] % 3 == 2:
        spec["interrupt"] = True
    if kind in ("mutate_scores", "counter"):
        spec["token"] = rng.randrange(TEXT_VOCAB)
    if kind == "stop_row":
        spec["row"] = rng.randrange(3)
    if kind == "mask_edit":
        spec.update(edit=rng.choice(EDITS), row=rng.randrange(3), col=rng.randrange(ed["src_len"] - 1))
    return spec


# --- the run ---------------------------------------------------------------------------------------------------------
class MaskEdit(Crit):
    """A criterion that edits the encoder's `attention_mask` (the tensor passed to generate()) in place at its call
    `at`: a row's prefix zeroed (its last token kept), the whole mask set to ones, or a column zeroed (not the last)."""

    def decide(self, input_ids, scores):
        call = self.calls
        verdict = super().decide(input_ids, scores)  # (records; a `mask_edit` kind decides nothing)
        mask, s = self.ctx.encoder_mask, self.spec
        if call == s["at"] and mask is not None:
            if s["edit"] == "zero_prefix":
                mask[s["row"] % mask.shape[0], : s["col"] + 1] = 0
            elif s["edit"] == "ones":
                mask.fill_(1)
            else:
                mask[:, s["col"]] = 0
        return verdict


def build_model(ed, device, seed):
    """The family's tiny model (test_dynamic_loop_encoder_decoder.build's config and generation config), weights from
    `seed`, with the drawn attention."""
    from test_dynamic_loop_encoder_decoder import build

    base = build(ed["family"])
    torch.manual_seed(seed)
    model = type(base)._from_config(copy.deepcopy(base.config), attn_implementation=ed["attn"])
    model.generation_config = copy.deepcopy(base.generation_config)
    return model.to(device).eval()


def _source(ed, seed, device):
    g = torch.Generator().manual_seed(seed)
    if "whisper" in ed:
        return torch.randn(ed["batch"], 8, 20, generator=g).to(device)
    return torch.randint(3, TEXT_VOCAB, (ed["batch"], ed["src_len"]), generator=g).to(device)


def _encoder_mask(spec, ids):
    if spec["kind"] == "none":
        return None
    mask = torch.ones_like(ids)
    for row, pad in enumerate(spec.get("pads", ())[: ids.shape[0]]):
        ids[row, :pad], mask[row, :pad] = PAD, 0
    return mask.bool() if spec.get("bool") else mask


class Result:
    def __init__(self):
        self.trace, self.forward, self.where, self.stock_err = [], [], {}, None


def run(sc, flag, device="cpu") -> Result:
    """One run of the scenario's encoder-decoder calls (stock's when the patches are off)."""
    from usage_runner import _call, _module_state, _norm
    from transformers_async_stop.release_checks import cache_kwarg
    from usage_state import grad_context
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    ed = sc["encoder_decoder"]
    model = build_model(ed, device, sc["seed"])
    model._usage_own = True
    result = Result()
    torch.manual_seed(sc["seed"])
    random.seed(sc["seed"])
    src = _source(ed, sc["seed"], device)
    mask = None if "whisper" in ed else _encoder_mask(ed["mask"], src)
    cache, seqs, grad = None, None, ed["grad"]
    for t, turn in enumerate(ed["turns"]):
        if t > 0 and "whisper" not in ed and turn["mask"] != "same":
            mask = _encoder_mask(turn["mask"], src.clone())
        kwargs = {"do_sample": ed["do_sample"], "max_new_tokens": turn["max_new_tokens"],
                  "return_dict_in_generate": turn["return_dict"]}
        kwargs.update({k: ed[k] for k in ("top_k", "temperature") if k in ed})
        kwargs.update({k: turn[k] for k in ("output_scores", "output_logits", "min_new_tokens") if k in turn})
        if turn["eos"] != "config":
            kwargs["eos_token_id"] = turn["eos"] if turn["eos"] is None or "whisper" not in ed \
                else [model.generation_config.eos_token_id, *turn["eos"]]
        if "whisper" in ed:
            w = ed["whisper"]
            if t == 0:  # (the second call continues the first's decoder ids: its prompt is in them)
                kwargs.update({k: v for k, v in (("language", w["language"]), ("task", w["task"])) if v})
                if w["timestamps"]:
                    kwargs["return_timestamps"] = True
                if w.get("prompt"):
                    kwargs["prompt_ids"] = torch.tensor(w["prompt"], device=device)
            if not (t == 0 and w["timestamps"]):
                # timestamp tokens suppressed where none are asked for: the tiny model makes them anyway, and a
                # segment ending at timestamp 0 never advances stock's seek loop (stock hangs: seeds 28201, 51538)
                kwargs["suppress_tokens"] = list(range(TIMESTAMP_BEGIN, model.config.vocab_size))
        else:
            kwargs["pad_token_id"] = PAD
            if mask is not None:
                kwargs["attention_mask"] = mask
            kwargs.update(turn.get("config_procs", {}))
            if t == 0 and ed.get("encoder_outputs"):
                with grad_context(grad):
                    kwargs["encoder_outputs"] = model.get_encoder()(src, attention_mask=mask)
        if t == 0 and ed["cache"] == "user":
            with grad_context(grad):
                cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if t > 0 and seqs is not None:
            kwargs["decoder_input_ids"] = seqs
            if turn["decoder_mask"]:
                kwargs["decoder_attention_mask"] = torch.ones_like(seqs)
        # (Whisper with timestamps returns its sequences without the decoder prompt and the timestamp tokens: a
        # second call continues from them without the cache, which holds more positions than they have)
        if cache is not None and (t == 0 or seqs is not None and not ed.get("whisper", {}).get("timestamps")):
            kwargs[cache_kwarg.name()] = cache
        ctx = Context(model, None)
        ctx.encoder_mask = mask
        procs = [Proc(s, ctx) for s in turn["processors"]]
        crits = [(MaskEdit if s["kind"] == "mask_edit" else Crit)(s, ctx) for s in turn["criteria"]]
        ctx.processors = procs
        if procs:
            kwargs["logits_processor"] = LogitsProcessorList(procs)
        if crits:
            kwargs["stopping_criteria"] = StoppingCriteriaList(crits)
        streamer = KeepingStreamer(turn["streamer"]["raises"]) if turn.get("streamer") else None
        if streamer is not None:
            kwargs["streamer"] = streamer
        if ed["flag_via"] == "generation_config":
            kwargs["generation_config"] = copy.deepcopy(model.generation_config)
            if flag:
                kwargs["generation_config"].async_stopping_criteria = True
        elif flag and ed["flag_via"] == "kwarg":
            kwargs["async_stopping_criteria"] = True
        with graphed_context(ed["graphed"] if flag else None):
            out, err, modes, path = _call(model, src, kwargs, False, flag and ed["flag_via"] == "model_config", grad)
        result.forward.append(getattr(path, "forward", None) if flag else None)
        if err is not None:
            exc, err = err, (type(err).__name__, str(err))
            result.where[t] = "".join(traceback.format_exception(exc)[-4:])
            if not isinstance(exc, (Boom, Interrupt)) and result.stock_err is None:
                result.stock_err = (t,) + err
        result.trace.append({
            "turn": t, "error": err, "output": _norm(out), "flags": tensor_flags(out), "grad_modes": modes,
            "callbacks": _norm(observed(procs + crits, ctx)), "modules": _module_state(model),
            "streamer": None if streamer is None else _norm(streamer.observed()),
            "encoder_mask": _norm(mask), "cache": None if cache is None else _norm(cache),
            "cache_flags": None if cache is None else tensor_flags(cache),
            "rand": torch.rand(4, device=device).cpu(), "py_rand": random.random()})
        if result.stock_err is not None:
            break
        seqs = None
        if out is not None:
            seqs = out if isinstance(out, torch.Tensor) else out["sequences"]
            if ed["cache"] == "returned":
                cache = cache_kwarg.of_output(out) if not isinstance(out, torch.Tensor) else None
    return result


def check(sc, device="cpu"):
    """usage_runner.check for an encoder-decoder scenario: ('pass' | 'fail' | 'stock_err', detail, the flag run's
    per-call `last_path().forward`)."""
    from models import stock
    from usage_runner import diff

    with stock():
        ref = run(sc, False, device)
    on = run(sc, True, device)
    d = diff(ref.trace, on.trace, "turns")
    if d:
        where = "".join(f"\n  turn {t} raised at:\n{w}" for t, w in sorted(on.where.items()))
        return "fail", d + where, on.forward
    if ref.stock_err is not None:
        return "stock_err", f"turn {ref.stock_err[0]}: {ref.stock_err[1]}: {ref.stock_err[2][:200]}", on.forward
    return "pass", "", on.forward


# --- the dimension's bookkeeping (usage_dimensions) ------------------------------------------------------------------
def candidates(sc, variant):
    """Simpler variants of an encoder-decoder scenario (for usage_scenarios.shrink)."""
    ed = sc["encoder_decoder"]
    sub = lambda fn: variant(lambda s: fn(s["encoder_decoder"]))  # noqa: E731
    if ed["graphed"] != "off":
        yield sub(lambda e: e.__setitem__("graphed", "off"))
    if len(ed["turns"]) > 1:
        yield sub(lambda e: e["turns"].pop())
    for i, turn in enumerate(ed["turns"]):
        for key in ("processors", "criteria"):
            for j in range(len(turn[key])):
                yield sub(lambda e, i=i, key=key, j=j: e["turns"][i][key].pop(j))
        for key in ("streamer", "min_new_tokens", "output_scores", "output_logits", "config_procs"):
            if key in turn:
                yield sub(lambda e, i=i, key=key: e["turns"][i].pop(key))
        if turn["max_new_tokens"] > 1:
            yield sub(lambda e, i=i: e["turns"][i].__setitem__("max_new_tokens", e["turns"][i]["max_new_tokens"] - 1))
    for key, value in (("do_sample", False), ("attn", "sdpa"), ("grad", "none"), ("flag_via", "kwarg"),
                       ("batch", 1)):
        if ed[key] != value:
            yield sub(lambda e, key=key, value=value: e.__setitem__(key, value))
    for key in ("top_k", "temperature", "encoder_outputs"):
        if key in ed:
            yield sub(lambda e, key=key: e.pop(key))
    if ed.get("whisper", {}).get("prompt"):
        yield sub(lambda e: e["whisper"].pop("prompt"))
    if ed.get("mask", {}).get("kind", "none") != "none":
        yield sub(lambda e: e.__setitem__("mask", {"kind": "none"}))


def reached(sc) -> set:
    ed = sc["encoder_decoder"]
    out = {"encoder_decoder:" + ed["family"], "encoder_decoder_graphed:" + ed["graphed"],
           "encoder_decoder_grad:" + ed["grad"]}
    if "mask" in ed:
        out.add("encoder_decoder_mask:" + ed["mask"]["kind"])
    for turn in ed["turns"]:
        out.update("encoder_decoder_criterion:" + c["kind"] for c in turn["criteria"])
    if len(ed["turns"]) > 1:
        out.add("encoder_decoder:continued")
    for key, value in (("encoder_outputs", ed.get("encoder_outputs")), ("bool_mask", ed.get("mask", {}).get("bool")),
                       ("prompt_ids", ed.get("whisper", {}).get("prompt")),
                       ("timestamps", ed.get("whisper", {}).get("timestamps")),
                       ("config_procs", ed["turns"][0].get("config_procs"))):
        if value:
            out.add("encoder_decoder:" + key)
    return out


def every_value(device: str = "cpu") -> set:
    """Every value `reached` can report for sub-scenarios drawn for `device`."""
    out = {"encoder_decoder:" + f for f in FAMILIES}
    out |= {"encoder_decoder:" + k for k in ("continued", "encoder_outputs", "bool_mask", "prompt_ids", "timestamps",
                                             "config_procs")}
    out |= {"encoder_decoder_graphed:" + g for g in ("emulated" if device == "cpu" else "natural", "off")}
    out |= {"encoder_decoder_grad:" + g for g in GRADS} | {"encoder_decoder_mask:" + m for m in MASKS}
    return out | {"encoder_decoder_criterion:" + c for c in CRITERIA}
