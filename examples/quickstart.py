"""Quick start: the same generate() call with and without the flag, on a model built from a config (no download).

    python examples/quickstart.py            # CUDA if available, else CPU (where the flag runs the stock loop)
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_async_stop  # noqa: F401  (importing applies the patches)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=32000)
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(3, 32000, (1, 16), device=device)
    kwargs = dict(max_new_tokens=128, min_new_tokens=128, pad_token_id=0,
                  cache_implementation="static" if device == "cuda" else None)

    if device == "cpu":
        print("no CUDA: the flag runs the stock loop on CPU, so expect no speed difference here")
    results = {}
    for flag in (False, True):
        for _ in range(2):  # warm-up (and compile, on CUDA)
            model.generate(prompt, async_stopping_criteria=flag, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(prompt, async_stopping_criteria=flag, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        results[flag] = (out, (time.perf_counter() - start) / 128 * 1e3)
        print(f"async_stopping_criteria={flag!s:5}: {results[flag][1]:.2f} ms/token")
    assert torch.equal(results[False][0], results[True][0]), "outputs differ"
    print("identical outputs:", True)


if __name__ == "__main__":
    main()
