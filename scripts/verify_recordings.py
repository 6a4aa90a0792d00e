"""The piecewise recordings assisted decoding leaves behind: their count and the device's peak memory after many calls
of varied lengths and draft lengths (issue 32: "memory stays bounded").

Runs N assisted calls with the flag on a Llama-shaped target and the bench's shared-layer draft
(`bench/assisted.make_draft`), drawing per call the new-token count, the schedule ("constant" / "heuristic") and the
draft length; every `--check`-th call is compared with the flag-off run (sequences equal). Prints, after each tenth
of the calls, the target's and the draft's recordings (one-token and K-token keys, against `forward.MAX_KEYS` and
`MAX_WIDE`) and, on CUDA, `torch.cuda.max_memory_allocated` / `memory_reserved`.

    python scripts/verify_recordings.py                  # CUDA, Llama-1B-shaped bf16, 100 calls
    python scripts/verify_recordings.py --tiny --emulate # the CPU with the graphs emulated (counts only)
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--check", type=int, default=10, help="compare every Nth call with the flag-off run")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 64-wide Llama instead of Llama-1B-shaped")
    parser.add_argument("--emulate", action="store_true", help="CPU: the graphs emulated (testing/emulation.py)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_PIECEWISE", "1")
    import transformers_async_stop as tas
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers_async_stop.bench import assisted
    from transformers_async_stop.bench.cases import llama_1b_config
    from transformers_async_stop.graphs.piecewise import forward

    device = torch.device("cpu" if args.emulate or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.emulate:
        from transformers_async_stop.testing.emulation import emulated

        emulation = emulated()  # held: a context left unreferenced would be closed when collected
        emulation.__enter__()
        os.environ.setdefault("TRANSFORMERS_ASYNC_STOP_FORCE", "1")
    config = (LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
              if args.tiny else llama_1b_config())
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for layer in target.model.layers[assisted.DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(assisted.DEEP_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(assisted.DEEP_LAYER_SCALE)
    draft = assisted.make_draft(target, "shared")
    draft.generation_config.assistant_confidence_threshold = 0.0
    rng = random.Random(args.seed)
    ids = torch.randint(3, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(args.seed)).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mismatches = 0
    for call in range(1, args.calls + 1):
        schedule = rng.choice(("constant", "heuristic"))
        draft.generation_config.num_assistant_tokens_schedule = schedule
        draft.generation_config.num_assistant_tokens = rng.randint(1, 10)
        kwargs = dict(assistant_model=draft, max_new_tokens=rng.randint(8, 96), do_sample=rng.random() < 0.5,
                      pad_token_id=0, eos_token_id=None)
        torch.manual_seed(call)
        before = draft.generation_config.num_assistant_tokens
        out = target.generate(ids, async_stopping_criteria=True, **kwargs)
        if args.check and call % args.check == 0:
            draft.generation_config.num_assistant_tokens = before  # "heuristic" wrote its final length back
            torch.manual_seed(call)
            ref = target.generate(ids, **kwargs)
            mismatches += not torch.equal(ref, out)
        if call % max(1, args.calls // 10) == 0 or call == args.calls:
            line = [f"call {call:4d}", tas.last_path().describe()[:90]]
            for name, model in (("target", target), ("draft", draft)):
                keys = list(forward.graphs_of(model).recordings)
                wide = sum(key[1] > 1 for key in keys)
                line.append(f"{name}: {len(keys) - wide} one-token + {wide} wide")
            if device.type == "cuda":
                line.append(f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, reserved "
                            f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB")
            print(" | ".join(line), flush=True)
    print(f"caps: {forward.MAX_KEYS} one-token + {forward.MAX_WIDE} wide per model; "
          f"{mismatches} of {args.calls // args.check if args.check else 0} checked calls differ from the flag-off run")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
