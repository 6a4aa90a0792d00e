"""Host time per assisted-decoding round, by stage, flag on vs stock, on the CPU under the CUDA-graph emulation (issue 38).

    PYTHONPATH=/work/t523 python3 scripts/round_host_cost.py [--layers 16] [--new-tokens 128] [--runs 5]
        [--cases draft,copy,lookup] [--profile DIR]

(`PYTHONPATH` to a transformers 5.23.0 `--target` dir: the release of the GPU run the issue cites; without it, the
installed one.) A Llama shaped like Llama-3.2-1B by module count (16 decoder layers, hidden size 64: the host cost
depends on the modules, not the widths), greedy, three cases as in `bench/assisted.py`:
- `draft`: a 2-layer draft sharing the target's first layers (`make_draft(..., "shared")`, 5 tokens, constant);
- `copy`: the target drafting for itself (`copy.copy`);
- `lookup`: prompt lookup (`prompt_lookup_num_tokens=10`) on an echo target and a prompt of its own output (the
  prompt's n-grams come back).
Each call is timed bare (no wrapper: the total wall per round), and again with every stage's functions wrapped with
`time.perf_counter_ns` and summed over the call ("in-run"; the garbage collector off during the timed calls). The
table gives microseconds per verify round (the call's sum over its rounds; rounds = `update_candidate_strategy`
calls), the median over `--runs` calls. "stock" is transformers as shipped (`tas.unpatch()`, no flag keyword), "flag"
is `async_stopping_criteria=True` under `emulated()`: its verify and draft forwards replay their recordings as on a
GPU, but an emulated replay runs the recorded kernels on the CPU, so its "emulated kernels" rows and the total wall are
not a GPU's; the package's own stages (proof, staleness, set-up, acceptance) are host work either way.

A flag call's wrapped functions are the package's own and transformers functions that are no digested source
(`release_checks.targets`: wrapping one would turn its shortcut off); the path each case takes is checked to be the
same with and without the wrappers, and the flag's output equal to stock's. Rows marked `(tf)` are transformers'
code, `(ours)` the package's, `(mix)` both; indented rows run inside the row above them. Not a test: no assertion
beyond those; the wrapper adds about 0.3 us a call.

`--profile DIR`: also a cProfile of one flag call and one stock call per case (`DIR/<case>-<flag|stock>.prof`), with
the self time grouped by owner (ours, transformers, torch's Python, the emulation's kernels; a builtin's self time goes
to its caller's owner) and the package's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import gc
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")  # the deferred path on the CPU
os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_PIECEWISE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers import cache_utils  # noqa: E402
from transformers.generation import candidate_generator as cg  # noqa: E402
from transformers.generation.utils import GenerationMixin  # noqa: E402

import transformers_async_stop as tas  # noqa: E402
from transformers_async_stop import generation as tas_generation  # noqa: E402
from transformers_async_stop.bench.assisted import DEEP_LAYER_SCALE, DRAFT_LAYERS, make_draft  # noqa: E402
from transformers_async_stop.control import controller  # noqa: E402
from transformers_async_stop.graphs import piecewise  # noqa: E402
from transformers_async_stop.graphs.piecewise import forward, graphs, proof, staleness, steps  # noqa: E402
from transformers_async_stop.loops import dynamic_loop  # noqa: E402
from transformers_async_stop.loops.assisted import acceptance, acceptance_graph, draft, lookup  # noqa: E402
from transformers_async_stop.loops.assisted import loop as assisted_loop  # noqa: E402
from transformers_async_stop.loops.dynamic_loop import loop as dynamic_loop_module  # noqa: E402
from transformers_async_stop.loops.dynamic_loop import prefill  # noqa: E402
from transformers_async_stop.release_checks import verified  # noqa: E402
from transformers_async_stop.testing import emulation  # noqa: E402
from transformers_async_stop.testing.emulation import emulated  # noqa: E402
from transformers_async_stop.undo import module_state  # noqa: E402

LOOKUP_TOKENS = 10
DRAFT_TOKENS = 5
PROMPT = 32

TOTALS: dict = {}  # label -> [ns, calls]
STACK: list = []  # labels of the wrapped calls running now (the innermost last)
STATE = {"target": None, "draft": None, "target_calls": 0}


# --- the wrapper --------------------------------------------------------------------------------------------------
def _add(label, ns):
    total = TOTALS.get(label)
    if total is None:
        TOTALS[label] = [ns, 1]
    else:
        total[0] += ns
        total[1] += 1


def _timed(label, function):
    """`function`, its time summed under `label` (a string, or a callable of the call's arguments giving one; None:
    not counted)."""
    def wrapper(*args, **kwargs):
        name = label(*args, **kwargs) if callable(label) else label
        if name is None:
            return function(*args, **kwargs)
        STACK.append(name)
        start = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            _add(name, time.perf_counter_ns() - start)
            STACK.pop()
    wrapper.__name__ = getattr(function, "__name__", "wrapper")
    return wrapper


def _inside(*names) -> bool:
    return any(name in STACK for name in names)


_INHERITED = object()


class Wrapped:
    """Installs wrappers and restores every replaced attribute exactly (the very object found in the owner's dict)."""

    def __init__(self):
        self.saved = []

    def wrap(self, owner, name, label, everywhere=False, inherited=False):
        if name not in vars(owner):
            if not inherited or not hasattr(owner, name):
                return
            # set on `owner` over the inherited one, deleted again by `restore`
            self.saved.append((owner, name, _INHERITED))
            setattr(owner, name, _timed(label, getattr(owner, name)))
            return
        original = vars(owner)[name]
        function = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        wrapper = _timed(label, function)
        if isinstance(original, staticmethod):
            wrapper = staticmethod(wrapper)
        elif isinstance(original, classmethod):
            wrapper = classmethod(wrapper)
        owners = [owner]
        if everywhere:  # the same function imported by name into the package's other modules
            owners += [module for module_name, module in list(sys.modules.items())
                       if module_name.startswith("transformers_async_stop") and module is not owner
                       and vars(module).get(name) is original]
        for holder in owners:
            self.saved.append((holder, name, vars(holder)[name]))
            setattr(holder, name, wrapper)

    def restore(self):
        for holder, name, original in reversed(self.saved):
            if original is _INHERITED:
                delattr(holder, name)
            else:
                setattr(holder, name, original)
        self.saved.clear()


# --- labels that depend on where the call runs ----------------------------------------------------------------------
DRAFTING = ("draft generate()",)


def _role_label(prefix):
    return lambda self, *a, **k: f"{prefix}[{self.role}]"


def _pf_call_label(self, *args, **kwargs):
    if self.role == "draft":
        return "draft prefill forward" if _inside("draft prefill") else "draft decode forwards"
    return "verify forward (rounds 2+)" if self.role == "verify" else "decode forward"


def _enclosing_role():
    for name in reversed(STACK):
        if name == "acceptance: graphed run":
            return "acceptance"
        if name.startswith(("draft prefill forward", "draft decode forwards")):
            return "draft"
        if name.startswith("verify forward"):
            return "verify"
    return "?"


def _crop_label(*args, **kwargs):
    return "draft cache crop" if _inside(*DRAFTING, "candidates") else "target cache crop"


def _stock_call_label(self, *args, **kwargs):
    """Stock: a forward of the target or the draft model (the class's `__call__`, wrapped in stock runs only)."""
    if self is STATE["target"] and not _inside("candidates"):
        STATE["target_calls"] += 1
        return "target prompt forward (round 1)" if STATE["target_calls"] == 1 else "verify forward (rounds 2+)"
    if self is STATE["draft"] or _inside(*DRAFTING):
        return "draft prefill forward" if _inside("draft prefill") else "draft decode forwards"
    return None


# --- what is wrapped ------------------------------------------------------------------------------------------------
def _common(w: Wrapped, stock: bool) -> None:
    """Functions timed in both runs (transformers' non-digested ones; the digested ones only in stock)."""
    for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):
        w.wrap(cls, "update_candidate_strategy", "update_candidate_strategy", inherited=True)
    w.wrap(cg.AssistedCandidateGenerator, "get_candidates", "candidates")
    for cls in (cache_utils.Cache, cache_utils.DynamicCache):
        w.wrap(cls, "crop", _crop_label)


