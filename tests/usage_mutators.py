"""Issue 25's user callbacks for the usage fuzzer (drawn by usage_dimensions.py, run by usage_runner.py).

- `Mutator`: user code that changes something mid-call, as a criterion or a processor at its call `at`, or by the
  caller between two calls (`before`): a forward hook or pre-hook on the model or a submodule (recording what it
  receives, and at times changing the logits), `set_attn_implementation`, a class-level `forward` wrapper (restored by
  `restore_classes()` after the call), a parameter changed in place or replaced, the cache cropped or reset, the
  generation config changed, a processor or criterion appended to the lists passed to generate();
- `EditIds`: a criterion or processor that edits `input_ids` in place (the last column or an earlier one);
- `Hidden`: a processor keeping state where a purity proof must look: a Python attribute on the scores, the ids or a
  held tensor, the CPU / device global generators, an explicit `torch.Generator`, Python's `random`, a closure, a
  module global, a class attribute. It records nothing of its own (a recording callback is impure on its face);
  its state shows in the scores it returns and in `observe()` after the call;
- `Width`: a processor that narrows (`scores[:, :V']`) or widens (-inf columns) the scores, and `builtin()`:
  transformers' own processors passed by the user after it (so they see the other width);
- `shaped`: a criterion's verdict returned as (batch, 1) and/or as long / uint8.
"""

from __future__ import annotations

import functools
import random

import torch
from transformers import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StoppingCriteria,
    SuppressTokensLogitsProcessor,
)

_GLOBAL = {"count": 0}  # a module global a processor counts in (reset by `reset_hidden`)
_CLASS_PATCHES: list = []  # (class, name, original) to put back after each call


def reset_hidden():
    _GLOBAL["count"] = 0
    Hidden.count = 0


def hidden_globals() -> dict:
    return {"global": _GLOBAL["count"], "class": Hidden.count}


def restore_classes():
    while _CLASS_PATCHES:
        cls, name, original = _CLASS_PATCHES.pop()
        setattr(cls, name, original)


def shaped(result, spec):
    """A criterion's (batch,) bool verdict as the spec's `ret` asks: (batch, 1) and/or another dtype."""
    ret = spec.get("ret")
    if not ret or not isinstance(result, torch.Tensor):
        return result
    if ret.get("shape") == "col":
        result = result[:, None]
    return result.to(getattr(torch, ret.get("dtype", "bool")))


