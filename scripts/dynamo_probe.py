"""Measure issue 36's option (a) on the CPU: Dynamo guards over the decode forward, eager kernels, no inductor.

This does not build option (a). It traces ONE one-token decode forward (a `DynamicCache` prefilled with 7 tokens)
with `torch.compile(model, backend=<plain FX backend>, dynamic=False)`; the backend returns `gm.forward` (no AOT, no
inductor, no decompositions), so the compiled call runs the same torch ops eager runs. It reports, per family:

- graphs (graph breaks + 1), the break reasons (`torch._dynamo.utils.counters["graph_break"]`);
- whether the graph(s) hold every attention call (`scaled_dot_product_attention`) and every cache update
  (`torch.cat` on a cache tensor: Dynamo inlines `DynamicLayer.update`) as FX nodes, i.e. whether a piecewise backend
  could split there; FX node count; guard count (leaf guards of the frame's guard tree);
- trace (first call) time; whether the call at the next position (cache one longer) recompiles and why
  (`torch._dynamo.utils.guard_failures`); the same with the cache tensors' sequence dim marked dynamic
  (`torch._dynamo.maybe_mark_dynamic`), and then how many tensor-valued nodes other than the cache update / attention
  have a length-dependent shape (those would make a "static-shape piece" impossible);
- the compiled call's cost on a cache hit vs the eager call (medians), and the part spent outside the FX graph
  (Dynamo entry, guard evaluation, side-effect replay, output rebuild).

Then a Llama with Llama-3.2-1B's module count (16 layers; hidden 64, and once at full width in bf16), and red-team
cases on the 2-layer Llama: a change after the first compiled call, then: did the next compiled call recompile (a
guard caught it) or reuse the old graph (a hole), and does its output equal the eager forward's.

    /work/venv/bin/python scripts/dynamo_probe.py [--parts families,llama1b,dynamic,redteam]
        [--families llama,gpt2] [--json OUT.json] [--md docs/design/dynamo-probe-results.md]
        [--other-families OTHER_RUN.json]

`--other-families` adds another run's family table (e.g. the same script under an older transformers) to the
markdown. Keep it CPU-cheap: 2-layer models with hidden 64.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import inspect
import json
import operator
import platform
import re
import statistics
import sys
import time
import traceback

import torch
import torch._dynamo
import torch._dynamo.convert_frame
import torch._dynamo.utils
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

FAMILIES = (
    "llama qwen2 qwen3 phi3 gpt2 gemma phi gpt_neox gptj falcon olmo olmo2 granite starcoder2 cohere stablelm smollm3 "
    "mixtral qwen2_moe opt gpt_bigcode glm ernie4_5 helium arcee seed_oss hunyuan_v1_dense mistral gemma3_text "
    "ministral exaone4"
).split()

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EXTRA = {
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gpt2": dict(n_inner=128),
    "gptj": dict(rotary_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen2_moe": dict(num_local_experts=4, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
}
PROMPT = 7
CACHE_ARG = re.compile(r"cache|past_key_values")


# --------------------------------------------------------------------------------------------------------------------
# helpers


def build(model_type: str, dtype=None, **over):
    torch.manual_seed(0)
    kwargs = {**BASE, **EXTRA.get(model_type, {}), **over}
    while True:
        try:
            config = AutoConfig.for_model(model_type, **kwargs)
            break
        except AttributeError as e:  # e.g. falcon's head_dim is a read-only property: drop that kwarg
            m = re.search(r"property '(\w+)'", str(e))
            if not m or m.group(1) not in kwargs:
                raise
            kwargs.pop(m.group(1))
    extra = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **extra).eval()


def cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Inputs:
    """The prefilled cache at PROMPT tokens and the one at PROMPT + 1 (after one eager decode step)."""

    def __init__(self, model):
        self.kw = cache_kw(model)
        self.vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, self.vocab, (1, PROMPT), generator=g)
        with torch.no_grad():
            self.c0 = DynamicCache(config=model.config)
            model(input_ids=ids, use_cache=True, **{self.kw: self.c0})
            self.c1 = copy.deepcopy(self.c0)
            model(**self.args(0, self.c1))

    def args(self, step: int, cache) -> dict:
        pos = PROMPT + step
        return dict(
            input_ids=torch.tensor([[5 + step]]),
            position_ids=torch.tensor([[pos]]),
            use_cache=True,
            **{self.kw: cache},
        )

    def fresh(self, step: int, mark_dynamic: bool = False) -> dict:
        cache = copy.deepcopy(self.c0 if step == 0 else self.c1)
        if mark_dynamic:
            for layer in cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name, None)
                    if isinstance(t, torch.Tensor) and t.dim() >= 3:
                        torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)
        return self.args(step, cache)


class Backend:
    """A plain FX backend: keep the graph module, run `gm.forward` (eager ops), time what is spent inside it."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []
        self.in_graph_ns = 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        forward = gm.forward

        def run(*args):
            t = time.perf_counter_ns()
            try:
                return forward(*args)
            finally:
                self.in_graph_ns += time.perf_counter_ns() - t

        return run


