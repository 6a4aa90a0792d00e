"""Stage 1 of the proof: the model's family, read by hand or found from the model.

A replay runs no Python of the model's forward: every decision the forward makes in Python is baked into the graphs at
the recording. The proof starts from where the model keeps the modules it cuts the forward at (its decoder layers'
attention modules) and what else of its forward is decided in Python (`Family`):

- a family read by hand (`FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2, OPT, Gemma 3 text; the sources behind
  `targets.SHORTCUTS` "piecewise forward (<family>)"), exactly their causal LM and base classes, whose every module
  class was read with the family; a hand-read family running a class no one read with it (Llama with
  `hidden_act="gelu"`), or whose sources drifted on a newer release, is proven per recording instead (`auto`);
- any other transformers causal LM, its layout found from the model (`discover.py`), proven per recording from what
  it ran (`verdict.py`, docs/design/family-proof.md).

`find(model)` answers (family, None) or (None, why none), and nothing else: what must hold of the model and the call
is `admission.py`'s (stage 1, continued).
"""

from __future__ import annotations

import dataclasses
import operator

from ....release_checks.verified import matches, sources_of
from . import default_deny
from .discover import family_for

# the modeling module's functions a replay skips, watched for rebinding (those a module does not have are left out)
_WATCHED_GLOBALS = ("apply_rotary_pos_emb", "rotate_half", "create_causal_mask", "ALL_ATTENTION_FUNCTIONS")
# an encoder-decoder's decoder's: its cross-attention mask is made by the module's `create_bidirectional_mask`
_ENCODER_DECODER_WATCHED = ("create_causal_mask", "create_bidirectional_mask", "ALL_ATTENTION_FUNCTIONS")


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family read for the path: where its attention modules and rotary embedding are, and what else of its
    forward is decided in Python."""

    name: str
    module: str  # the modeling module
    causal_lm: str  # the causal LM class (the base model's class is the `FAMILIES` key)
    layers: str = "layers"  # the base model's attribute holding its decoder layers
    attention: str = "self_attn"  # each layer's attention module (the one that calls the cache update)
    rotary: str | None = "rotary_emb"  # the base model's rotary embedding (None: a learned position table)
    watched: tuple = _WATCHED_GLOBALS
    # the base forward starts with `warn_if_padding_and_no_attention_mask` (GPT-2): run before each replay
    checks_padding: bool = False
    # each layer's window is its `layer_types` entry (Gemma 3: `sliding_window` is set, used by sliding layers only)
    windows_by_layer_type: bool = False
    # found by `discover.py` and proven per recording (`verdict.py`), not read by hand
    auto: bool = False
    # the config's count of the layers cut at (Whisper's `num_hidden_layers` is the encoder's: `decoder_layers`)
    layer_count: str = "num_hidden_layers"
    # an encoder-decoder's decoder: each layer's cross-attention module (Whisper's `encoder_attn`), called after its
    # self-attention with the cross-attention cache's keys and values and no update: a second attention site per layer
    # (`recorder._Recorder.cross_attention`); None: a decoder-only model
    cross_attention: str | None = None
    # the model's submodules (dotted paths from the model) no decode step runs (an encoder-decoder's encoder, which
    # ran once before the decode steps): left out of default-deny's reading (`decoding_modules`)
    skipped: tuple = ()
    # the module (a dotted path from the model) whose call gets the positions the decoder makes itself from the
    # cache's host length (BART's `decoder.embed_positions(ids, cache_length, position_ids=...)`: its forward takes no
    # `position_ids`): a recording hands that call the positions buffer as its `position_ids` instead
    # (`recorder._Recorder.positions`), so the baked length reaches no output; None: no such call
    position_table: str | None = None
    # an encoder-decoder's decoder takes position ids (Whisper's `decoder_position_ids`: every recording and replay is
    # handed stock's own values); False: it takes none (BART's family: their position table's call is handed them;
    # T5: it has none, its relative position bias is made again at each replay, `attention.Cut.bias`)
    decoder_positions: bool = True

    def attentions(self, base, config) -> list:
        layers = operator.attrgetter(self.layers)(base)  # a dotted path for a nested decoder (OPT's `decoder.layers`)
        layers = layers[: getattr(config, self.layer_count)]
        # dotted paths too: T5's attention modules sit inside its layer's sublayers (`layer.0.SelfAttention`)
        if self.cross_attention is None:
            attention = operator.attrgetter(self.attention)
            return [attention(layer) for layer in layers]
        # in call order: each layer's self-attention, then its cross-attention
        pair = operator.attrgetter(self.attention, self.cross_attention)
        return [module for layer in layers for module in pair(layer)]


# base model class (the model's own where it has none: T5) -> its family
FAMILIES = {
    "LlamaModel": Family("llama", "transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "MistralModel": Family("mistral", "transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "Qwen2Model": Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    # fused qkv_proj / gate_up_proj, a partial rotary (static): pieces like Llama's. Its own input preparation is
    # called at every step by the dynamic-cache loop (`dynamic_loop/eligibility._OWN_INPUTS`)
    "Phi3Model": Family("phi3", "transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM",
                        watched=(*_WATCHED_GLOBALS, "create_sliding_window_causal_mask")),
    # a learned position table (`wpe`, in piece 0) instead of a rotary embedding, Conv1D projections, a fused c_attn
    # split into q/k/v; cross-attention (an `EncoderDecoderCache`) steps aside
    "GPT2Model": Family("gpt2", "transformers.models.gpt2.modeling_gpt2", "GPT2LMHeadModel", layers="h",
                        attention="attn", rotary=None, watched=("create_causal_mask", "ALL_ATTENTION_FUNCTIONS"),
                        checks_padding=True),
    # Gemma 3 (text): full-attention layers only (`layer_types`; the released configs' sliding layers keep it off the
    # dynamic-cache loop), one rope per layer type (each static), q/k norms, a scaled embedding, the final logit
    # soft-capping in the last piece (a config branch); the sliding mask it also makes is unused by full layers
    # OPT (5.18+; on 5.17 its base forward hands `create_causal_mask` a mask of ones of the cache's length when it
    # gets none, so it is proven per recording there, and refused: `targets/piecewise_rows.py`): a learned position
    # table with an offset of 2 (`embed_positions`, read in piece 0 from the positions buffer, as GPT-2's `wpe`), the
    # decoder nested in the base model (`decoder.layers`), pre- or post-attention layer norms (`do_layer_norm_before`,
    # a config branch), `project_in`/`project_out` where the word embedding is narrower (OPT-350m). Its base forward
    # reads the cache's length on the host, which reaches no output once `position_ids` is given: every recording and
    # replay is handed them (`forward.py` keeps a step without them eager, named)
    "OPTModel": Family("opt", "transformers.models.opt.modeling_opt", "OPTForCausalLM", layers="decoder.layers",
                       rotary=None, watched=("create_causal_mask", "ALL_ATTENTION_FUNCTIONS")),
    # Whisper (WhisperForConditionalGeneration's decoder, 5.17+): a learned position table (`embed_positions`, indexed
    # in piece 0 by the positions buffer: every recording and replay is handed `decoder_position_ids`, which stock's
    # decoder computes from the cache's host length otherwise), two attention sites per layer (the self-attention's
    # cache update, then the cross-attention over the cross-attention cache's keys and values, no update), an
    # `EncoderDecoderCache` whose self-attention cache the recording intercepts. The encoder never runs in a decode step
    # (`encoder_outputs` given): left out of default-deny. Its base forward reads the cache's length on the host,
    # which reaches no output once `decoder_position_ids` is given (`targets/piecewise_rows.py`, "piecewise forward
    # (whisper)"): read by hand, never proven per recording
    "WhisperModel": Family("whisper", "transformers.models.whisper.modeling_whisper", "WhisperForConditionalGeneration",
                           layers="decoder.layers", rotary=None,
                           watched=("create_causal_mask", "ALL_ATTENTION_FUNCTIONS"), layer_count="decoder_layers",
                           cross_attention="encoder_attn", skipped=("model.encoder",)),
    # BART and its modular copies (5.17+; their conditional-generation classes' decoders): a decoder nested in the
    # base model, learned (BART, mBART: an offset of 2; Blenderbot, BlenderbotSmall) or sinusoidal (Marian, Pegasus)
    # position tables, two attention
    # sites per layer as Whisper's, the same `EncoderDecoderCache` interception. Their decoders take no
    # `position_ids`: they make them from the cache's host length and hand them to `embed_positions(...,
    # position_ids=...)`, whose `position_ids` branch is device ops only; the recording hands that call the positions
    # buffer (`position_table`). The cross-attention's mask is `create_bidirectional_mask` of the encoder's
    # `attention_mask`, made again at every replay by stock's function (`recorder._Recorder.cross_mask`). Read by hand
    # (`targets/piecewise_rows.py`, "piecewise forward (bart)" and the others)
    **{f"{prefix}Model": Family(name, f"transformers.models.{name}.modeling_{name}", generation_class,
                                layers="decoder.layers", rotary=None, watched=_ENCODER_DECODER_WATCHED,
                                layer_count="decoder_layers", cross_attention="encoder_attn", skipped=("model.encoder",),
                                decoder_positions=False, position_table="model.decoder.embed_positions")
       for name, prefix, generation_class in (
           ("bart", "Bart", "BartForConditionalGeneration"), ("mbart", "MBart", "MBartForConditionalGeneration"),
           ("marian", "Marian", "MarianMTModel"), ("pegasus", "Pegasus", "PegasusForConditionalGeneration"),
           ("blenderbot", "Blenderbot", "BlenderbotForConditionalGeneration"),
           ("blenderbot_small", "BlenderbotSmall", "BlenderbotSmallForConditionalGeneration"))},
    # T5 (T5ForConditionalGeneration's decoder, 5.17+): no base model (the conditional-generation class holds its
    # stacks: `base_of` gives the model itself), the decoder's blocks at `decoder.block`, each block's self-attention
    # and cross-attention inside its sublayers (`layer.0.SelfAttention`, `layer.1.EncDecAttention`), no positions
    # (the relative position bias, computed after layer 0's cache update from the cache's host lengths: run eagerly at
    # each replay, `attention.Cut.bias`), an `EncoderDecoderCache`; the encoder never runs in a decode step. Read by
    # hand (`targets/piecewise_t5_rows.py`, "piecewise forward (t5)"), never proven per recording
    # mT5: T5's code under its own class names ("piecewise forward (mt5)"); no `scale_decoder_outputs` branch
    **{generation_class: Family(name, f"transformers.models.{name}.modeling_{name}", generation_class,
                                layers="decoder.block", attention="layer.0.SelfAttention", rotary=None,
                                watched=_ENCODER_DECODER_WATCHED, layer_count="num_decoder_layers",
                                cross_attention="layer.1.EncDecAttention", skipped=("encoder",), decoder_positions=False)
       for name, generation_class in (("t5", "T5ForConditionalGeneration"), ("mt5", "MT5ForConditionalGeneration"))},
    "Gemma3TextModel": Family("gemma3", "transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM",
                              watched=(*_WATCHED_GLOBALS, "create_sliding_window_causal_mask"),
                              windows_by_layer_type=True),
}
# rope types whose frequencies are fixed at init (the `dynamic_rope_update` decorator does nothing for them)
STATIC_ROPE = frozenset(("default", "linear", "llama3", "yarn"))


def base_of(model):
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if base is None and type(model).__name__ in FAMILIES:
        # a read family whose model holds its stacks itself (T5ForConditionalGeneration: `base_model_prefix` names
        # no attribute of it), keyed by the model's own class
        return model
    return base



def family_of(model) -> Family | None:
    return find(model)[0]


def find(model):
    """(the model's family, None) or (None, why it has none): a hand-read one (`FAMILIES`), else the layout found
    from the model (`discover.py`), proven per recording."""
    base = base_of(model)
    family = FAMILIES.get(type(base).__name__) if base is not None else None
    if family is not None and family.cross_attention is not None:
        # an encoder-decoder's decoder is read by hand only: a class no one read with it is refused by default-deny,
        # named (`admission.py`)
        return family, None
    if family is not None:
        # a hand-read family whose model runs a class no one read with it (an activation of another family, Llama
        # with `hidden_act="gelu"`), or whose sources drifted on a newer release, is proven per recording instead,
        # where the shared sources are the ones read (elsewhere, an older release, it keeps its own reason)
        if _read_covers(model, family) or not matches("piecewise shared sources"):
            return family, None
        return dataclasses.replace(family, auto=True), None
    return family_for(model, Family, _WATCHED_GLOBALS)


_COVERED: dict = {}  # (family name, the model's module classes) -> every class is read with the family


def _read_covers(model, family: Family) -> bool:
    name = f"piecewise forward ({family.name})"
    if not matches(name):
        return False
    classes = frozenset(map(type, decoding_modules(model, family)))
    key = (family.name, classes)
    covered = _COVERED.get(key)
    if covered is None:
        if len(_COVERED) >= 64:  # bounded: user classes are not kept alive for good
            _COVERED.clear()
        covered = _COVERED[key] = default_deny.classes_read(classes, sources_of(name))
    return covered


def decoding_modules(model, family: Family | None) -> list:
    """The model's modules a decode step may run: all of them, but those reached only through the family's `skipped`
    paths (an encoder-decoder's encoder). A module shared with the decoding part is kept (its other path runs it)."""
    skipped = [model.get_submodule(path) for path in family.skipped] if family is not None and family.skipped else []
    if not skipped:
        return list(model.modules())
    cut = set(map(id, skipped))
    seen, order, stack = set(), [], [model]
    while stack:
        module = stack.pop()
        if id(module) in seen or id(module) in cut:
            continue
        seen.add(id(module))
        order.append(module)
        stack.extend(reversed(list(module.children())))
    return order
