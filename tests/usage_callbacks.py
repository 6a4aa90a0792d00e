"""The logits processors and stopping criteria the usage fuzzer (usage_scenarios.py, usage_runner.py) draws.

Each one is what a user might write: it keeps references to its inputs, mutates them in place, holds Python state,
changes another processor's attributes mid-call, reads a value on the host, raises at a call, returns another dtype
or a Python bool, or runs a nested generate(). Every callback records what it received at each call (a copy of the
`input_ids` and `scores` values, so the number of calls, the shapes and the values are all observable) and, after
the call, what it kept (`kept()`: the tensors it holds references to, read after generate() returned: stock hands a
processor a fresh `scores` each step, so references taken without `.clone()` must still hold each step's values).
Built from a spec dict (`make(spec, ctx)`), so a scenario stays plain data that can be printed and shrunk.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, MinNewTokensLengthLogitsProcessor, StoppingCriteria, \
    TemperatureLogitsWarper

from transformers.generation.streamers import BaseStreamer

from adversarial_helpers import Boom, InnerGenerate, Interrupt
import usage_modules
import usage_mutators
from models import VOCAB
from usage_mutators import shaped
from transformers_async_stop import graph_safe


class Recorder:
    def __init__(self, spec):
        self.spec = spec
        self.log = []  # per call: (input_ids copy, scores copy)
        self.refs = []  # tensors kept without a copy (read after the call)
        self.objs = []  # with the aliasing probe on: the (input_ids, scores) objects received, per call

    def record(self, input_ids, scores):
        if getattr(getattr(self, "ctx", None), "alias_probe", False):
            self.objs.append((input_ids, scores))  # the objects themselves, for the aliasing probe
        if isinstance(scores, (tuple, list)):  # a criterion gets the tuple of every step's scores (output_scores)
            scores = [x.detach().clone() for x in scores]
        elif scores is not None:
            scores = scores.detach().clone()
        self.log.append((input_ids.detach().clone(), scores))

    def kept(self):
        return [r.detach().clone() for r in self.refs]


class Proc(Recorder, LogitsProcessor):
    """One user logits processor; `spec["kind"]` picks its behaviour."""

    def __init__(self, spec, ctx):
        super().__init__(spec)
        self.ctx = ctx
        self.calls = 0
        self.prev = None

    def __call__(self, input_ids, scores):
        kind, s = self.spec["kind"], self.spec
        if kind in ("graph_safe_pure", "graph_safe_liar"):
            # a graph_safe() declaration promises no Python state: recording would break it (a captured processor
            # runs once at capture, a failed capture's attempt included, then is replayed)
            return self.graph_safe_call(scores)
        self.record(input_ids, scores)
        call, self.calls = self.calls, self.calls + 1
        vocab = scores.shape[-1]
        if kind == "raise" and call == s["at"]:
            raise (Interrupt if s.get("interrupt") else Boom)(f"processor raised at call {call}")
        if kind == "keep_ref":
            # keeps the scores and the ids it was given; steers with the previous step's (uncopied) scores
            self.refs.extend((scores, input_ids))
            if len(self.refs) >= 4:
                previous = self.refs[-4]
                scores = scores + 0.5 * (previous == previous.max(-1, keepdim=True).values)
            return scores
        if kind == "mutate_scores":
            scores[:, (call * 7 + s["token"]) % vocab] += 3.0  # in place, returns the same tensor
            return scores
        if kind == "mutate_ids":
            if call % 3 == 1:
                # edits the sequence in place, with token ids of the model (a widening Width before it pads the
                # scores past the vocabulary: such an id makes stock's next forward index past its embedding)
                input_ids[:, -1] = (input_ids[:, -1] * 7 + 3) % min(vocab, VOCAB)
            return scores
        if kind == "counter":
            scores = scores.clone()
            scores[:, (call * 5 + s["token"]) % vocab] += 2.5
            return scores
        if kind == "prev_scores":
            out = scores if self.prev is None else scores + 0.3 * torch.softmax(self.prev, -1)
            self.prev = scores.clone()
            return out
        if kind == "host_read":
            top = int(scores[0].argmax().item())
            scores = scores.clone()
            scores[:, (top + 1) % vocab] += 0.75
            return scores
        if kind == "dtype":
            return scores.to(getattr(torch, s["dtype"]))
        if kind == "nested" and input_ids.shape[1] > 0:  # (inputs_embeds: no ids to judge at the prefill)
            tokens = self.ctx.inner(s).judge(input_ids)
            scores = scores.clone()
            first = tokens[:: max(tokens.shape[0] // scores.shape[0], 1), -1].to(scores.device) % vocab
            scores[torch.arange(scores.shape[0], device=scores.device), first] += 0.5
            return scores
        return scores

    def graph_safe_call(self, scores):
        if self.spec["kind"] == "graph_safe_liar":
            # declared graph-safe but reads the host: a capture of it fails (issue 16, item 3)
            return scores * (1.0 + 0.25 * (scores.max().item() > 0))
        return scores * 1.5


class Crit(Recorder, StoppingCriteria):
    """One user stopping criterion; `spec["kind"]` picks its behaviour."""

    def __init__(self, spec, ctx):
        super().__init__(spec)
        self.ctx = ctx
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        return shaped(self.decide(input_ids, scores), self.spec)

    def decide(self, input_ids, scores):
        self.record(input_ids, scores)
        call, self.calls = self.calls, self.calls + 1
        kind, s = self.spec["kind"], self.spec
        no = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if kind == "raise" and call == s["at"]:
            raise (Interrupt if s.get("interrupt") else Boom)(f"criterion raised at call {call}")
        if kind == "stop_row":  # stops row `row` (mod batch) at call `at`
            if call >= s["at"]:
                no[s["row"] % input_ids.shape[0]] = True
            return no
        if kind == "python_bool":  # a Python bool for the whole batch
            return bool(call >= s["at"])
        if kind == "host_read":
            return no | (int(input_ids[:, -1].sum().item()) % 11 == 0)
        if kind == "keep_ref":
            self.refs.append(input_ids)
            return no
        if kind == "anneal":  # anneals the user's TemperatureLogitsWarper (issue 16, item 6)
            warper = self.ctx.find(TemperatureLogitsWarper)
            if warper is not None:
                warper.temperature = warper.temperature * s["factor"]
            return no
        if kind == "min_new_change":  # changes the user's MinNewTokensLengthLogitsProcessor (issue 16, item 7)
            proc = self.ctx.find(MinNewTokensLengthLogitsProcessor)
            if proc is not None and call == s["at"]:
                proc.min_new_tokens = s["to"]
            return no
        if kind == "nested" and input_ids.shape[1] > 0:
            self.ctx.inner(s).judge(input_ids)
            return no
        return no


class KeepingStreamer(BaseStreamer):
    """Records every put() (a copy, and the tensor itself, read again after the call: a consumer thread reading a
    queue of tensors later sees what stock gave it, so the tensors must not be reused buffers) and every end()."""

    def __init__(self, raises=None):
        self.copies, self.refs, self.ends = [], [], 0
        self.raises = raises  # {"at": put number, "interrupt": bool}: that put() raises (its consumer went away)

    def put(self, value):
        self.refs.append(value)
        self.copies.append((str(value.device), value.detach().clone()))
        if self.raises is not None and len(self.copies) - 1 == self.raises["at"]:
            raise (Interrupt if self.raises["interrupt"] else Boom)(f"streamer put {self.raises['at']}")

    def end(self):
        self.ends += 1

    def observed(self):
        return [self.copies, [r.detach().clone() for r in self.refs], self.ends]


class Context:
    """What the callbacks of one call share: the model, the call's processors, the inner-generate recorders."""

    def __init__(self, model, judge):
        self.model = model
        self.judge = judge  # the other model of a nested call (built before the run: building it seeds the RNG)
        self.processors = []
        self.inners = []
        # what issue 25's callbacks (usage_mutators.py) reach: the cache passed, the lists passed, the generation
        # config passed, the EOS ids and prompt length (transformers' own processors built by the user), the
        # aliasing probe
        self.cache = self.plist = self.clist = self.gen_config = self.eos = None
        self.prompt_len = 0
        self.alias_probe = False

    def find(self, cls):
        return next((p for p in self.processors if type(p) is cls), None)

    def inner(self, spec):
        key = id(spec)
        for k, inner in self.inners:
            if k == key:
                return inner
        model = self.model if spec["model"] == "same" else self.judge
        inner = InnerGenerate(model, flag=spec["flag"] or None, max_new_tokens=spec["new"], do_sample=False,
                              eos_token_id=None)
        self.inners.append((key, inner))
        return inner