def reset():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.guard_failures.clear()


def cache_entries(with_code: bool = False):
    """(code name, cache entries) for every code object Dynamo compiled."""
    out = []
    for ref in list(torch._dynamo.convert_frame.input_codes.seen):
        code = ref()
        if code is None:
            continue
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
        if entries:
            out.append((code if with_code else code.co_name, entries))
    return out


def guard_check_cost(model, inputs, n: int = 500):
    """Evaluate the compiled frames' guards directly on a hit: the frame's locals are captured (sys.setprofile) on an
    eager call, the cache in them is replaced by a fresh one, and `guard_manager.check` is timed. Returns (guard-tree
    checks executed on a hit, µs per evaluation), summed over the frames an eager call enters (resume functions of a
    graph break are not entered by eager: not counted)."""
    executed, us = 0, 0.0
    for code, entries in cache_entries(with_code=True):
        captured: dict = {}
        sent = inputs.fresh(0)
        cache = sent[inputs.kw]

        def prof(frame, event, arg, code=code, captured=captured):
            if event == "call" and frame.f_code is code and not captured:
                captured.update(frame.f_locals)

        sys.setprofile(prof)
        try:
            with torch.no_grad():
                model(**sent)
        finally:
            sys.setprofile(None)
        if not captured:
            continue
        fresh = inputs.fresh(0)[inputs.kw]
        for k, v in list(captured.items()):
            if v is cache:
                captured[k] = fresh
            elif isinstance(v, dict) and any(x is cache for x in v.values()):
                captured[k] = {kk: (fresh if x is cache else x) for kk, x in v.items()}
        manager = entries[0].guard_manager
        with torch.no_grad():
            info = manager.check_verbose(captured)
            if not info.result:
                continue
            executed += info.num_guards_executed
            t = time.perf_counter_ns()
            for _ in range(n):
                manager.check(captured)
            us += (time.perf_counter_ns() - t) / n / 1e3
    return executed, round(us, 1)


def n_compiled() -> int:
    return sum(len(e) for _, e in cache_entries())


def guard_stats():
    """Leaf guards of all compiled frames' guard trees, total and by kind (of the newest entry per frame)."""
    kinds = collections.Counter()

    def walk(mgr):
        for g in mgr.get_leaf_guards():
            kinds[type(g).__name__] += 1
        for child in mgr.get_child_managers():
            walk(child)

    for _, entries in cache_entries():
        walk(entries[0].guard_manager.root)
    return sum(kinds.values()), dict(kinds.most_common())


def failures() -> list[str]:
    out = []
    for reasons in torch._dynamo.utils.guard_failures.values():
        out.extend(str(r) for r in reasons)
    return out


def break_reasons() -> dict[str, int]:
    return {str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()}


def is_sdpa(node) -> bool:
    return node.op == "call_function" and "scaled_dot_product_attention" in str(node.target)


def is_cat(node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in (torch.cat, "cat", torch.concat)


def graph_stats(graphs):
    nodes = sdpa = cache_cats = other_attention = 0
    for gm in graphs:
        cache_inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and CACHE_ARG.search(n.name)}
        for n in gm.graph.nodes:
            nodes += 1
            if is_sdpa(n):
                sdpa += 1
            elif is_cat(n) and set(n.all_input_nodes) & cache_inputs:
                cache_cats += 1
            elif n.op in ("call_function", "call_method") and re.search(r"softmax|baddbmm", str(n.target)):
                other_attention += 1
    return dict(nodes=nodes, sdpa=sdpa, cache_cats=cache_cats, softmax_like=other_attention)


