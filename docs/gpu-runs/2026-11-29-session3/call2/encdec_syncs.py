"""Encoder-decoders on the dynamic-cache loop, on CUDA: for tiny BART, T5 and Whisper (the test file's builders, fp32)
and the Whisper-small-shaped bench model (bf16), flag vs stock: outputs equal, blocking syncs per decode step
(torch's sync debug mode: an N-token call minus a 1-token call), and the path. Run from the repository root with
tests/ on sys.path."""
import sys
import warnings

import torch

sys.path.insert(0, "tests")
import transformers_async_stop as tas  # noqa: E402
from models import count_syncs, stock  # noqa: E402
from test_dynamic_loop_encoder_decoder import build, features  # noqa: E402
from transformers_async_stop.bench.encoder_decoder_cases import build_whisper, whisper_inputs  # noqa: E402

warnings.simplefilter("ignore")
dev = torch.device("cuda")


def inputs_of(family, model):
    if family.startswith("whisper"):
        if family == "whisper-small":
            class Run:
                batch = 1
            return whisper_inputs(Run, model, dev)
        return {"input_features": features(1).to(dev)}
    ids = torch.randint(3, 40, (1, 9), generator=torch.Generator().manual_seed(3)).to(dev)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def run(model, kw, n, flag):
    extra = {"async_stopping_criteria": True} if flag else {}
    return model.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)


for family in ("bart", "t5", "whisper", "whisper-small"):
    model = (build_whisper(dev, torch.bfloat16) if family == "whisper-small" else build(family).to(dev))
    kw = inputs_of(family, model)
    n = 24 if family == "whisper-small" else 16
    with stock():
        ref = run(model, kw, n, False)
        run(model, kw, 1, False)
        s_stock = (count_syncs(lambda: run(model, kw, n, False)) - count_syncs(lambda: run(model, kw, 1, False))) / (n - 1)
    out = run(model, kw, n, True)
    run(model, kw, 1, True)
    s_flag = (count_syncs(lambda: run(model, kw, n, True)) - count_syncs(lambda: run(model, kw, 1, True))) / (n - 1)
    out = run(model, kw, n, True)
    path = tas.last_path()
    print(f"{family}: equal={torch.equal(ref, out)} syncs/step stock={s_stock:.2f} flag={s_flag:.2f} | "
          f"{path.describe()} | forward: {path.forward}", flush=True)