def _summary(value):
    """What a hook received, as plain comparable data (tensors copied)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.detach().to("cpu", copy=True))
    if isinstance(value, (tuple, list)):
        return [_summary(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _onehot(width, column, like):
    return torch.nn.functional.one_hot(torch.tensor(column % width, device=like.device), width).to(like.dtype)


def _perturb(output, token):
    """The output with 0.75 added to the column `token` of its logits (a tensor or a model output's `.logits`)."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        return output
    bumped = logits + 0.75 * _onehot(logits.shape[-1], token, logits)
    if isinstance(output, torch.Tensor):
        return bumped
    output.logits = bumped
    return output


def _target(model, name):
    if name == "decoder":
        return model.base_model
    if name == "layer":
        layers = [m for n, m in model.named_modules() if n.endswith(("layers.0", "h.0"))]
        return layers[0] if layers else model
    if name == "head":
        return model.get_output_embeddings() or model
    return model


class AddBias(LogitsProcessor):
    """What a mid-call `proc_list` mutation appends: +1.5 on one column."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        return scores + 1.5 * _onehot(scores.shape[-1], self.token, scores)


class StopRow(StoppingCriteria):
    """What a mid-call `crit_list` mutation appends: stops row `row` (mod batch)."""

    def __init__(self, row):
        self.row = row

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.row % input_ids.shape[0]] = True
        return done


class Mutator:
    """Changes one thing (`spec["what"]`) at its call `at` (as a processor or a criterion: the two subclasses), or
    when the caller runs `apply()` between calls."""

    def __init__(self, spec, ctx):
        self.spec = spec
        self.ctx = ctx
        self.calls = 0
        self.records = []  # what the hooks and the class wrapper received, per model call
        self.done = []  # what the change did (or why it did nothing)

    def _tick(self):
        call, self.calls = self.calls, self.calls + 1
        if call == self.spec["at"]:
            self.apply()

    def _record(self, what, args, kwargs):
        self.records.append((what, _summary(list(args)),
                             {k: _summary(v) for k, v in sorted(kwargs.items())}))

    def apply(self):
        s, ctx, model = self.spec, self.ctx, self.ctx.model
        what = s["what"]
        if what in ("forward_hook", "forward_pre_hook"):
            module = _target(model, s.get("target", "model"))

            def pre_hook(mod, args, kwargs):
                self._record("pre", args, kwargs)

            def post_hook(mod, args, kwargs, output):
                self._record("post", args, kwargs)
                return _perturb(output, s.get("token", 5)) if s.get("perturb") else None

            if what == "forward_hook":
                module.register_forward_hook(post_hook, with_kwargs=True)
            else:
                module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        elif what == "set_attn":
            to = "eager" if model.config._attn_implementation != "eager" else "sdpa"
            if hasattr(model, "set_attn_implementation"):
                try:
                    model.set_attn_implementation(to)
                except ValueError as exc:
                    # a family the release builds without SDPA (a found family: Gemma 2 on 5.24, GPT-J before 5.24)
                    # refuses it: the caller sees the refusal (observed), its model unchanged; between two calls it
                    # would end the scenario outside generate() (fuzzer seed 5822, --graphed emulated, 5.24)
                    self.done.append(("refused", to, type(exc).__name__))
                    return
            else:
                model.config._attn_implementation = to
            self.done.append(to)
        elif what == "class_forward":
            cls = type(model)
            original = cls.forward
            token = s.get("token", 5)

            @functools.wraps(original)
            def forward(this, *args, **kwargs):
                self._record("class", args, kwargs)
                return _perturb(original(this, *args, **kwargs), token)

            _CLASS_PATCHES.append((cls, "forward", original))
            cls.forward = forward
        elif what in ("param_inplace", "param_replace"):
            params = list(model.named_parameters())
            name, param = params[int(s.get("frac", 0.5) * len(params)) % len(params)]
            with torch.inference_mode(False), torch.no_grad():
                if what == "param_inplace":
                    param.mul_(1.25)
                else:
                    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                    setattr(owner, name.rpartition(".")[2], torch.nn.Parameter(param.detach() * 1.25))
            self.done.append(name)
        elif what in ("cache_crop", "cache_reset"):
            cache = ctx.cache
            if cache is None or not hasattr(cache, "crop" if what == "cache_crop" else "reset"):
                self.done.append("no cache")
            elif what == "cache_crop":
                cache.crop(max(int(cache.get_seq_length()) - 1, 0))
            else:
                cache.reset()
        elif what == "gen_config":
            config = ctx.gen_config if s.get("target") == "passed" and ctx.gen_config is not None \
                else model.generation_config
            setattr(config, s["field"], s["value"])
        elif what == "proc_list":
            if ctx.plist is not None:
                ctx.plist.append(AddBias(s.get("token", 5)))
        elif what == "crit_list":
            if ctx.clist is not None:
                ctx.clist.append(StopRow(s.get("row", 0)))
        else:
            raise ValueError(what)

    def observe(self):
        return ("mutator", self.spec["what"], self.calls, self.records, self.done)


class MutatorProc(Mutator, LogitsProcessor):
    def __call__(self, input_ids, scores):
        self._tick()
        return scores


class MutatorCrit(Mutator, StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        self._tick()
        return shaped(torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device), self.spec)


class EditIds:
    """Edits `input_ids[:, col]` in place at call `at` (and every second call after it if `every`)."""

    def __init__(self, spec):
        self.spec = spec
        self.calls = 0

    def _edit(self, input_ids):
        call, self.calls = self.calls, self.calls + 1
        s = self.spec
        hit = call == s["at"] or (s.get("every") and call > s["at"] and (call - s["at"]) % 2 == 0)
        if hit and input_ids.shape[1] >= 2:
            col = s["col"]
            input_ids[:, col] = (input_ids[:, col] * 7 + 3) % 48

    def observe(self):
        return ("edit_ids", self.calls)


class EditIdsProc(EditIds, LogitsProcessor):
    def __call__(self, input_ids, scores):
        self._edit(input_ids)
        return scores


class EditIdsCrit(EditIds, StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        self._edit(input_ids)
        return shaped(torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device), self.spec)


def make(spec, ctx, role):
    """The issue-25 callback of `spec` as a processor or a criterion (role), or None if the kind is not one."""
    kind = spec["kind"]
    if kind == "mutator":
        return (MutatorCrit if role == "criterion" else MutatorProc)(spec, ctx)
    if kind == "edit_ids":
        return (EditIdsCrit if role == "criterion" else EditIdsProc)(spec)
    if role == "criterion":
        return None
    if kind == "hidden":
        return closure_processor(spec) if spec["store"] == "closure_fn" else Hidden(spec, ctx.model.device)
    if kind == "width":
        return Width(spec)
    if kind == "builtin":
        return builtin(spec, ctx.eos, ctx.prompt_len, ctx.model.device)
    return None


def _closure_counter():
    n = 0

    def step(peek=False):
        nonlocal n
        if not peek:
            n += 1
        return n

    return step


class Hidden(LogitsProcessor):
    """Adds a bump to a column picked by (or scaled by) state kept where `spec["store"]` says."""

    count = 0  # the class attribute `class_attr` counts in

    def __init__(self, spec, device):
        self.spec = spec
        self.token = spec.get("token", 7)
        store = spec["store"]
        if store == "attr_held":
            self.held = torch.zeros((), device=device)
        elif store == "generator":
            where = "cpu" if spec.get("gen_device") == "cpu" else device
            self.gen = torch.Generator(device=where).manual_seed(spec.get("gen_seed", 0))
        elif store == "closure":
            self.step = _closure_counter()

    def _column_bump(self, scores, n):
        return scores + 2.0 * _onehot(scores.shape[-1], self.token + n, scores)

    def _scaled_bump(self, scores, r):
        return scores + 3.0 * r * _onehot(scores.shape[-1], self.token, scores)

    def __call__(self, input_ids, scores):
        store = self.spec["store"]
        if store in ("attr_scores", "attr_ids"):
            t = scores if store == "attr_scores" else input_ids
            n = getattr(t, "_usage_mark", 0)
            t._usage_mark = n + 1
            return self._column_bump(scores, n)
        if store == "attr_held":
            n = getattr(self.held, "n", 0)
            self.held.n = n + 1
            return self._column_bump(scores, n)
        if store == "cpu_rng":
            return self._scaled_bump(scores, torch.rand(()).to(scores.device))
        if store == "device_rng":
            return self._scaled_bump(scores, torch.rand((), device=scores.device))
        if store == "generator":
            r = torch.rand((), generator=self.gen, device=self.gen.device)
            return self._scaled_bump(scores, r.to(scores.device))
        if store == "py_random":
            return self._scaled_bump(scores, random.random())
        if store == "closure":
            return self._column_bump(scores, self.step())
        if store == "global":
            _GLOBAL["count"] += 1
            return self._column_bump(scores, _GLOBAL["count"])
        if store == "class_attr":
            type(self).count += 1
            return self._column_bump(scores, type(self).count)
        raise ValueError(store)

    def observe(self):
        store, out = self.spec["store"], {}
        if store == "attr_held":
            out["held"] = getattr(self.held, "n", None)
        elif store == "generator":
            out["gen"] = self.gen.get_state()
        elif store == "closure":
            out["n"] = self.step(peek=True)
        return ("hidden", store, out)


def closure_processor(spec):
    """A plain function (not a LogitsProcessor) counting in its closure."""
    step = _closure_counter()
    token = spec.get("token", 7)

    def process(input_ids, scores):
        return scores + 2.0 * _onehot(scores.shape[-1], token + step(), scores)

    process.observe = lambda: ("hidden", "closure_fn", {"n": step(peek=True)})
    return process


class Width(LogitsProcessor):
    """Narrows the scores to their first V + delta columns (delta < 0) or pads them with -inf columns (delta > 0)."""

    def __init__(self, spec):
        self.spec = spec

    def __call__(self, input_ids, scores):
        delta = self.spec["delta"]
        if delta < 0:
            return scores[:, :delta]
        pad = torch.full((scores.shape[0], delta), float("-inf"), dtype=scores.dtype, device=scores.device)
        return torch.cat([scores, pad], -1)


def builtin(spec, eos, prompt_len, device):
    """One of transformers' own processors, passed by the user (after a `Width`, it sees the other width)."""
    name, v = spec["name"], spec.get("value")
    if name == "repetition_penalty":
        return RepetitionPenaltyLogitsProcessor(v)
    if name == "no_repeat_ngram":
        return NoRepeatNGramLogitsProcessor(v)
    if name == "min_new_tokens":
        return MinNewTokensLengthLogitsProcessor(prompt_len, v, eos if eos is not None else [2], device=device)
    if name == "sequence_bias":
        return SequenceBiasLogitsProcessor({(v,): -4.0})
    if name == "suppress":
        return SuppressTokensLogitsProcessor([v], device=device)
    raise ValueError(name)
