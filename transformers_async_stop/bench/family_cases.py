"""Cases for the families the graphed forward proves without a hand read (issue 36), one per new group, each about
the size of the Llama-1B-shaped case, bf16, greedy b1 with the default `DynamicCache` (opt-in: `--cases
gemma-2b,olmo-1b,granite-1b,mistral-1b,mixtral-1b`):
- `gemma-2b`: Gemma-2B-shaped (18 layers, multi-query attention, head dim 256, 256k vocabulary, GELU-tanh MLP);
- `olmo-1b`: OLMo-1B-shaped (16 layers, layer norms without parameters, q/k/v clipping off);
- `granite-1b`: a Granite of Llama-1B's shape (its embedding, residual, attention and logit multipliers);
- `mistral-1b`: a Mistral of Llama-1B's shape with Mistral's default 4096-token sliding window;
- `mixtral-1b`: a Mixtral of about 1B parameters (16 layers, 8 experts, 2 per token).
"""

from __future__ import annotations

from transformers import GemmaConfig, GraniteConfig, MistralConfig, MixtralConfig, OlmoConfig

from .cases import Case, _from_config

_DYNAMIC_B1 = (("eager", "greedy"),)
_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8)


def family_cases() -> dict[str, Case]:
    configs = {
        "gemma-2b": (GemmaConfig(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                                 num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000),
                     "Gemma-2B-shaped (18 layers, MQA, head dim 256, GELU-tanh)"),
        "olmo-1b": (OlmoConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                               num_key_value_heads=16, vocab_size=50304),
                    "OLMo-1B-shaped (parameter-free layer norms)"),
        "granite-1b": (GraniteConfig(**_LLAMA_1B, vocab_size=49155, embedding_multiplier=12.0,
                                     residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0),
                       "a Granite of Llama-1B's shape (its four multipliers)"),
        "mistral-1b": (MistralConfig(**_LLAMA_1B, vocab_size=32768),
                       "a Mistral of Llama-1B's shape, its default 4096-token sliding window"),
        "mixtral-1b": (MixtralConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                     num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000),
                       "a Mixtral of about 1B parameters (8 experts, 2 per token)"),
    }
    return {name: Case(name, _from_config(config), (1,), 128, 32, "bf16", pad_token_id=0, plan=_DYNAMIC_B1,
                       opt_in=True, about=f"{about}, bf16, greedy b1, DynamicCache")
            for name, (config, about) in configs.items()}
