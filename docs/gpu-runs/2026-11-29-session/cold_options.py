"""Cold attention lengths on CUDA: the options of issue 44, measured once (a decision's record, kept with its output).

    python3 docs/gpu-runs/2026-11-29-session/cold_options.py [--calls 8] [--tokens 32]

A Llama-1B-shaped bf16 model (random weights from its config), batch 1, a `DynamicCache`, greedy. Each variant runs
in its own process, so it meets its own cold lengths (cuDNN keeps an SDPA execution plan per exact sequence length,
per thread): `--calls` generate() calls at prompt lengths spaced further apart than `--tokens`, so every decode step
of the first pass runs at a key/value length the process has not met; then the same calls again (warm). Variants:

- `default`: torch as configured (cuDNN SDPA on);
- `avoid`: `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (PyTorch's opt-in: cuDNN's ragged path, no per-length plan);
- `nocudnn`: `torch.backends.cuda.enable_cudnn_sdp(False)` (another SDPA backend);
each with the flag on and off. Printed: ms/token cold and warm per variant, the cold share, whether the flag's tokens
and logits equal flag-off's in the same settings (bit for bit, by digest), and whether a decode-shaped SDPA call gives
the same bits under each setting as under `default`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

VARIANTS = {"default": {}, "avoid": {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}, "nocudnn": {"TAS_NO_CUDNN_SDP": "1"}}


def child(flag: bool, calls: int, tokens: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.environ.get("TAS_NO_CUDNN_SDP"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if flag:
        import transformers_async_stop as tas  # noqa: F401
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    # a decode-shaped SDPA call at several lengths: its bits under this process's settings
    sdpa = hashlib.sha256()
    generator = torch.Generator(device="cuda").manual_seed(1)
    for length in range(20, 400, 37):
        q = torch.randn(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        k = torch.randn(1, 32, length, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        v = torch.randn(1, 32, length, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        sdpa.update(torch.nn.functional.scaled_dot_product_attention(q, k, v).float().cpu().numpy().tobytes())
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    model.generate(torch.ones(1, 4, dtype=torch.long, device="cuda"), max_new_tokens=2, pad_token_id=0)  # warm-up
    lengths = [17 + i * (tokens + 9) for i in range(calls)]
    result = {"sdpa": sdpa.hexdigest()[:16], "passes": [], "digests": []}
    # cold, warm, and (flag on only) warm with the flag off in the same process: the flag's outputs against
    # flag-off's in the same process and settings
    for flag_now in (flag, flag, False) if flag else (False, False):
        times, digest = [], hashlib.sha256()
        kwargs["async_stopping_criteria"] = True if flag_now else None
        if not flag_now:
            kwargs.pop("async_stopping_criteria")
        for length in lengths:
            ids = (torch.arange(length, device="cuda") * 7919 % 120000 + 5)[None]
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            digest.update(out.sequences.cpu().numpy().tobytes())
            for row in out.logits:
                digest.update(row.float().cpu().numpy().tobytes())
        result["passes"].append(times)
        result["digests"].append(digest.hexdigest()[:16])
    result["digest"] = result["digests"][1]
    if flag:
        import transformers_async_stop as tas

        result["path"] = tas.last_path().describe()
        result["attention_lengths"] = tas.last_path().attention_lengths
    return result


def repeat(tokens: int) -> None:
    """Is stock bit-repeatable in one process at warm lengths, and does the flag equal it (cuDNN SDPA as set)?"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import transformers_async_stop as tas

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = (torch.arange(40, device="cuda") * 7919 % 120000 + 5)[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    runs = []
    for name in ("stock", "flag", "stock", "flag", "stock", "flag"):
        out = model.generate(ids, **kwargs, **({"async_stopping_criteria": True} if name == "flag" else {}))
        runs.append((name, out.sequences.cpu(), torch.stack(out.logits).float().cpu()))
    first = runs[0]
    for index, (name, sequences, logits) in enumerate(runs):
        same = torch.equal(sequences, first[1]) and torch.equal(logits, first[2])
        step = next((i for i in range(logits.shape[0]) if not torch.equal(logits[i], first[2][i])), None)
        print(f"run {index} {name:5s}: {'equal to stock run 0' if same else f'differs from step {step}'}")
    print("path:", tas.last_path().describe())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--child", choices=("on", "off"))
    parser.add_argument("--variants", default="default,avoid,nocudnn")
    parser.add_argument("--repeat", action="store_true",
                        help="one process, warm lengths: stock three times and the flag twice, in turn; which equal "
                             "stock's first (sequences and logits)")
    args = parser.parse_args()
    if args.repeat:
        repeat(args.tokens)
        return
    if args.child:
        print(json.dumps(child(args.child == "on", args.calls, args.tokens)))
        return
    rows = {}
    for name, env in ((name, VARIANTS[name]) for name in args.variants.split(",")):
        # the default setting's flag-off process twice: is stock itself repeatable across processes?
        for flag in ("on", "off", "off again") if name == "default" else ("on", "off"):
            command = [sys.executable, __file__, "--child", flag.split()[0], "--calls", str(args.calls),
                       "--tokens", str(args.tokens)]
            done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name} flag {flag}: failed\n{done.stderr[-2000:]}")
                continue
            rows[(name, flag)] = json.loads(done.stdout.strip().splitlines()[-1])
    per_token = args.calls * args.tokens
    print(f"{args.calls} calls of {args.tokens} tokens, prompt lengths spaced apart; ms/token over the calls")
    print("= off: its outputs' digest equals the flag-off process's; in-process: the flag's equal flag-off's run in "
          "the same process after it; sdpa: a decode-shaped SDPA call's bits equal the default setting's")
    print(f"{'variant':9s} {'flag':9s} {'cold':>7s} {'warm':>7s} {'cold share':>10s}  {'= off':6s} {'in-process':10s} "
          f"{'sdpa':5s} path")
    for (name, flag), row in rows.items():
        cold, warm = (1000 * sum(times) / per_token for times in row["passes"][:2])
        same = rows.get((name, "off"), {}).get("digest") == row["digest"]
        inside = str(row["digests"][1] == row["digests"][2]) if len(row["digests"]) > 2 else "-"
        bits = row["sdpa"] == rows.get(("default", flag), {}).get("sdpa")
        print(f"{name:9s} {flag:9s} {cold:7.2f} {warm:7.2f} {100 * (cold - warm) / cold:9.0f}%  {str(same):6s} "
              f"{inside:10s} {str(bits):5s} {row.get('path', '')} {row.get('attention_lengths') or ''}")
    for name in VARIANTS:
        on, off = rows.get((name, "on")), rows.get((name, "off"))
        if on and off:
            print(f"{name}: flag-off / flag, cold {sum(off['passes'][0]) / sum(on['passes'][0]):.2f}x, warm "
                  f"{sum(off['passes'][1]) / sum(on['passes'][1]):.2f}x")


if __name__ == "__main__":
    main()
