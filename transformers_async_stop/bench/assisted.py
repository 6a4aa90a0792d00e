"""Assisted decoding and prompt lookup cases: ms per accepted token, acceptance rate, syncs per verify round.

Three cases on a Llama-1B-shaped bf16 target (random weights, no hub download), eager only (assisted decoding
takes a DynamicCache):
- `llama-1b-draft`: a tiny draft that shares the target's embeddings, its first `DRAFT_LAYERS` layers, its final
  norm and its head (no extra weights); the target's deeper layers are scaled down (`DEEP_LAYER_SCALE`) so that
  the draft agrees with it often enough to be worth verifying; greedy and speculative sampling;
- `llama-1b-copy`: the target drafting for itself (the same modules), the 100%-acceptance bound for greedy;
- `llama-1b-lookup`: prompt lookup with an echo target (`_echo`: the same compute, arranged so that its greedy
  output repeats its last token) on a prompt made of its own greedy output, so the prompt's n-grams come back: the
  lookup's bound, as the copy is the draft's. (An untouched random 1B target never repeats an n-gram in 200
  greedy tokens: lookup would find nothing to propose.)
Drafts run with a fixed length (`DRAFT_TOKENS`, "constant" schedule) and no confidence threshold: a random draft's
probabilities are near-uniform, so the default threshold (0.4) would stop every draft after one token.

Every generated token is an accepted one, so the benchmark's ms/tok, (t_N - t_1) / (N - 1), is the ms per accepted
token. `ACCEPTANCE` adds, per variant, the acceptance rate (accepted draft tokens / drafted tokens), the tokens per
verify round, and on CUDA the blocking syncs per round. These cases are opt-in (`--cases`); `cases_with_prefix`
builds the same cases on any base config (the CPU test uses a small one).
"""

from __future__ import annotations

import copy
import weakref
from unittest import mock

import torch

from . import gpu
from .cases import Case, _from_config, llama_1b_config

DRAFT_LAYERS = 2
# random weights: a 2-layer draft of an untouched 16-layer target agrees with it on almost no token; scaled this
# way, on about two thirds of them (measured on a small Llama; the run reports its own acceptance rate)
DEEP_LAYER_SCALE = 0.03
DRAFT_TOKENS = 5
LOOKUP_TOKENS = 10
DECODES = ("greedy", "sample")
FIELDS = ("accept_rate", "tokens_per_round", "rounds", "syncs_per_round")

_DRAFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> its draft model
_PROMPTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> (prompt length, ids)


def cases_with_prefix(prefix: str, config, new_tokens: int, prompt_len: int, dtype: str) -> dict[str, Case]:
    """The three cases on a target built from `config`, named `{prefix}-draft`, `-copy` and `-lookup` (opt-in)."""
    build = _from_config(config)
    common = dict(batches=(1,), new_tokens=new_tokens, prompt_len=prompt_len, dtype=dtype, pad_token_id=0,
                  opt_in=True)
    return {
        f"{prefix}-draft": Case(f"{prefix}-draft", _with_quiet_deep_layers(build), extra=_draft_extras("shared"),
                                plan=tuple(("eager", d) for d in DECODES), **common,
                                about=f"assisted decoding, a {DRAFT_LAYERS}-layer draft made of the target's own "
                                      "first layers; greedy and sampling"),
        f"{prefix}-copy": Case(f"{prefix}-copy", build, extra=_draft_extras("copy"), plan=(("eager", "greedy"),),
                               **common, about="assisted decoding, the target drafting for itself (every draft "
                                               "token accepted), greedy"),
        f"{prefix}-lookup": Case(f"{prefix}-lookup", _echo(build), extra=_lookup_extras,
                                 plan=(("eager", "greedy"),), **common,
                                 about="prompt lookup on a target that repeats its prompt's n-grams (the lookup's "
                                       "bound), greedy"),
    }


def assisted_cases() -> dict[str, Case]:
    return cases_with_prefix("llama-1b", llama_1b_config(), 128, 32, "bf16")


