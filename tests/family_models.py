"""Tiny random-weight causal LMs of 31 transformers families, each built from its own config class (no hub access):
the families of issue 36's table, at their default activation, layer types and rope, small sizes, SDPA attention."""

from __future__ import annotations

import torch
import transformers

from models import PAD, TRANSFORMERS_VERSION, VOCAB

# every family of the table, by `model_type`
FAMILIES = (
    "llama", "qwen2", "qwen3", "phi3", "gpt2", "gemma", "phi", "gpt_neox", "gptj", "falcon", "olmo", "olmo2", "granite",
    "starcoder2", "cohere", "stablelm", "smollm3", "mixtral", "qwen2_moe", "opt", "gpt_bigcode", "glm", "ernie4_5",
    "helium", "arcee", "seed_oss", "hunyuan_v1_dense", "mistral", "gemma3_text", "ministral", "exaone4",
)
# what keeps a family's decode forward eager, by design (docs/paths.md), each reason it may give: Falcon calls SDPA
# itself inside its attention's forward, not through transformers' attention functions (no call to cut the forward
# at: `graphs/piecewise/proof/attention.py`); OPT's base forward reads the cache's length on the host every step, which
# the automatic proof refuses: read by hand on 5.18-5.24 (tests/test_piecewise_opt.py), eager on 5.17
EAGER = {
    "falcon": ("the attention is computed inside FalconAttention.forward, not by an attention function",),
    **({"opt": ("reads 'get_seq_length' on the host",)} if TRANSFORMERS_VERSION < (5, 18) else {}),
}
_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
_EXTRA = {
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "gpt2": dict(n_inner=64),
    "gptj": dict(rotary_dim=4),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "helium": dict(head_dim=8), "hunyuan_v1_dense": dict(head_dim=8), "ministral": dict(head_dim=8),
}


def sdpa_supported(model_type: str) -> bool:
    """Whether this release builds the family with SDPA attention (GPT-J gained it in 5.24)."""
    try:
        build_family(model_type)
    except ValueError:
        return False
    return True


def build_family(model_type: str, device="cpu", dtype=torch.float32, seed: int = 0, attn: str = "sdpa",
                 **overrides):
    """The family's causal LM at its config's defaults but for the sizes; `overrides` go to the config; `attn`: the
    attention implementation (the usage fuzzer's `found_family` builds eager ones too)."""
    kwargs = {**_SMALL, **_EXTRA.get(model_type, {}), **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config.initializer_range = 0.5  # a wide init: greedy decoding of a tiny model does not repeat one token
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()