def _stock_only(w: Wrapped) -> None:
    w.wrap(cg.PromptLookupCandidateGenerator, "get_candidates", "candidates")
    w.wrap(cg.AssistedCandidateGenerator, "_generate_candidates", "draft generate()")
    w.wrap(GenerationMixin, "_sample", lambda *a, **k: "draft _sample" if _inside(*DRAFTING) else None)
    w.wrap(GenerationMixin, "_prefill", lambda *a, **k: "draft prefill" if _inside(*DRAFTING) else None)
    # restored before the flag runs (its proof reads the class's `__call__`)
    w.wrap(type(STATE["target"]), "__call__", _stock_call_label, inherited=True)


def _flag_only(w: Wrapped) -> None:
    w.wrap(lookup.HostLookup, "get_candidates", "candidates")
    w.wrap(draft, "_generate_candidates", "draft generate()")
    # the draft's _sample (generation.patched_sample): its checks and set-up, then the dynamic-cache loop
    w.wrap(tas_generation, "_why_stock", "draft setup: _why_stock (why_stateful...)")
    w.wrap(tas_generation, "runs_stock", lambda *a, **k: "draft setup: runs_stock" if _inside(*DRAFTING) else None)
    w.wrap(draft.DraftRun, "controller", "draft setup: DraftStop()")
    for name in ("watch_hooks", "watch_positions", "watch_input_drops"):
        w.wrap(controller.AsyncStop, name, f"draft setup: ctl.{name}")
    w.wrap(dynamic_loop, "plan_loop", "draft setup: plan_loop")
    w.wrap(dynamic_loop, "run", "draft loop (dynamic_loop.run)")
    w.wrap(piecewise, "forward_for", lambda *a, verify=False, **k: "forward_for[verify]" if verify else (
        "forward_for[draft]" if _inside(*DRAFTING) else "forward_for[decode]"))
    w.wrap(prefill, "run", lambda *a, **k: "draft prefill" if _inside(*DRAFTING) else None)
    w.wrap(dynamic_loop_module, "rollback_one_step", "draft extra-step rollback")
    w.wrap(controller.AsyncStop, "record", lambda *a, **k: "draft ctl.record" if _inside(*DRAFTING) else None)
    w.wrap(draft.DraftStop, "finish", "draft ctl.finish")
    w.wrap(module_state.HookWatch, "hooked", lambda *a, **k: "draft ctl.record: HookWatch.hooked"
           if _inside(*DRAFTING) else None)
    w.wrap(controller.RngGuard, "snapshot", lambda *a, **k: "draft ctl.record: RngGuard.snapshot"
           if _inside(*DRAFTING) else None)
    # the piecewise forward: proof, watch, staleness, replay
    w.wrap(proof.admission, "why_not_model", lambda *a, **k: f"proof: why_not_model[{_proof_site()}]",
           everywhere=True)
    for module, name in ((proof.default_deny, "why_unread"), (proof.default_deny, "why_foreign_functions"),
                         (proof.admission, "why_not_tensors"), (proof.admission, "why_observed"),
                         (proof.names, "why_rebound"), (proof.names, "watched"), (proof.names, "watched_functions")):
        w.wrap(module, name, _sub_label(name), everywhere=True)
    w.wrap(forward.PiecewiseForward, "__init__", lambda self, *a, role="decode", **k:
           f"PiecewiseForward.__init__ (_watch)[{role}]")
    w.wrap(forward.PiecewiseForward, "__call__", _pf_call_label)
    w.wrap(proof.WatchSet, "why_eager", _role_label("staleness: WatchSet.why_eager"))
    w.wrap(forward.PiecewiseForward, "_step", _role_label("staleness: _step"))
    w.wrap(staleness.ModelGraphs, "changed", lambda *a, **k: f"staleness: ModelGraphs.changed[{_enclosing_role()}]")
    w.wrap(steps, "alone", lambda *a, **k: f"staleness: steps.alone[{_enclosing_role()}]")
    w.wrap(graphs.Recording, "replay", lambda *a, **k: f"replay[{_enclosing_role()}]")
    w.wrap(emulation.Graph, "replay", lambda *a, **k: f"emulated kernels[{_enclosing_role()}]")
    # the verify round's acceptance
    for name in ("select", "speculative", "accepted_length", "last_is_eos"):
        w.wrap(acceptance, name, f"acceptance: {name}")
    w.wrap(acceptance.RoundBox, "send", "acceptance: RoundBox.send")
    # a greedy round's acceptance replayed from its width's graph (`acceptance_graph.py`): the inputs' copies and the
    # replay; under the emulation the replay's kernels run on the CPU, counted apart ("emulated kernels[acceptance]")
    w.wrap(acceptance_graph.GraphedAcceptance, "why_not", "acceptance: graphed why_not")
    w.wrap(acceptance_graph.GraphedAcceptance, "run", "acceptance: graphed run")
    w.wrap(acceptance.RoundBox, "send_packed", lambda *a, **k: None if _inside("acceptance: RoundBox.send")
           else "acceptance: RoundBox.send_packed")
    w.wrap(acceptance.RoundBox, "receive", "acceptance: RoundBox.receive")
    w.wrap(lookup.Mirror, "extend", "acceptance: Mirror.extend")
    w.wrap(assisted_loop, "_tag_grown", "verify inputs: _tag_grown")
    w.wrap(verified, "matches", lambda *a, **k: "verified.matches" if not _inside("verified.matches") else None,
           everywhere=True)


