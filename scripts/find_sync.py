"""Print where each blocking sync of a generate() call happens (Python stack), to hunt a sync a test counted.

    python3 scripts/find_sync.py [--layout embed_on_0|embed_on_1] [--stock] [--new-tokens N]

Runs the tiny Llama of the tests (split over two GPUs with --layout, else on cuda:0), left-padded batch of 2,
under `torch.cuda.set_sync_debug_mode("warn")`, and prints each distinct stack that warned, with its count.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default=None)
    parser.add_argument("--stock", action="store_true", help="patches removed")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()

    from models import PAD, build, prompt, stock

    if args.layout:
        from test_device_map import split

        model, device = split(args.layout)
    else:
        model, device = build("llama", device="cuda"), torch.device("cuda", 0)
    ids, mask = prompt(batch=2, left_pad=True, device=device)
    kw = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=PAD)
    if not args.stock:
        kw["async_stopping_criteria"] = True
    import contextlib

    ctx = stock() if args.stock else contextlib.nullcontext()
    stacks: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            stacks["".join(traceback.format_list(frames[-10:]))] += 1

    with ctx:
        model.generate(ids, **kw)  # warm-up
        torch.cuda.synchronize()
        old = warnings.showwarning
        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model.generate(ids, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"=== layout={args.layout} stock={args.stock} new_tokens={args.new_tokens}: "
          f"{sum(stacks.values())} syncs, {len(stacks)} places")
    for stack, count in stacks.most_common():
        print(f"--- {count} times:\n{stack}")


if __name__ == "__main__":
    main()
