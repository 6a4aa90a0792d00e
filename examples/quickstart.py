"""Quick start: the same generate() call without and with the flag, on a small model built from a config (no download).

    python examples/quickstart.py     # CUDA if available, else CPU (where the flag runs transformers' own loop)
"""

import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_async_stop as tas  # importing applies the patches; nothing changes until you ask for the flag

logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("transformers_async_stop").setLevel(logging.INFO)  # one line per call that asks for the flag

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
model = LlamaForCausalLM(config).to(device).eval()
prompt = torch.randint(3, 1000, (2, 12), device=device)
kwargs = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)

for cache in (None, "static"):
    plain = model.generate(prompt, cache_implementation=cache, **kwargs)
    fast = model.generate(prompt, cache_implementation=cache, async_stopping_criteria=True, **kwargs)
    assert torch.equal(plain, fast), "the flag must not change the output"
    print(f"cache={cache or 'dynamic'}: identical outputs; path: {tas.last_path().describe()}")