def _proof_site():
    for name in reversed(STACK):
        if name.startswith("forward_for["):
            return name[len("forward_for["):-1]
    return "record or stale"


def _sub_label(name):
    def label(*args, **kwargs):
        if not any(entry.startswith("proof: why_not_model") for entry in STACK):
            return f"_watch: {name}" if name in ("watched", "watched_functions") else None
        return f"proof: {name}"
    return label


# --- models and cases -------------------------------------------------------------------------------------------------
def _config(layers: int) -> LlamaConfig:
    # Llama-3.2-1B's layout (16 layers, GQA 32/8 heads' ratio, tied embeddings), narrow
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _case(name: str, layers: int, new_tokens: int, device="cpu", full=False):
    """(target, generate kwargs, draft or None) of a case."""
    torch.manual_seed(0)
    if full:  # Llama-1B's widths too, in bf16 (the GPU benchmark's `llama_1b_config`)
        from transformers_async_stop.bench.cases import _from_config, llama_1b_config

        config = llama_1b_config()
        config.num_hidden_layers = layers
        target = _from_config(config)(torch.device(device), torch.bfloat16).eval()
    else:
        target = LlamaForCausalLM(_config(layers)).to(device).eval()
    vocab = target.config.vocab_size
    common = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=vocab)  # no early stop
    if name in ("draft", "copy"):
        if name == "draft":  # the deep layers write less into the residual stream: the draft agrees often
            with torch.no_grad():
                for layer in target.model.layers[DRAFT_LAYERS:]:
                    layer.self_attn.o_proj.weight.mul_(DEEP_LAYER_SCALE)
                    layer.mlp.down_proj.weight.mul_(DEEP_LAYER_SCALE)
        assistant = make_draft(target, "shared" if name == "draft" else "copy")
        assistant.generation_config.num_assistant_tokens = DRAFT_TOKENS
        ids = torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
        return target, dict(common, input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=assistant), \
            assistant
    if name == "lookup":  # the echo target: its greedy output repeats its last token (bench/assisted._echo)
        with torch.no_grad():
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            target.lm_head.weight.copy_(target.model.embed_tokens.weight)
        start = torch.randint(3, vocab - 1, (1, 8), generator=torch.Generator().manual_seed(2)).to(device)
        tas.unpatch()
        try:
            with torch.no_grad():
                ids = target.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=PROMPT - 8,
                                      min_new_tokens=PROMPT - 8, do_sample=False, pad_token_id=0)[:, :PROMPT]
        finally:
            tas.apply()
        return target, dict(common, input_ids=ids, attention_mask=torch.ones_like(ids),
                            prompt_lookup_num_tokens=LOOKUP_TOKENS), None
    raise ValueError(name)


