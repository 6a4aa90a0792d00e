"""ms/token of one package copy's flag call, for a paired comparison of two copies on one GPU (issue 31's "no speed
lost where it is sound": the new main against an earlier one, alternating processes in one device call).

    python3 scripts/paired_speed.py --root .old --label 3961f77   # an earlier copy (git archive <commit> | tar -x -C .old)
    python3 scripts/paired_speed.py --root . --label HEAD

Llama-1B-shaped bf16, batch 1, greedy, a `DynamicCache` (the default), 128 new tokens after a 32-token prompt, the
flag on: one warm-up call (it records the graphed forward), then `--reps` timed calls; prints one JSON line with the
median and every rep's ms/token (whole call / tokens), the path, and a digest of the output ids (the copies must
agree). Run the copies alternately, several rounds: a round's order and the GPU's clocks then weigh on both alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the directory holding the transformers_async_stop copy")
    parser.add_argument("--label", required=True)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", type=int, default=0,
                        help="also print the package's top N functions by cumulative time over 3 profiled calls")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.root))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import transformers_async_stop as tas

    assert os.path.abspath(tas.__file__).startswith(os.path.abspath(args.root)), tas.__file__
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 32000, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, async_stopping_criteria=True)

    def call():
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    out, first = call()
    times = [call()[1] * 1000 / args.new_tokens for _ in range(args.reps)]
    print(json.dumps({"label": args.label, "ms_per_token": round(statistics.median(times), 3),
                      "reps": [round(t, 3) for t in times], "first_call_s": round(first, 3),
                      "path": tas.last_path().describe(), "forward": tas.last_path().forward,
                      "ids": hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()[:12],
                      "device": torch.cuda.get_device_name()}), flush=True)
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3):
            call()
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative")
        package = os.path.dirname(os.path.abspath(tas.__file__))
        rows = [(value[3], key) for key, value in stats.stats.items() if key[0].startswith(package)]
        for cumulative, (path, line, name) in sorted(rows, reverse=True)[: args.profile]:
            print(f"  {cumulative * 1000 / 3:9.2f} ms/call  {os.path.relpath(path, package)}:{line} {name}")


if __name__ == "__main__":
    main()
