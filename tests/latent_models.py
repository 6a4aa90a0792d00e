"""Tiny random-weight causal LMs of the multi-head latent attention families (issue 45): DeepSeek-V3 and the families
that cache compressed latents and decompress them after the cache update with their attention module's `expand_kv`
(`graphs/piecewise/proof/attention.py`, `Cut.derive`). Each built from its own config class at its defaults but for
the sizes (DeepSeek-V3: a LoRA'd query, interleaved rope, a dense layer then a routed-experts layer with shared
experts and group-limited routing). Used by tests/test_piecewise_latent_attention.py and the usage fuzzer's
`latent_family` dimension (usage_dimensions._latent_family, usage_runner.latent_model)."""

from __future__ import annotations

import torch
import transformers

from models import PAD, VOCAB

# the families whose attention module derives its keys and values with `expand_kv` after the cache update (one
# config field set apart: each family's own config class takes the fields it has)
FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3")
_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
              n_group=2, topk_group=1)


def available(family: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return family in CONFIG_MAPPING_NAMES


def build_latent(family: str, device="cpu", dtype=torch.float32, seed: int = 0, attn: str = "sdpa"):
    """The family's causal LM at the sizes above; `attn`: the attention implementation (the usage fuzzer's
    `latent_family` builds eager ones too)."""
    config = transformers.AutoConfig.for_model(family, **_SIZES)
    config.initializer_range = 0.5  # a wide init: greedy decoding of a tiny model does not repeat one token
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()