def _call(target, kwargs, flag: bool, wrap: bool):
    """One generate() call: (output, wall ns, rounds, totals) with the wrappers when `wrap`."""
    w = Wrapped()
    TOTALS.clear()
    STACK.clear()
    STATE["target_calls"] = 0
    if not flag:
        tas.unpatch()
    try:
        if wrap:
            _common(w, stock=not flag)
            (_flag_only if flag else _stock_only)(w)
        extra = {"async_stopping_criteria": True} if flag else {}
        gc.collect()
        gc.disable()  # a collection of the whole heap (milliseconds) would land in whichever stage allocated last
        try:
            cuda = target.device.type == "cuda"
            with torch.no_grad():
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter_ns()
                out = target.generate(**kwargs, **extra)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter_ns() - start
        finally:
            gc.enable()
    finally:
        w.restore()
        if not flag:
            tas.apply()
    rounds = TOTALS.get("update_candidate_strategy", [0, 0])[1] if wrap else None
    return out, wall, rounds, {label: list(value) for label, value in TOTALS.items()}


# --- the table --------------------------------------------------------------------------------------------------------
# (row, owner, labels summed, indent); a label missing from a run counts 0; None: not measured in that run
ROWS = (
    ("candidates", "mix", ("candidates",), 0),
    ("draft generate() (assistant.generate + stack)", "mix", ("draft generate()",), 1),
    ("draft setup: runs_stock", "ours", ("draft setup: runs_stock",), 2),
    ("_why_stock (why_stateful)", "ours", ("draft setup: _why_stock (why_stateful...)",), 3),
    ("draft setup: DraftStop()", "ours", ("draft setup: DraftStop()",), 2),
    ("draft setup: ctl.watch_hooks/positions/drops", "ours",
     ("draft setup: ctl.watch_hooks", "draft setup: ctl.watch_positions", "draft setup: ctl.watch_input_drops"), 2),
    ("draft setup: plan_loop", "ours", ("draft setup: plan_loop",), 2),
    ("draft loop (_sample / dynamic_loop.run)", "mix", ("draft _sample", "draft loop (dynamic_loop.run)"), 2),
    ("forward_for[draft] (proof + _watch)", "ours", ("forward_for[draft]",), 3),
    ("proof: why_not_model", "ours", ("proof: why_not_model[draft]",), 4),
    ("PiecewiseForward.__init__ (_watch)", "ours", ("PiecewiseForward.__init__ (_watch)[draft]",), 4),
    ("draft prefill (inputs + forward)", "mix", ("draft prefill",), 3),
    ("draft forwards (prefill + decode steps)", "mix", ("draft prefill forward", "draft decode forwards"), 3),
    ("staleness[draft]", "ours", ("staleness: _why_not_observed[draft]", "staleness: _step[draft]",
                                  "staleness: ModelGraphs.changed[draft]", "staleness: steps.alone[draft]"), 4),
    ("replay[draft]", "mix", ("replay[draft]",), 4),
    ("emulated kernels[draft]", "emul", ("emulated kernels[draft]",), 5),
    ("draft ctl.record + finish", "ours", ("draft ctl.record", "draft ctl.finish"), 3),
    ("HookWatch.hooked (first look walks)", "ours", ("draft ctl.record: HookWatch.hooked",), 4),
    ("RngGuard.snapshot", "ours", ("draft ctl.record: RngGuard.snapshot",), 4),
    ("draft extra-step rollback", "ours", ("draft extra-step rollback",), 3),
    ("draft cache crop", "tf", ("draft cache crop",), 1),
    ("forward_for[verify] (once per call)", "ours", ("forward_for[verify]",), 0),
    ("target prompt forward (round 1)", "tf", ("target prompt forward (round 1)",), 0),
    ("verify forward (rounds 2+)", "mix", ("verify forward (rounds 2+)",), 0),
    ("staleness[verify]", "ours", ("staleness: _why_not_observed[verify]", "staleness: _step[verify]",
                                   "staleness: ModelGraphs.changed[verify]", "staleness: steps.alone[verify]"), 1),
    ("replay[verify]", "mix", ("replay[verify]",), 1),
    ("emulated kernels[verify]", "emul", ("emulated kernels[verify]",), 2),
    ("acceptance (select..RoundBox.send, Mirror)", "ours",
     tuple(f"acceptance: {n}" for n in ("select", "speculative", "accepted_length", "last_is_eos",
                                        "RoundBox.send", "Mirror.extend", "graphed why_not", "graphed run",
                                        "RoundBox.send_packed")), 0),
    ("emulated kernels[acceptance] (inside the row above)", "emul", ("emulated kernels[acceptance]",), 1),
    ("the round's one wait (RoundBox.receive)", "ours", ("acceptance: RoundBox.receive",), 0),
    ("target cache crop", "tf", ("target cache crop",), 0),
    ("update_candidate_strategy", "tf", ("update_candidate_strategy",), 0),
)
TOP = ("candidates", "forward_for[verify] (once per call)", "target prompt forward (round 1)",
       "verify forward (rounds 2+)", "acceptance (select..RoundBox.send, Mirror)",
       "the round's one wait (RoundBox.receive)", "target cache crop", "update_candidate_strategy")