def make_processor(spec, ctx, eos, prompt_len):
    kind = spec["kind"]
    if kind == "module_op":  # issue 31: a change to the user's module, mid-call
        return usage_modules.op_callback(spec, ctx, "processor")
    new = usage_mutators.make(spec, ctx, "processor")
    if new is not None:
        return new
    if kind == "user_temperature":
        return TemperatureLogitsWarper(spec["t"])
    if kind == "user_min_new":
        return MinNewTokensLengthLogitsProcessor(prompt_len, spec["n"], eos if eos is not None else [2],
                                                 device=ctx.model.device)
    proc = Proc(spec, ctx)
    if kind.startswith("graph_safe"):
        graph_safe(proc)
    return proc


def make_criterion(spec, ctx):
    if spec["kind"] == "module_op":
        return usage_modules.op_callback(spec, ctx, "criterion")
    return usage_mutators.make(spec, ctx, "criterion") or Crit(spec, ctx)


def observed(callbacks, ctx) -> list:
    """What the callbacks saw and kept, and what nested calls returned (plain data for the trace)."""
    out = []
    for cb in callbacks:
        if isinstance(cb, Recorder):
            out.append((cb.spec["kind"], cb.log, cb.kept()))
        elif isinstance(cb, TemperatureLogitsWarper):
            out.append(("user_temperature", cb.temperature))
        elif isinstance(cb, MinNewTokensLengthLogitsProcessor):
            out.append(("user_min_new", cb.min_new_tokens))
        elif hasattr(cb, "observe"):
            out.append(cb.observe())
    out.extend(("inner", inner.records) for _, inner in ctx.inners)
    return out