def is_assisted(case: Case) -> bool:
    return getattr(case.extra, "assisted", False)


def _no_early_stop(model) -> dict:
    """Every variant makes all N tokens: the other cases mask EOS with `min_new_tokens`, which 4.57-5.0 refuse with
    assisted decoding; here the EOS id is one the model cannot produce (its vocabulary ends before it)."""
    return {"min_new_tokens": None, "eos_token_id": model.config.get_text_config().vocab_size}


# --- drafts -------------------------------------------------------------------------------------------------------
def _with_quiet_deep_layers(build):
    """The target of the draft case: the layers the draft lacks write `DEEP_LAYER_SCALE` times less into the
    residual stream (their output projections are scaled), so the draft agrees with the target often. The compute
    is the target's, unchanged."""

    def quiet(device, dtype):
        model = build(device, dtype)
        with torch.no_grad():
            for layer in model.model.layers[DRAFT_LAYERS:]:
                layer.self_attn.o_proj.weight.mul_(DEEP_LAYER_SCALE)
                layer.mlp.down_proj.weight.mul_(DEEP_LAYER_SCALE)
        return model

    return quiet


def _echo(build):
    """The lookup case's target: every layer's output projections are zero, so the residual stream is the current
    token's embedding, and the head is the embedding matrix, under which a random embedding is closest to itself:
    the greedy output repeats the last token. The compute is the target's, unchanged."""

    def echo(device, dtype):
        model = build(device, dtype)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        return model

    return echo


def _draft_extras(kind: str):
    def extra(run, model) -> dict:
        draft = _DRAFTS.get(model, {}).get(kind)
        if draft is None:
            draft = make_draft(model, kind)
            _DRAFTS.setdefault(model, {})[kind] = draft
        return dict(_no_early_stop(model), assistant_model=draft)

    extra.assisted = True
    return extra


def make_draft(target, kind: str):
    """A draft for `target` that shares its weights: "copy" (all of them) or "shared" (the embeddings, the first
    DRAFT_LAYERS layers, the final norm and the head)."""
    if kind == "copy":
        draft = copy.copy(target)  # the same modules; its own generation config
        draft.__dict__["_forward_hooks"] = type(target._forward_hooks)()  # hooks on the target stay the target's
    else:
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = DRAFT_LAYERS
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = config.layer_types[:DRAFT_LAYERS]
        param = next(target.parameters())
        draft = _from_config(config)(param.device, param.dtype)
        draft.model.embed_tokens = target.model.embed_tokens
        draft.model.layers = torch.nn.ModuleList(target.model.layers[:DRAFT_LAYERS])
        draft.model.norm = target.model.norm
        draft.lm_head = target.lm_head
        # the new model and its new ModuleList start in training mode (the target's shared modules are in eval):
        # a draft in training mode keeps the graphed forward off ("training mode")
        draft.eval()
        gpu.free(param.device)
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.generation_config.num_assistant_tokens = DRAFT_TOKENS
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


# --- prompt lookup ------------------------------------------------------------------------------------------------
def _lookup_extras(run, model) -> dict:
    saved = _PROMPTS.get(model)
    if saved is None or saved[0] != run.case.prompt_len:
        saved = (run.case.prompt_len, repetitive_prompt(model, run.case.prompt_len))
        _PROMPTS[model] = saved
    ids = saved[1]
    return dict(_no_early_stop(model), input_ids=ids, attention_mask=torch.ones_like(ids),
                prompt_lookup_num_tokens=LOOKUP_TOKENS)


_lookup_extras.assisted = True


def repetitive_prompt(model, length: int) -> torch.Tensor:
    """A random 8-token start, then the target's own greedy continuation, `length` tokens in all (made with
    transformers as shipped)."""
    from .variants import variant

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(2)
    start = torch.randint(3, vocab - 1, (1, 8), generator=gen).to(device)
    with variant("stock"):
        out = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=length - 8,
                             min_new_tokens=length - 8, do_sample=False, pad_token_id=0)
    return out[:, :length]


