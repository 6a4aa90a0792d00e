"""Host cost (µs per call) of each stream/event operation the deferred loop makes per decode step.

Run on a CUDA machine: python3 scripts/stream_overhead.py. Explains the per-step host overhead of the flag in
host-bound cases (the GPU idle most of the step), where every microsecond of Python shows up in ms/token.
"""

import time

import torch


def per_call_us(fn, n=20000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    dev = torch.device("cuda")
    main_stream, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    ev, ev2 = torch.cuda.Event(), torch.cuda.Event()
    flag = torch.zeros((), dtype=torch.bool, pin_memory=True)
    t = torch.ones(4, dtype=torch.long, device=dev)
    unfinished = torch.ones(8, dtype=torch.long, device=dev)
    gen = torch.cuda.default_generators[0]

    def set_both():
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main_stream)

    ops = {
        "set_stream x2 (to side and back)": set_both,
        "Stream.wait_stream (allocates an event)": lambda: side.wait_stream(main_stream),
        "Event.record + Stream.wait_event": lambda: (ev.record(main_stream), side.wait_event(ev)),
        "Tensor.record_stream": lambda: t.record_stream(side),
        "(unfinished.max() == 0) + copy_ to pinned, non_blocking": lambda: flag.copy_(unfinished.max() == 0,
                                                                                       non_blocking=True),
        "Event.record": lambda: ev2.record(),
        "Event.synchronize (completed)": ev2.synchronize,
        "bool(pinned flag)": lambda: bool(flag),
        "generator.get_state (RNG snapshot)": gen.get_state,
        "stock: bool(unfinished.max() == 0) (a sync)": lambda: bool(unfinished.max() == 0),
    }
    for name, fn in ops.items():
        print(f"{per_call_us(fn):8.2f} us  {name}")


if __name__ == "__main__":
    main()
