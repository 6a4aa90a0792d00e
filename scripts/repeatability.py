"""Is stock generate() itself bit-repeatable for a case? A control for the benchmark's `exact` column.

    python3 scripts/repeatability.py [batch] [new_tokens] [--deterministic]
Builds the Llama-1B-shaped bf16 model, runs stock (flag off) three times, the flag twice and upstream's deferred
check once, and prints which outputs equal the first stock output, with the first differing step.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from transformers_async_stop import bench


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    batch = int(args[0]) if args else 32
    n = int(args[1]) if len(args) > 1 else 64
    if "--deterministic" in sys.argv:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128000, (batch, 32), generator=gen).cuda()
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
              pad_token_id=0, do_sample=False)
    order = ["stock", "stock", "async", "stock", "async"] + (["upstream"] if bench.upstream_available() else [])
    outs = []
    for name in order:
        with bench.variant(name) as flag:
            outs.append((name, model.generate(**kw, **flag).cpu()))
    ref = outs[0][1]
    for i, (name, out) in enumerate(outs):
        diff = (out != ref).any(0).nonzero()
        first = int(diff[0]) - 32 if len(diff) else None
        print(f"run {i} {name:9s} equal_to_first_stock={torch.equal(out, ref)} first_differing_step={first} "
              f"rows_differing={int((out != ref).any(1).sum())}")


if __name__ == "__main__":
    main()