# the package's own host work per round (no forward, no kernel): summed into "ours" (labels that do not run inside
# one another: `_why_stock` runs inside `runs_stock`, `HookWatch.hooked` inside `ctl.record`, the proof inside
# `forward_for`)
OURS = ("draft setup: runs_stock", "draft setup: DraftStop()",
        "draft setup: ctl.watch_hooks", "draft setup: ctl.watch_positions", "draft setup: ctl.watch_input_drops",
        "draft setup: plan_loop", "forward_for[draft]", "forward_for[verify]",
        "staleness: _why_not_observed[draft]", "staleness: _step[draft]", "staleness: ModelGraphs.changed[draft]",
        "staleness: steps.alone[draft]", "staleness: _why_not_observed[verify]", "staleness: _step[verify]",
        "staleness: ModelGraphs.changed[verify]", "staleness: steps.alone[verify]", "draft ctl.record",
        "draft ctl.finish", "draft extra-step rollback") + next(
            labels for row, _, labels, _ in ROWS if row.startswith("acceptance"))


def _per_round(totals, labels, rounds):
    return sum(totals.get(label, (0, 0))[0] for label in labels) / 1000 / rounds


def _median_rows(runs, rounds, pick=statistics.median):
    """{row: us per round, the median (or `pick`) over the runs' totals}."""
    out = {}
    for row, _, labels, _ in ROWS:
        values = [_per_round(totals, labels, r) for totals, r in zip(runs, rounds)]
        out[row] = pick(values) if any(values) else None
    return out


