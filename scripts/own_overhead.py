"""The package's own host time per decode step, with the flag on, on a CUDA device.

    python3 scripts/own_overhead.py [--steps 20000] [--batch 1]

A decode step of the deferred loop calls, besides stock code: the processors wrapper (which reads the previous
verdict), the criteria wrapper (which moves to the side stream), the stop check (which copies the verdict and
tokens to pinned memory, records an event, returns to the main stream and snapshots the RNG), and the always-on
wrappers around `_update_model_kwargs_for_generation` and the padding warning. This script runs exactly those calls
in a loop on real CUDA tensors, next to a loop of the stock calls they wrap (an empty `LogitsProcessorList`, a
`StoppingCriteriaList` with one criterion, the `&` update), and prints the difference per step: the host time
the package adds. Stock's own stop check (a blocking read) is not subtracted: the package's verdict copy, events
and stream switches all count as its own.

It also prints the host cost of each stream/event operation (explicit streams, as the controller uses them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import transformers.generation.utils as gen_utils
from transformers.generation.utils import GenerationMixin

import transformers_async_stop  # noqa: F401  (applies the patches)
from transformers_async_stop.state.call_state import CALL, CallState
from transformers_async_stop.control.controller import AsyncStop
from transformers_async_stop.control.step_lists import JoiningLogitsProcessors, SideStreamCriteria


class Done(StoppingCriteria):
    """A criterion whose own work is one small kernel, the same in both loops."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 2


def per_step_us(fn, steps: int, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(steps)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(runs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    dev = torch.device("cuda")
    batch, vocab, length = args.batch, 32000, 64
    input_ids = torch.randint(3, 100, (batch, length), device=dev)
    scores = torch.randn(batch, vocab, device=dev)
    tokens = input_ids[:, -1].clone()
    unfinished0 = torch.ones(batch, dtype=torch.long, device=dev)

    def stock_loop(steps):
        processors, criteria = LogitsProcessorList([]), StoppingCriteriaList([Done()])
        unfinished = unfinished0
        loop_undoes_steps = hasattr(gen_utils, "DeferredStopCheck")
        for _ in range(steps):
            processors(input_ids, scores)
            unfinished = unfinished & ~criteria(input_ids, (scores,))
            if not loop_undoes_steps:
                unfinished.max() == 0  # 4.57-5.16 compute this in the loop itself, stock or not

    def package_loop(steps):
        state = CallState(None, user_cache=False, slice_inputs=True)
        token = CALL.set(state)
        try:
            loop_undoes_steps = hasattr(gen_utils, "DeferredStopCheck")
            ctl = state.ctl = AsyncStop(input_ids, None, done_when="unfinished" if loop_undoes_steps else "finished",
                                        loop_undoes_steps=loop_undoes_steps)
            processors = JoiningLogitsProcessors(LogitsProcessorList([]), ctl)
            criteria = SideStreamCriteria(StoppingCriteriaList([Done()]), ctl)
            unfinished = unfinished0
            if loop_undoes_steps:  # 5.17+: the loop calls its stop check, our DeferredStopCheck subclass
                check = gen_utils.DeferredStopCheck(input_ids, None, None, False, None)
                for step in range(steps):
                    processors(input_ids, scores)
                    unfinished = unfinished & ~criteria(input_ids, (scores,))
                    check(unfinished, tokens, length + step)
            else:  # 4.57-5.16: the loop hands `max() == 0` to `_has_unfinished_sequences`
                has_unfinished = GenerationMixin._has_unfinished_sequences
                for step in range(steps):
                    processors(input_ids, scores)
                    unfinished = unfinished & ~criteria(input_ids, (scores,))
                    has_unfinished(None, unfinished.max() == 0, False, dev)
            ctl.finish()
        finally:
            CALL.reset(token)

    for loop in (stock_loop, package_loop):
        loop(200)  # warm-up
    stock_us = per_step_us(stock_loop, args.steps)
    package_us = per_step_us(package_loop, args.steps)
    print(f"stock calls per step:            {stock_us:7.2f} us")
    print(f"package's path per step:         {package_us:7.2f} us")
    print(f"OWN host time per decode step:   {package_us - stock_us:7.2f} us  (batch {batch})")

    main_stream, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    flag = torch.zeros(batch, dtype=torch.long, pin_memory=True)
    gen = torch.cuda.default_generators[0]
    ops = {
        "set_stream x2 (to side and back)": lambda n: [(torch.cuda.set_stream(side), torch.cuda.set_stream(
            main_stream)) for _ in range(n)],
        "Event.record(stream)": lambda n: [ev.record(main_stream) for _ in range(n)],
        "Stream.wait_event": lambda n: [side.wait_event(ev) for _ in range(n)],
        "Tensor.record_stream": lambda n: [tokens.record_stream(side) for _ in range(n)],
        "verdict copy_ to pinned, non_blocking": lambda n: [flag.copy_(unfinished0, non_blocking=True)
                                                            for _ in range(n)],
        "Event.synchronize (completed)": lambda n: [ev.synchronize() for _ in range(n)],
        "numpy view .any()": lambda n: [flag.numpy().any() for _ in range(n)],
        "generator.get_state (RNG snapshot)": lambda n: [gen.get_state() for _ in range(n)],
        "stock: bool(unfinished.max() == 0) (a sync)": lambda n: [bool(unfinished0.max() == 0) for _ in range(n)],
    }
    for name, fn in ops.items():
        print(f"{per_step_us(fn, 2000, 3):8.2f} us  {name}")
    always_on_wrappers(dev, args.steps // 10)


def always_on_wrappers(dev, steps):
    """What the always-on wrapper of `_update_model_kwargs_for_generation` adds per step (inside generate(), with a
    left-padded mask, the case that tags masks), patched vs the original on the same inputs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1)).to(dev).eval()
    ids = torch.randint(3, 200, (2, 8), device=dev)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        outputs = model(input_ids=ids, attention_mask=mask, use_cache=True)
    patched = GenerationMixin._update_model_kwargs_for_generation
    original = patched.__wrapped__
    token = CALL.set(CallState(model, user_cache=False, slice_inputs=True))
    try:
        for name, fn in (("original", original), ("patched", patched)):
            def loop(n, fn=fn):
                kwargs = {"attention_mask": mask, "use_cache": True}
                for _ in range(n):
                    kwargs = fn(model, outputs, kwargs)  # the mask grows by a column, as in generate()
            loop(100)
            print(f"{per_step_us(loop, steps, 3):8.2f} us  _update_model_kwargs_for_generation, {name}")
    finally:
        CALL.reset(token)


if __name__ == "__main__":
    main()
