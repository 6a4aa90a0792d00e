"""Encoder-decoders on the dynamic-cache loop, on CUDA (session 4 of 2026-11-29): for tiny BART, mBART, Marian,
Pegasus, Blenderbot, BlenderbotSmall, T5 and Whisper (the test file's builders, fp32) and the BART-base- and
Whisper-small-shaped bench models (bf16), flag vs stock: outputs equal, blocking syncs per decode step (torch's sync
debug mode: an N-token call minus a 1-token call), and the path. The text models get an encoder mask of ones (what a
tokenizer returns) and, in a second row, none. Run from the repository root with tests/ on sys.path."""
import sys
import warnings

import torch

sys.path.insert(0, "tests")
import transformers_async_stop as tas  # noqa: E402
from models import count_syncs, stock  # noqa: E402
from test_dynamic_loop_encoder_decoder import build, features  # noqa: E402
from transformers_async_stop.bench.encoder_decoder_cases import build_bart, build_whisper, whisper_inputs  # noqa: E402

warnings.simplefilter("ignore")
dev = torch.device("cuda")


class Run:
    batch = 1


def inputs_of(family, model, mask=True):
    if family == "whisper-small":
        return whisper_inputs(Run, model, dev)
    if family == "whisper":
        return {"input_features": features(1).to(dev)}
    length = 128 if family == "bart-base" else 9
    high = 40 if family != "bart-base" else 50000
    ids = torch.randint(3, high, (1, length), generator=torch.Generator().manual_seed(3)).to(dev)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if mask else {"input_ids": ids}


def run(model, kw, n, flag):
    extra = {"async_stopping_criteria": True} if flag else {}
    return model.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)


ROWS = [(family, True) for family in ("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot_small", "t5")]
ROWS += [("bart", False), ("t5", False), ("whisper", True), ("bart-base", True), ("bart-base", False),
         ("whisper-small", True)]
for family, mask in ROWS:
    if family == "whisper-small":
        model = build_whisper(dev, torch.bfloat16)
    elif family == "bart-base":
        model = build_bart(dev, torch.bfloat16)
    else:
        model = build(family).to(dev)
    kw = inputs_of(family, model, mask)
    n = 24 if family in ("whisper-small", "bart-base") else 16
    with stock():
        ref = run(model, kw, n, False)
        run(model, kw, 1, False)
        s_stock = (count_syncs(lambda: run(model, kw, n, False)) - count_syncs(lambda: run(model, kw, 1, False))) / (n - 1)
    out = run(model, kw, n, True)
    run(model, kw, 1, True)
    s_flag = (count_syncs(lambda: run(model, kw, n, True)) - count_syncs(lambda: run(model, kw, 1, True))) / (n - 1)
    out = run(model, kw, n, True)
    path = tas.last_path()
    print(f"{family} ({'encoder mask of ones' if mask and 'whisper' not in family else 'no encoder mask'}): "
          f"equal={torch.equal(ref, out)} syncs/step stock={s_stock:.2f} flag={s_flag:.2f} | "
          f"{path.describe()} | forward: {path.forward}", flush=True)
