"""Where a padded decode step's extra host time goes (session 2 of 2026-11-29, call 2; issue 44's padded goals).

    python3 padded_probe.py [--tokens 33]

1. The flag's generate() on the Llama-1B-shaped bf16 model, DynamicCache, greedy, b1 and b8, padded and not (warm):
   the aten ops one decode step dispatches on the host (profiler counts of an N-token call minus a 1-token call, over
   N-1 steps), and the CPU time of the ops that differ.
2. SDPA at the decode step's shapes as transformers 5.24 calls it with a mask (`pack_gqa`: query (B, 8, 4, 64),
   keys (B, 8, L, 64), the mask (B, 1, 1, L)): the backend torch picks (`torch._fused_sdp_choice`) and the host time
   and ops per call, for the bool mask stock builds, the additive float mask torch makes of it (0 / -inf in the
   query's dtype), and that float mask in a buffer whose rows are 16-aligned; and whether the three give the same
   bits.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import transformers_async_stop as tas
from transformers_async_stop.bench.cases import _from_config, llama_1b_config


def ops_of(thunk):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        thunk()
        torch.cuda.synchronize()
    counts, cpu = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        counts[e.key] += e.count
        cpu[e.key] += e.self_cpu_time_total
    return counts, cpu


def inputs(batch, padded, width=64):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128000, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(batch):
            pad = 5 + (row * 7) % 40
            mask[row, :pad] = 0
            ids[row, :pad] = 0
    return ids.cuda(), mask.cuda()


def generate_part(model, tokens):
    print("== 1. ops per decode step, the flag's generate() (N-token call minus 1-token call)")
    per = {}
    for batch in (1, 8):
        for padded in (False, True):
            ids, mask = inputs(batch, padded)
            kw = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, do_sample=False,
                      async_stopping_criteria=True)
            for _ in range(3):
                model.generate(**kw, max_new_tokens=tokens, min_new_tokens=tokens)
            path = tas.last_path().describe()
            times = []
            for n in (tokens, 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(3):
                    model.generate(**kw, max_new_tokens=n, min_new_tokens=n)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) / 3)
            ms = (times[0] - times[1]) / (tokens - 1) * 1e3
            cn, tn = ops_of(lambda: model.generate(**kw, max_new_tokens=tokens, min_new_tokens=tokens))
            c1, t1 = ops_of(lambda: model.generate(**kw, max_new_tokens=1, min_new_tokens=1))
            steps = tokens - 1
            count = {k: (cn[k] - c1[k]) / steps for k in cn}
            cpu = {k: (tn[k] - t1[k]) / steps for k in tn}
            per[(batch, padded)] = (count, cpu)
            print(f"b{batch} {'padded' if padded else 'unpadded'}: {ms:.3f} ms/step; {sum(count.values()):.1f} ops/step,"
                  f" {sum(cpu.values()) / 1e3:.3f} ms self CPU/step (profiled); {path}")
        (ca, ta), (cb, tb) = per[(batch, False)], per[(batch, True)]
        diff = sorted(set(ca) | set(cb), key=lambda k: -(tb.get(k, 0) - ta.get(k, 0)))
        print(f"  b{batch}: ops that differ, padded minus unpadded, per step (count, self CPU us):")
        for k in diff[:25]:
            dc, dt = cb.get(k, 0) - ca.get(k, 0), tb.get(k, 0) - ta.get(k, 0)
            if abs(dc) >= 0.5 or abs(dt) >= 5:
                print(f"    {k:60s} {dc:+7.1f} {dt:+9.1f}")


def sdpa_part():
    print("\n== 2. SDPA at decode shapes: backend, host time and ops per call, bits")
    F = torch.nn.functional
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    for batch in (1, 8):
        for length in (100, 157, 203):
            gen = torch.Generator(device="cuda").manual_seed(length)
            q = torch.randn(batch, 8, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(batch, 8, length, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(batch, 8, length, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            keep = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="cuda")
            for row in range(batch):
                keep[row, ..., : 5 + (row * 7) % 40] = False
            additive = torch.where(keep.logical_not(), float("-inf"), torch.scalar_tensor(0.0, dtype=torch.bfloat16,
                                                                                          device="cuda"))
            cap = -(-length // 16) * 16 + 16
            buffer = torch.zeros(batch, 1, 1, cap, dtype=torch.bfloat16, device="cuda")
            buffer[..., :length] = additive
            aligned = buffer[..., :length]
            outs, line = {}, []
            for label, m in (("bool", keep), ("float", additive), ("float aligned", aligned)):
                try:
                    choice = names.get(int(torch._fused_sdp_choice(q, k, v, attn_mask=m)), "?")
                except Exception as exc:  # a private function: its signature may differ
                    choice = f"? ({type(exc).__name__})"
                call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(50):
                    call()
                host = (time.perf_counter() - t) / 50 * 1e6
                torch.cuda.synchronize()
                counts, _ = ops_of(call)
                outs[label] = call()
                line.append(f"{label}: {choice}, {host:.1f} us host/call, {sum(counts.values())} ops "
                            f"({', '.join(sorted(k for k in counts if not k.startswith('aten::_sdpa') ))[:160]})")
            same = all(torch.equal(outs["bool"], o) for o in outs.values())
            print(f"b{batch} L{length}: same bits {same}")
            for x in line:
                print("   ", x)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=33)
    args = p.parse_args()
    print("torch", torch.__version__, "transformers", __import__("transformers").__version__,
          torch.cuda.get_device_name())
    sdpa_part()
    model = _from_config(llama_1b_config())(torch.device("cuda"), torch.bfloat16)
    generate_part(model, args.tokens)


if __name__ == "__main__":
    main()
