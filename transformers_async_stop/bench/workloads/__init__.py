"""Workload cases: sequences of calls as users run them, timed as whole passes (issue 44).

The per-step cases time one prompt length, repeated, at one batch size: every KV length is met before the timing.
Users' calls meet new lengths all the time, and on CUDA each length met for the first time costs a cuDNN plan (see
`passes.py`). The workload cases (opt-in, `--cases varied-lengths-llama-1b,padded-batches-llama-1b,
conversation-llama-1b`) play such sequences on a Llama-1B-shaped bf16 model (the tiny Llama on the CPU), greedy,
DynamicCache:
- `varied-lengths-llama-1b`: batch 1, a prompt length that changes every call;
- `padded-batches-llama-1b`: left-padded batches of 4 to 16 prompts of different lengths;
- `conversation-llama-1b`: a multi-turn conversation continuing the returned cache;
- `padded-b1-llama-1b`, `padded-b4-llama-1b`, `padded-b8-llama-1b`: one batch size each (1: the prompt left-padded
  to a multiple of 64).
Modules: `cases.py` (the calls), `passes.py` (exactness, cold and warm passes in fresh threads, floor), `report.py`
(their table).
"""

from __future__ import annotations

from ..cases import Case, _from_config, llama_1b_config, tiny_llama_config
from .cases import CUDA_SHAPES, Workload
from .passes import measure_workload

__all__ = ["measure_workload", "workload_cases"]

NEW_TOKENS = 48  # per call (`--new-tokens` replaces it; --quick: 16)

_CASES = (
    ("varied-lengths-llama-1b", "stream", "a stream of calls whose prompt length changes every call"),
    ("padded-batches-llama-1b", "padded", "left-padded batches of 4 to 16 prompts of different lengths"),
    ("conversation-llama-1b", "chat", "a multi-turn conversation that continues the returned cache"),
    ("padded-b1-llama-1b", "padded-b1", "one prompt per call, left-padded to a multiple of 64"),
    ("padded-b4-llama-1b", "padded-b4", "left-padded batches of 4 prompts of different lengths"),
    ("padded-b8-llama-1b", "padded-b8", "left-padded batches of 8 prompts of different lengths"),
)


def _llama_1b_or_tiny(device, dtype):
    """The Llama-1B-shaped model on CUDA; the tiny Llama on the CPU, so that the CPU tests and --quick run fast."""
    return _from_config(llama_1b_config() if device.type == "cuda" else tiny_llama_config())(device, dtype)


def workload_cases() -> dict[str, Case]:
    found = {}
    for name, kind, what in _CASES:
        shape = CUDA_SHAPES[kind]
        calls = Workload(kind, shape, NEW_TOKENS, 0, 2, "cpu").describe()
        found[name] = Case(name, _llama_1b_or_tiny, (1,), NEW_TOKENS, shape.lengths[0], "bf16",
                           pad_token_id=0, plan=(("eager", kind),), opt_in=True, workload=kind,
                           about=f"workload: {what} ({calls}; cold and warm passes, each variant in a fresh "
                                 "thread), Llama-1B-shaped bf16, greedy, DynamicCache (tiny on CPU)")
    return found