def length_dependent(graphs):
    """With the cache's length symbolic: tensor-valued nodes, other than the cache update and the attention, whose
    shape depends on it (these would be length-dependent work inside a would-be static piece), and scalar SymInt
    nodes (host arithmetic)."""
    tensors, scalars = [], 0
    for gm in graphs:
        cache_inputs = {n for n in gm.graph.nodes if n.op == "placeholder" and CACHE_ARG.search(n.name)}
        update = set()  # the cache update: torch.cat on a cache tensor, and a slice of it (sliding-window layer)
        for n in gm.graph.nodes:
            if is_cat(n) and set(n.all_input_nodes) & cache_inputs:
                update.add(n)
            elif n.target is operator.getitem and n.all_input_nodes and set(n.all_input_nodes) <= update | {None}:
                update.add(n)
        for n in gm.graph.nodes:
            if n.op == "placeholder" or is_sdpa(n) or n in update:
                continue
            ev = n.meta.get("example_value")
            if isinstance(ev, torch.Tensor):
                if any(not isinstance(s, int) for s in ev.shape):
                    tensors.append(f"{n.target if isinstance(n.target, str) else getattr(n.target, '__name__', n.target)}")
            elif isinstance(ev, torch.SymInt):
                scalars += 1
    return collections.Counter(tensors), scalars


def median_us(samples_ns):
    return round(statistics.median(samples_ns) / 1e3, 1)


def overhead(model, compiled, backend, inputs, n: int):
    """Median eager and compiled (cache hit) call, and the compiled call's time outside its FX graph(s)."""
    eager, comp, outside = [], [], []
    with torch.no_grad():
        for _ in range(n):
            a = inputs.fresh(0)
            t = time.perf_counter_ns()
            model(**a)
            eager.append(time.perf_counter_ns() - t)
            a = inputs.fresh(0)
            backend.in_graph_ns = 0
            t = time.perf_counter_ns()
            compiled(**a)
            dt = time.perf_counter_ns() - t
            comp.append(dt)
            outside.append(dt - backend.in_graph_ns)
    return dict(eager_us=median_us(eager), compiled_us=median_us(comp), outside_graph_us=median_us(outside))


def maxdiff(a, b) -> float:
    return float((a.logits.float() - b.logits.float()).abs().max())


def short(s: str, n: int = 150) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------------------------------------------------
# 1. families


def probe_family(model_type: str, n_calls: int, with_dynamic: bool, **over) -> dict:
    reset()
    model = build(model_type, **over)
    inputs = Inputs(model)
    layers = model.config.num_hidden_layers
    backend = Backend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    r: dict = dict(family=model_type, layers=layers, params=sum(p.numel() for p in model.parameters()))
    with torch.no_grad():
        t = time.perf_counter()
        out = compiled(**inputs.fresh(0))
        r["trace_ms"] = round((time.perf_counter() - t) * 1e3)
        ref = model(**inputs.fresh(0))
        r["maxdiff_vs_eager"] = maxdiff(out, ref)
        r["graphs"] = len(backend.graphs)
        r["compiled_frames"] = n_compiled()
        reasons = break_reasons()
        r["breaks"] = sum(reasons.values())
        r["break_reasons"] = {short(k, 300): v for k, v in reasons.items()}
        r.update(graph_stats(backend.graphs))
        r["splittable"] = r["sdpa"] >= layers and r["cache_cats"] >= 2 * layers
        r["guards"], r["guard_kinds"] = guard_stats()
        # a hit at the same position, then the next position
        before = n_compiled()
        compiled(**inputs.fresh(0))
        r["recompiles_same_position"] = n_compiled() - before
        # a hit with another token (same shapes): data-dependent work (MoE routing) must not be baked in
        diffs = []
        for tok in (17, 77, 120):
            a, b = inputs.fresh(0), inputs.fresh(0)
            a["input_ids"] = b["input_ids"] = torch.tensor([[tok]])
            diffs.append(maxdiff(compiled(**a), model(**b)))
        r["recompiles_other_tokens"] = n_compiled() - before
        r["maxdiff_other_tokens"] = max(diffs)
        before = n_compiled()
        torch._dynamo.utils.guard_failures.clear()
        out = compiled(**inputs.fresh(1))
        r["recompiles_next_position"] = n_compiled() - before
        r["next_position_reasons"] = [short(x, 200) for x in failures()][:3]
        r["maxdiff_next_position"] = maxdiff(out, model(**inputs.fresh(1)))
        # overhead on a hit (position 0 is compiled)
        r.update(overhead(model, compiled, backend, inputs, n_calls))
        r["guards_executed_on_hit"], r["guard_check_us"] = guard_check_cost(model, inputs)
    if with_dynamic:
        reset()
        backend = Backend()
        compiled = torch.compile(model, backend=backend, dynamic=False)
        with torch.no_grad():
            t = time.perf_counter()
            compiled(**inputs.fresh(0, mark_dynamic=True))
            d = dict(trace_ms=round((time.perf_counter() - t) * 1e3), graphs=len(backend.graphs))
            tensors, scalars = length_dependent(backend.graphs)
            d["length_dependent_tensor_nodes"] = dict(tensors)
            d["symint_nodes"] = scalars
            before = n_compiled()
            torch._dynamo.utils.guard_failures.clear()
            out = compiled(**inputs.fresh(1, mark_dynamic=True))
            d["recompiles_next_position"] = n_compiled() - before
            d["next_position_reasons"] = [short(x, 200) for x in failures()][:3]
            d["maxdiff_next_position"] = maxdiff(out, model(**inputs.fresh(1)))
        r["dynamic_len"] = d
    return r


