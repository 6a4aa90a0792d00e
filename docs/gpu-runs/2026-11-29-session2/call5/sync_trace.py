"""Where the one blocking sync per call of a padded Llama bf16 batch comes from (call 3's failing no-sync test):
each sync of the counted calls (sync debug mode "warn") with its stack."""
import sys
import traceback

import torch

sys.path.insert(0, "tests")
import transformers_async_stop as tas  # noqa: F401
from models import PAD, prompt
from test_piecewise import build_any

model = build_any("llama", device="cuda", dtype=torch.bfloat16)
ids, mask = prompt(batch=3, left_pad=True, device="cuda")


def call(n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=PAD,
                          eos_token_id=None, async_stopping_criteria=True)


for n in (12, 12, 24, 1):
    call(n)
import warnings

for n in (24, 1):
    stacks = []

    def show(message, *args, **kwargs):
        stacks.append("".join(traceback.format_stack(limit=14)[:-1]))

    torch.cuda.synchronize()
    old = warnings.showwarning
    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(n)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    print(f"=== {n}-token call: {len(stacks)} syncs")
    for stack in stacks:
        print(stack)
        print("---")