def run_case(name, args, profile_dir):
    target, kwargs, assistant = _case(name, args.layers, args.new_tokens, args.device, args.full)
    STATE["target"], STATE["draft"] = target, assistant
    walls = {True: [], False: []}
    runs = {True: [], False: []}
    rounds = {True: [], False: []}
    with emulated() if args.device == "cpu" else contextlib.nullcontext():
        stock_out, *_ = _call(target, kwargs, flag=False, wrap=False)
        # the flag's calls first, then stock's (before 67c025d, `tas.apply()` after a stock call made the next flag
        # call read every digested source again, hundreds of ms: `verified.source_digest` now reads each once)
        for _ in range(2):  # records the pieces (a width is recorded at its second sighting); not counted
            flag_out, *_ = _call(target, kwargs, flag=True, wrap=False)
        path = tas.last_path()
        bare_path = (path.describe(), path.forward, path.verify)
        _call(target, kwargs, flag=True, wrap=True)
        path = tas.last_path()
        wrapped_path = (path.describe(), path.forward, path.verify)
        same = torch.equal(flag_out, stock_out)
        if profile_dir:
            profiler = cProfile.Profile()
            profiler.enable()
            _call(target, kwargs, flag=True, wrap=False)
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"{name}-flag.prof"))
        for flag in (True, False):
            for _ in range(args.runs):
                _, wall, _, _ = _call(target, kwargs, flag=flag, wrap=False)
                _, wall_wrapped, r, totals = _call(target, kwargs, flag=flag, wrap=True)
                totals["wall (wrapped)"] = [wall_wrapped, 1]
                walls[flag].append(wall)
                runs[flag].append(totals)
                rounds[flag].append(r)
        if profile_dir:
            for flag in (False,):
                profiler = cProfile.Profile()
                profiler.enable()
                _call(target, kwargs, flag=flag, wrap=False)
                profiler.disable()
                profiler.dump_stats(os.path.join(profile_dir, f"{name}-{'flag' if flag else 'stock'}.prof"))
    tokens = kwargs["max_new_tokens"]
    print(f"\n== {name}: path {bare_path[0]!r}; forward {bare_path[1]!r}; verify {bare_path[2]!r}")
    if wrapped_path != bare_path:
        print(f"   !! the wrappers changed the path: {wrapped_path}")
    print(f"   flag output == stock output: {same}; rounds flag {statistics.median(rounds[True])}, stock "
          f"{statistics.median(rounds[False])} ({tokens} new tokens)")
    flag_rows = _median_rows(runs[True], rounds[True])
    stock_rows = _median_rows(runs[False], rounds[False])
    flag_min = _median_rows(runs[True], rounds[True], min)
    stock_min = _median_rows(runs[False], rounds[False], min)
    r_flag, r_stock = statistics.median(rounds[True]), statistics.median(rounds[False])
    wall_flag = statistics.median(walls[True]) / 1000 / r_flag
    wall_stock = statistics.median(walls[False]) / 1000 / r_stock
    min_flag = min(walls[True]) / 1000 / r_flag
    min_stock = min(walls[False]) / 1000 / r_stock
    print(f"   {'us per round (median of ' + str(args.runs) + ' runs; min)':52s} {'owner':5s} {'flag':>9s} "
          f"{'stock':>9s} {'flag min':>9s} {'stock min':>9s}")
    print(f"   {'total wall, bare (no wrappers)':52s} {'':5s} {wall_flag:9.0f} {wall_stock:9.0f} {min_flag:9.0f} "
          f"{min_stock:9.0f}")
    cell = lambda v: f"{v:9.0f}" if v is not None else f"{'-':>9s}"  # noqa: E731
    for row, owner, _, indent in ROWS:
        f, s = flag_rows[row], stock_rows[row]
        if f is None and s is None:
            continue
        print(f"   {'  ' * indent + row:52s} {owner:5s} {cell(f)} {cell(s)} {cell(flag_min[row])} "
              f"{cell(stock_min[row])}")
    top_flag = sum(flag_rows[row] or 0 for row in TOP)
    top_stock = sum(stock_rows[row] or 0 for row in TOP)
    rest = {flag: statistics.median(
        _per_round(t, ("wall (wrapped)",), r) - sum(_per_round(t, labels, r) for row, _, labels, _ in ROWS
                                                     if row in TOP)
        for t, r in zip(runs[flag], rounds[flag])) for flag in (True, False)}
    print(f"   {'rest: generate() and loop bodies (inputs, kwargs, logits)':52s} {'mix':5s} {rest[True]:9.0f} "
          f"{rest[False]:9.0f}")
    # the acceptance graph's emulated kernels ran inside its row: not host work (on a GPU they are the device's)
    ours_runs = [_per_round(t, OURS, r) - _per_round(t, ("emulated kernels[acceptance]",), r)
                 for t, r in zip(runs[True], rounds[True])]
    ours = statistics.median(ours_runs)
    matches_us = statistics.median(_per_round(t, ("verified.matches",), r) for t, r in zip(runs[True], rounds[True]))
    print(f"   {'sum of the top-level rows':52s} {'':5s} {top_flag:9.0f} {top_stock:9.0f}")
    print(f"   {'package-only host work (setup, proof, staleness, acceptance, ...)':52s} {'ours':5s} {ours:9.0f} "
          f"{0:9.0f} {min(ours_runs):9.0f}")
    print(f"   {'  verified.matches (every call, nested anywhere)':52s} {'ours':5s} {matches_us:9.0f} {0:9.0f}")
    detail = {}
    for totals, r in zip(runs[True], rounds[True]):
        for label, (ns, calls) in totals.items():
            detail.setdefault(label, []).append((ns / 1000 / r, calls / r))
    print("   flag, every wrapped label: us/round, calls/round")
    for label in sorted(detail):
        us = statistics.median(v for v, _ in detail[label])
        calls = statistics.median(c for _, c in detail[label])
        print(f"     {label:60s} {us:9.1f} {calls:6.2f}")
    return dict(flag=flag_rows, stock=stock_rows, wall_flag=wall_flag, wall_stock=wall_stock, ours=ours)