def families(names, n_calls, with_dynamic):
    rows = []
    for name in names:
        t = time.perf_counter()
        try:
            row = probe_family(name, n_calls, with_dynamic)
        except Exception as e:  # noqa: BLE001 - a failure is a result
            row = dict(family=name, error=short(f"{type(e).__name__}: {e}", 300), tb=traceback.format_exc()[-800:])
        row["wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({k: v for k, v in row.items() if k not in ("guard_kinds", "tb")}), flush=True)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# 2. Llama-3.2-1B by module count; automatic dynamic on the 2-layer llama


def llama1b(n_calls: int, wide: bool) -> dict:
    out = {}
    shapes = {"16 layers, hidden 64, fp32": dict(num_hidden_layers=16)}
    if wide:
        shapes["16 layers, hidden 2048, bf16 (Llama-3.2-1B widths)"] = dict(
            num_hidden_layers=16,
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            dtype=torch.bfloat16,
        )
    for label, over in shapes.items():
        t = time.perf_counter()
        try:
            dtype = over.pop("dtype", None)
            reset()
            model = build("llama", dtype=dtype, **over)
            inputs = Inputs(model)
            backend = Backend()
            compiled = torch.compile(model, backend=backend, dynamic=False)
            r = dict(params=sum(p.numel() for p in model.parameters()))
            with torch.no_grad():
                t0 = time.perf_counter()
                o = compiled(**inputs.fresh(0))
                r["trace_ms"] = round((time.perf_counter() - t0) * 1e3)
                r["maxdiff_vs_eager"] = maxdiff(o, model(**inputs.fresh(0)))
            r["graphs"] = len(backend.graphs)
            r.update(graph_stats(backend.graphs))
            r["guards"], r["guard_kinds"] = guard_stats()
            r.update(overhead(model, compiled, backend, inputs, n_calls if dtype is None else 5))
            r["guards_executed_on_hit"], r["guard_check_us"] = guard_check_cost(model, inputs)
            del model, compiled, backend
        except Exception as e:  # noqa: BLE001
            r = dict(error=short(f"{type(e).__name__}: {e}", 300))
        r["wall_s"] = round(time.perf_counter() - t, 1)
        print(label, json.dumps({k: v for k, v in r.items() if k != "guard_kinds"}), flush=True)
        out[label] = r
    return out


def dynamic_modes() -> dict:
    """Ways around the per-position recompile, on the 2-layer llama: calls at positions 7, 8, 9, 10."""
    model = build("llama")
    base = Inputs(model)
    caches = [base.c0]
    with torch.no_grad():
        for step in range(4):
            c = copy.deepcopy(caches[-1])
            model(**base.args(step, c))
            caches.append(c)
    out = {}
    modes = {
        "dynamic=False": dict(dynamic=False, mark=False),
        "dynamic=None (automatic dynamic)": dict(dynamic=None, mark=False),
        "dynamic=False + maybe_mark_dynamic(cache seq dim)": dict(dynamic=False, mark=True),
        "dynamic=True": dict(dynamic=True, mark=False),
    }
    for label, m in modes.items():
        reset()
        backend = Backend()
        compiled = torch.compile(model, backend=backend, dynamic=m["dynamic"])
        compiles, ok = [], True
        with torch.no_grad():
            for step in range(4):
                cache = copy.deepcopy(caches[step])
                if m["mark"]:
                    for layer in cache.layers:
                        torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
                        torch._dynamo.maybe_mark_dynamic(layer.values, 2)
                before = n_compiled()
                o = compiled(**base.args(step, cache))
                compiles.append(n_compiled() - before)
                ok &= maxdiff(o, model(**base.args(step, copy.deepcopy(caches[step])))) < 1e-5
        tensors, scalars = length_dependent(backend.graphs)
        out[label] = dict(
            compiles_per_call=compiles,
            graphs_total=len(backend.graphs),
            outputs_match=bool(ok),
            length_dependent_tensor_nodes=dict(tensors),
            symint_nodes=scalars,
        )
        print(label, json.dumps(out[label]), flush=True)
    return out


# --------------------------------------------------------------------------------------------------------------------
# 3. red team

KNOB = {"scale": 1.0}


class KnobMLP(nn.Module):
    """A user module: the MLP, scaled by a module-level dict read at each call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * KNOB["scale"]


class CountingMLP(nn.Module):
    """A user module that counts its calls in a Python int attribute."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _sub_mlp_class(base):
    class HalfMLP(base):
        def forward(self, x):
            return super().forward(x) * 0.5

    return HalfMLP


def _double_hook(module, args, output):
    if isinstance(output, tuple):
        return (output[0] * 2,) + tuple(output[1:])
    return output * 2


def redteam_case(name: str, setup, change, undo=None, dynamo_config=None) -> dict:
    """Build the 2-layer llama, `setup(model)` (returns the module to compile, default the model), one compiled call,
    `change(model)`, then the next compiled call vs the eager forward after the change."""
    if dynamo_config:
        with torch._dynamo.config.patch(**dynamo_config):
            return redteam_case(name, setup, change, undo)
    reset()
    model = build("llama")
    target = setup(model) if setup else model
    inputs = Inputs(model)
    backend = Backend()
    compiled = torch.compile(target, backend=backend, dynamic=False)
    r: dict = dict(case=name)
    try:
        with torch.no_grad():
            first = compiled(**inputs.fresh(0))
            before_change = model(**inputs.fresh(0)) if setup is None else target(**inputs.fresh(0))
            ctx = change(target) or contextlib.nullcontext()
            with ctx:
                before = n_compiled()
                torch._dynamo.utils.guard_failures.clear()
                out = compiled(**inputs.fresh(0))
                r["recompiled"] = n_compiled() - before > 0
                r["reasons"] = [short(x, 220) for x in failures()][:2]
                ref = target(**inputs.fresh(0))
            r["change_changes_eager_output"] = maxdiff(ref, before_change) > 1e-6
            r["maxdiff_compiled_vs_eager"] = maxdiff(out, ref)
            r["matches_eager"] = r["maxdiff_compiled_vs_eager"] < 1e-5
            r["verdict"] = "caught (recompiled)" if r["recompiled"] else (
                "no recompile; output equals eager (the FX graph reads it live)" if r["matches_eager"]
                else "HOLE: reused stale graph"
            )
            del first
    except Exception as e:  # noqa: BLE001
        r["error"] = short(f"{type(e).__name__}: {e}", 300)
        r["verdict"] = "error"
    finally:
        if undo:
            undo()
    print(json.dumps(r), flush=True)
    return r


def redteam() -> list[dict]:
    import transformers.models.llama.modeling_llama as ml

    rows = []
    # (i) a module attribute
    rows.append(redteam_case("i: self_attn.scaling = 0.5", None,
                             lambda m: setattr(m.model.layers[0].self_attn, "scaling", 0.5)))
    # (ii) a modeling-module global rebound
    orig_rope = ml.apply_rotary_pos_emb
    rows.append(redteam_case("ii: modeling_llama.apply_rotary_pos_emb rebound", None,
                             lambda m: setattr(ml, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: (q, k)),
                             undo=lambda: setattr(ml, "apply_rotary_pos_emb", orig_rope)))

    # (iii) a mutable global dict read in a user module's forward
    def wrap_knob(m):
        m.model.layers[0].mlp = KnobMLP(m.model.layers[0].mlp)

    rows.append(redteam_case("iii: KNOB['scale'] = 2.0 (dict read in user forward)",
                             lambda m: (wrap_knob(m), m)[1],
                             lambda m: KNOB.__setitem__("scale", 2.0),
                             undo=lambda: KNOB.__setitem__("scale", 1.0)))

    # (iv) a class swap
    def swap(m):
        mlp = m.model.layers[0].mlp
        mlp.__class__ = _sub_mlp_class(type(mlp))

    rows.append(redteam_case("iv: layers[0].mlp.__class__ = Sub", None, swap))

    # (v) peft LoRA
    try:
        import peft

        def lora(m):
            cfg = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)
            return peft.get_peft_model(m, cfg)

        rows.append(redteam_case("v-a: peft LoRA, `with disable_adapter()`", lora, lambda pm: pm.disable_adapter()))

        def second_adapter(pm):
            torch.manual_seed(3)
            pm.add_adapter("other", peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False))
            pm.set_adapter("other")

        rows.append(redteam_case("v-b: peft LoRA, add_adapter + set_adapter('other')", lora, second_adapter))

        def scale_lora(pm):
            for mod in pm.modules():
                if hasattr(mod, "scaling") and isinstance(getattr(mod, "scaling"), dict):
                    mod.scaling["default"] = mod.scaling["default"] * 3

        rows.append(redteam_case("v-c: peft LoRA, scaling dict value x3", lora, scale_lora))
    except ImportError as e:
        rows.append(dict(case="v: peft", error=str(e), verdict="error"))

    # (vi) backend settings
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    prec = torch.get_float32_matmul_precision()
    rows.append(redteam_case("vi-a: torch.backends.cuda.matmul.allow_tf32 flipped", None,
                             lambda m: setattr(torch.backends.cuda.matmul, "allow_tf32", not cuda_tf32),
                             undo=lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", cuda_tf32)))
    rows.append(redteam_case("vi-b: torch.backends.cudnn.allow_tf32 flipped", None,
                             lambda m: setattr(torch.backends.cudnn, "allow_tf32", not cudnn_tf32),
                             undo=lambda: setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)))
    rows.append(redteam_case("vi-c: set_float32_matmul_precision('high')", None,
                             lambda m: torch.set_float32_matmul_precision("high"),
                             undo=lambda: torch.set_float32_matmul_precision(prec)))
    # (vii) a forward hook
    rows.append(redteam_case("vii: forward hook (x2) on layers[0]", None,
                             lambda m: (m.model.layers[0].register_forward_hook(_double_hook), None)[1]))
    rows.append(redteam_case("vii-b: the same, torch._dynamo.config.skip_nnmodule_hook_guards=False", None,
                             lambda m: (m.model.layers[0].register_forward_hook(_double_hook), None)[1],
                             dynamo_config=dict(skip_nnmodule_hook_guards=False)))

    # (viii) a counter incremented in a user forward: 1 compiled call, then 4 more
    reset()
    model = build("llama")
    counting = CountingMLP(model.model.layers[0].mlp)
    model.model.layers[0].mlp = counting
    inputs = Inputs(model)  # 2 eager calls
    backend = Backend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    start = counting.calls
    compiles = []
    with torch.no_grad():
        for _ in range(5):
            before = n_compiled()
            compiled(**inputs.fresh(0))
            compiles.append(n_compiled() - before)
    r = dict(case="viii: self.calls += 1 in a user forward, 5 compiled calls",
             calls_incremented_by=counting.calls - start, expected=5, compiles_per_call=compiles,
             reasons=[short(x, 160) for x in failures()][:2])
    r["verdict"] = ("counter kept in step; " if r["calls_incremented_by"] == 5 else "counter DIVERGES; ") + (
        "recompiles every call (int attribute guarded by value)" if sum(compiles[1:]) else "no recompile")
    print(json.dumps(r), flush=True)
    rows.append(r)

    # (ix) config._attn_implementation -> eager
    def to_eager(m):
        m.config._attn_implementation = "eager"

    rows.append(redteam_case("ix: config._attn_implementation = 'eager'", None, to_eager))

    # (x) a parameter replaced by a new tensor (same shape): not a trace change, but a CUDA graph replays addresses
    def new_weight(m):
        proj = m.model.layers[0].self_attn.q_proj
        proj.weight = nn.Parameter(proj.weight.detach() * 2)

    rows.append(redteam_case("x: q_proj.weight = new Parameter (x2) (a CUDA graph would replay the old address)",
                             None, new_weight))
    return rows


# --------------------------------------------------------------------------------------------------------------------
# 4. report


def family_table(rows, title):
    lines = [f"### {title}", "",
             "| family | graphs | breaks (top reason) | sdpa / cache-cat nodes | splittable | FX nodes | guards | trace ms "
             "| next pos. recompiles | dyn-len: recompiles / length-dep. tensor nodes | eager µs | compiled-hit µs "
             "| outside graph µs | guard check µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | error: {r['error'][:120]} |" + " |" * 12)
            continue
        top = ""
        if r["break_reasons"]:
            k, v = max(r["break_reasons"].items(), key=lambda kv: kv[1])
            top = f" ({v}x: {short(k, 90)})"
        d = r.get("dynamic_len") or {}
        dyn = (f"{d.get('recompiles_next_position')} / {sum(d.get('length_dependent_tensor_nodes', {}).values())}"
               + (f" ({', '.join(f'{k}x{v}' for k, v in d['length_dependent_tensor_nodes'].items())})"
                  if d.get("length_dependent_tensor_nodes") else "")) if d else "-"
        lines.append(
            f"| {r['family']} | {r['graphs']} | {r['breaks']}{top} | {r['sdpa']} / {r['cache_cats']} | "
            f"{'yes' if r['splittable'] and r['breaks'] == 0 else ('pieces' if r['splittable'] else 'no')} | "
            f"{r['nodes']} | {r['guards']} | {r['trace_ms']} | {r['recompiles_next_position']} | {dyn} | "
            f"{r['eager_us']} | {r['compiled_us']} | {r['outside_graph_us']} | {r.get('guard_check_us')} |")
    return lines


def markdown(res, cmd, other=None):
    v = res["versions"]
    out = [
        "# Dynamo probe: option (a) of issue 36, measured on the CPU",
        "",
        f"Generated by `scripts/dynamo_probe.py`. torch {v['torch']}, transformers {v['transformers']}, "
        f"Python {v['python']}, {v['machine']}. Command: `{cmd}`",
        "",
        "Each row: a 2-layer random model (hidden 64), a DynamicCache prefilled with 7 tokens, one one-token decode "
        "forward traced by `torch.compile(model, backend=<plain FX backend returning gm.forward>, dynamic=False)` "
        "under `torch.no_grad()`. *sdpa / cache-cat nodes*: FX nodes calling `scaled_dot_product_attention` and "
        "`torch.cat` on a cache tensor (Dynamo inlines `DynamicLayer.update`); *splittable*: every layer's attention "
        "and cache update are nodes of the graph and there is no break (*pieces*: they are nodes but the forward "
        "breaks elsewhere too). *guards*: leaf guards in the compiled frames' guard trees. *next pos. recompiles*: "
        "the call with the cache one longer. *dyn-len*: traced again with the cache tensors' sequence dim marked "
        "`maybe_mark_dynamic`: recompiles at the next position, and tensor-valued nodes other than the cache update "
        "and the attention whose shape depends on the cache length. *eager µs / compiled-hit µs*: medians of "
        f"{res.get('n_calls')} calls (CPU, shared machine); *outside graph*: compiled-hit time not spent inside the "
        "FX graph(s): Dynamo's entry, guard evaluation, side-effect replay (cache attribute writes), output rebuild; "
        "*guard check µs*: the frame's guard tree evaluated alone (`guard_manager.check` on the frame's locals "
        "captured from an eager call), the guard part of that.",
        "",
    ]
    if "families" in res:
        ok = [r for r in res["families"] if "error" not in r]
        single = [r["family"] for r in ok if r["graphs"] == 1 and r["breaks"] == 0]
        split = [r["family"] for r in ok if r["splittable"]]
        sliding = [r["family"] for r in ok if (r.get("dynamic_len") or {}).get("recompiles_next_position")]
        lendep = [r["family"] for r in ok if (r.get("dynamic_len") or {}).get("length_dependent_tensor_nodes")]
        baked = [r["family"] for r in ok if r.get("recompiles_other_tokens") or r.get("maxdiff_other_tokens", 0) > 1e-5]
        tr = sorted(r["trace_ms"] for r in ok)
        out += [
            f"**Summary ({v['transformers']})**: {len(ok)}/{len(res['families'])} families traced; "
            f"{len(single)} in one graph with no break; {len(split)} with every attention call and cache update as "
            f"FX nodes (splittable). Trace (first call) {tr[0]}-{tr[-1]} ms, median {statistics.median(tr):.0f} ms. "
            f"Every family recompiles at the next position under `dynamic=False` (cache tensor size guard). With the "
            f"cache's sequence dim marked dynamic, still recompiling every position: {', '.join(sliding) or 'none'} "
            f"(`cumulative_length` int guard of the sliding-window cache layer); length-dependent tensor work outside "
            f"the attention/cache update (mask building, would sit inside a piece): {', '.join(lendep) or 'none'}. "
            f"A hit with other "
            f"token ids (same shapes) recompiled or differed from eager in: {', '.join(baked) or 'none'}. "
            f"Timings are single-thread medians on a shared 2-core CPU: noisy (a few rows show compiled > eager).",
            "",
        ]
        out += family_table(res["families"], f"Families, transformers {v['transformers']}") + [""]
    if other:
        out += family_table(other["families"], f"Families, transformers {other['versions']['transformers']}") + [""]
    if "llama1b" in res:
        out += ["### Llama shaped like Llama-3.2-1B (16 layers)", "",
                "| shape | params | graphs | FX nodes | leaf guards / checks executed on a hit | top guard kinds | trace ms "
                "| eager µs | compiled-hit µs | outside graph µs | guard check µs |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, r in res["llama1b"].items():
            if "error" in r:
                out.append(f"| {label} | error: {r['error']} |" + " |" * 9)
                continue
            kinds = ", ".join(f"{k} {n}" for k, n in list(r["guard_kinds"].items())[:4])
            out.append(f"| {label} | {r['params']:,} | {r['graphs']} | {r['nodes']} | {r['guards']} / "
                       f"{r['guards_executed_on_hit']} | {kinds} | {r['trace_ms']} | {r['eager_us']} | "
                       f"{r['compiled_us']} | {r['outside_graph_us']} | {r['guard_check_us']} |")
        out.append("")
    if "dynamic" in res:
        out += ["### Avoiding the per-position recompile (2-layer llama, calls at cache lengths 7, 8, 9, 10)", "",
                "| mode | compiles per call | graphs | outputs match eager | length-dep. tensor nodes | SymInt nodes |",
                "|---|---|---|---|---|---|"]
        for label, r in res["dynamic"].items():
            out.append(f"| {label} | {r['compiles_per_call']} | {r['graphs_total']} | {r['outputs_match']} | "
                       f"{r['length_dependent_tensor_nodes'] or 0} | {r['symint_nodes']} |")
        out.append("")
    if "redteam" in res:
        out += ["### Red team (2-layer llama; change after the first compiled call)", "",
                "| case | recompiled (guard caught it) | compiled == eager after change | change alters eager output "
                "| verdict | guard-failure reason |", "|---|---|---|---|---|---|"]
        for r in res["redteam"]:
            if "calls_incremented_by" in r:
                out.append(f"| {r['case']} | compiles per call {r['compiles_per_call']} | calls +{r['calls_incremented_by']} "
                           f"(eager: +{r['expected']}) | - | {r['verdict']} | {'; '.join(r['reasons'])[:200]} |")
                continue
            if "error" in r:
                out.append(f"| {r['case']} | - | - | - | error: {r['error'][:150]} | |")
                continue
            out.append(f"| {r['case']} | {r['recompiled']} | {r['matches_eager']} "
                       f"(max diff {r['maxdiff_compiled_vs_eager']:.2g}) | {r['change_changes_eager_output']} | "
                       f"{r['verdict']} | {'; '.join(r['reasons'])[:200].replace('|', '/')} |")
        out.append("")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="families,llama1b,dynamic,redteam")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--calls", type=int, default=40, help="calls per median (per family)")
    p.add_argument("--no-dynamic-len", action="store_true", help="skip the second, length-dynamic trace per family")
    p.add_argument("--no-wide", action="store_true", help="skip the full-width bf16 16-layer llama")
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--other-families", help="JSON of another run whose family table the markdown adds")
    p.add_argument("--render", help="write --md from this saved --json result instead of running")
    a = p.parse_args()
    other = None
    if a.other_families:
        with open(a.other_families) as f:
            other = json.load(f)
    if a.render:
        with open(a.render) as f:
            res = json.load(f)
        with open(a.md, "w") as f:
            f.write(markdown(res, res.get("command", "?"), other))
        return
    torch.set_num_threads(1)
    parts = a.parts.split(",")
    res: dict = dict(
        versions=dict(torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                      machine=f"{platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), "
                              f"{__import__('os').cpu_count()} cores"),
        n_calls=a.calls,
        command="python " + " ".join(sys.argv),
    )
    t = time.perf_counter()
    if "families" in parts:
        res["families"] = families(a.families.split(","), a.calls, not a.no_dynamic_len)
    if "llama1b" in parts:
        res["llama1b"] = llama1b(4 * a.calls, not a.no_wide)
    if "dynamic" in parts:
        res["dynamic"] = dynamic_modes()
    if "redteam" in parts:
        res["redteam"] = redteam()
    res["wall_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps({k: v for k, v in res.items()}, default=str))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(res, res["command"], other))


if __name__ == "__main__":
    main()