# --- the acceptance metric ----------------------------------------------------------------------------------------
def acceptance(ctx, flag: dict) -> dict:
    """Acceptance rate and tokens per round of an N-token call; on CUDA, syncs per verify round (N-token call minus
    1-token call, over the difference in rounds)."""
    from transformers.generation.candidate_generator import (
        AssistedCandidateGenerator,
        PromptLookupCandidateGenerator,
    )

    def one_call(kwargs) -> tuple[list, int | None]:
        rounds = []

        def recording(cls):
            original = cls.update_candidate_strategy

            def update_candidate_strategy(self, input_ids, scores, num_matches):
                # kept as passed (a device tensor before 5.23): read after the counted call, not inside it
                rounds.append((num_matches, scores.shape[1] - 1))
                return original(self, input_ids, scores, num_matches)

            return update_candidate_strategy

        with mock.patch.object(AssistedCandidateGenerator, "update_candidate_strategy",
                               recording(AssistedCandidateGenerator)), \
                mock.patch.object(PromptLookupCandidateGenerator, "update_candidate_strategy",
                                  recording(PromptLookupCandidateGenerator)):
            syncs = None
            if ctx.cuda:
                syncs, _ = gpu.count_syncs(ctx.model, kwargs, flag, ctx.device)
            else:
                gpu.call(ctx.model, kwargs, flag)
        return [(int(matches), length) for matches, length in rounds], syncs

    rounds_n, syncs_n = one_call(ctx.kw_n)
    rounds_1, syncs_1 = one_call(ctx.kw_1)
    drafted = sum(length for _, length in rounds_n)
    accepted = sum(min(matches, length) for matches, length in rounds_n)
    extra_rounds = len(rounds_n) - len(rounds_1)
    return {
        "accept_rate": accepted / drafted if drafted else None,
        "tokens_per_round": ctx.n / len(rounds_n) if rounds_n else None,
        "rounds": len(rounds_n),
        "syncs_per_round": (syncs_n - syncs_1) / extra_rounds if syncs_n is not None and extra_rounds > 0 else None,
    }


def install_metric() -> None:
    """Add the acceptance figures to every variant of the assisted cases' runs (`measure.METRICS`)."""
    from . import measure

    if any(metric.collect is acceptance for metric in measure.METRICS):
        return
    measure.METRICS.append(measure.Metric(FIELDS, lambda v, ctx: is_assisted(ctx.run.case), acceptance))


# --- the report ---------------------------------------------------------------------------------------------------
TITLES = ("run", "variant", "ms/accepted tok", "floor ms", "accept rate", "tok/round", "syncs/round")


def rows(result: dict) -> list[tuple[str, ...]]:
    from .tables import _fmt

    out = []
    for r in result["runs"]:
        if r.get("error"):
            continue
        if all(m.get("tokens_per_round") is None for m in r["variants"].values()):
            continue  # not an assisted case (the metric's fields are None there)
        for v, m in r["variants"].items():
            out.append((r["label"], v, _fmt(m["ms_per_token"], ".3f"), _fmt(r["floor_ms_per_token"], ".3f"),
                        _fmt(m["accept_rate"] * 100 if m["accept_rate"] is not None else None, ".0f", "%"),
                        _fmt(m["tokens_per_round"], ".2f"), _fmt(m["syncs_per_round"], ".2f")))
    return out


LEGEND = ("assisted decoding and prompt lookup: ms/accepted tok = ms/tok (every generated token is an accepted "
          "one); accept rate = accepted draft tokens / drafted tokens; tok/round = tokens per verify round; "
          "syncs/round = blocking syncs per verify round (CUDA)")


def text_report(result: dict) -> str:
    found = rows(result)
    if not found:
        return ""
    from .tables import _aligned

    return "\n".join(["", LEGEND, _aligned([TITLES] + found)])


def markdown(result: dict) -> str:
    found = rows(result)
    if not found:
        return ""
    from .tables import _md_table

    return "\n".join(["", LEGEND + ".", "", _md_table(TITLES, found), ""])