# --- the profile's split --------------------------------------------------------------------------------------------
_TAS = os.path.dirname(tas.__file__) + os.sep
_TF = os.path.dirname(transformers.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_EMUL = os.path.join(_TAS, "testing", "emulation.py")


def _owner(filename: str) -> str:
    if filename == _EMUL:
        return "emulated kernels (test-only)"
    if filename.startswith(_TAS):
        return "ours"
    if filename.startswith(_TF):
        return "transformers"
    if filename.startswith(_TORCH):
        return "torch (Python)"
    if filename == "~":
        return "builtin"
    return "other (stdlib...)"


def profile_split(path: str, top: int = 15) -> None:
    stats = pstats.Stats(path).stats
    groups = collections.Counter()
    this = os.path.abspath(__file__)
    for func, (_, _, tt, _, callers) in stats.items():
        if os.path.abspath(func[0]) == this:
            continue  # this script's own frames (the `gc.collect()` before the call)
        owner = _owner(func[0])
        if owner != "builtin":
            groups[owner] += tt
            continue
        # a builtin's (C function's, kernel's) self time goes to its callers' owners, by their share
        for caller, value in callers.items():
            if os.path.abspath(caller[0]) == this:
                continue
            caller_tt = value[2] if isinstance(value, tuple) else 0
            groups[_owner(caller[0]) + " (+C)"] += caller_tt
    total = sum(groups.values())
    print(f"\n-- {os.path.basename(path)}: self time {total * 1000:.0f} ms by owner (a C call's time to its caller's)")
    for owner, tt in groups.most_common():
        print(f"     {owner:40s} {tt * 1000:8.1f} ms {100 * tt / total:5.1f}%")
    ours = [(func, values) for func, values in stats.items() if func[0].startswith(_TAS) and func[0] != _EMUL]
    print("   the package's top functions by cumulative time (ms, calls)")
    for func, (_, nc, tt, ct, _) in sorted(ours, key=lambda item: -item[1][3])[:top]:
        print(f"     {func[0][len(_TAS):]}:{func[1]} {func[2]:40s} cum {ct * 1000:8.1f} self {tt * 1000:7.1f} "
              f"calls {nc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default="draft,copy,lookup")
    parser.add_argument("--profile", default=None, help="a directory for the cProfile dumps and their split")
    parser.add_argument("--device", default="cpu", help="cpu (emulated CUDA graphs) or cuda (real ones)")
    parser.add_argument("--full", action="store_true", help="Llama-1B's widths too, bf16 (for --device cuda)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    where = "CPU, emulated CUDA graphs" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, package {os.path.dirname(tas.__file__)}; "
          f"{args.layers} layers, {'Llama-1B widths, bf16' if args.full else 'hidden 64, fp32'}, greedy, batch 1, "
          f"{args.new_tokens} new tokens, prompt {PROMPT}; {args.runs} runs; {where}")
    for name in args.cases.split(","):
        run_case(name, args, args.profile)
    if args.profile:
        for name in args.cases.split(","):
            for kind in ("flag", "stock"):
                profile_split(os.path.join(args.profile, f"{name}-{kind}.prof"))


if __name__ == "__main__":
    main()
