"""Where the host time of one decode step goes, flag off vs on (vs upstream's DeferredStopCheck forced on CUDA).

For host-bound cases (GPU busy < 50%), any extra Python per step shows up in ms/token. Run on a CUDA machine:
    python3 scripts/host_profile.py [gpt2|tiny-llama] [new_tokens]
Prints ms/token per variant and the functions whose own time differs most between variants.
"""

import cProfile
import pstats
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import transformers_async_stop as tas
from transformers_async_stop import bench


def build(name):
    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config()).cuda().eval(), 50256
    config = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    return LlamaForCausalLM(config).cuda().eval(), 0


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    model, pad = build(name)
    ids = torch.randint(3, 200, (1, 16), device="cuda")
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
              pad_token_id=pad, cache_implementation="static")
    variants = ["stock", "async"] + (["upstream"] if bench.upstream_available() else [])
    stats = {}
    for name_v in variants:
        with bench.variant(name_v) as flag:
            for _ in range(3):
                model.generate(**kw, **flag)
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                model.generate(**kw, **flag)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            profile = cProfile.Profile()
            profile.enable()
            model.generate(**kw, **flag)
            torch.cuda.synchronize()
            profile.disable()
        stats[name_v] = pstats.Stats(profile)
        print(f"{name_v:9s} {sorted(times)[2] / n * 1e3:.3f} ms/token (median of 5, incl. prefill)")
    own = {v: {f"{k[0].rsplit('/', 2)[-1]}:{k[2]}": (s.stats[k][1], s.stats[k][2]) for k in s.stats}
           for v, s in stats.items()}
    keys = set().union(*own.values())
    rows = sorted(keys, key=lambda k: -abs(own["async"].get(k, (0, 0))[1] - own["stock"].get(k, (0, 0))[1]))
    print(f"{'function':60s} " + " ".join(f"{v + ' us/step':>18s}" for v in variants))
    for key in rows[:30]:
        print(f"{key[:60]:60s} " + " ".join(f"{own[v].get(key, (0, 0))[1] / n * 1e6:18.1f}" for v in variants))
    tas.apply()


if __name__ == "__main__":
    main()
