"""Two usage scenarios at once in two threads (usage_scenarios.py's `threads`), flag on, each compared with its own
sequential stock run (usage_runner.py runs each), at times with a third thread hammering the default stream."""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

from models import stock
from usage_runner import _fresh, _raised, _rooms, diff, model_of, run_scenario


@contextlib.contextmanager
def _hammering(device, on):
    """While the block runs (if `on`): a thread allocating and writing small long tensors on the default stream, the
    interpreter switching threads as often as it can (memory freed too early is taken at once)."""
    if not on:
        yield
        return
    stop = threading.Event()

    def hammer():
        size = 1
        while not stop.is_set():
            torch.empty(size, dtype=torch.long, device=device).fill_(0)
            size = size % 8 + 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)


def check_threads(sc, device="cpu"):
    """Two scenarios at once in two threads, flag on, each equal to its own sequential stock run."""
    a = {k: v for k, v in sc.items() if k != "threads"}
    b = sc["threads"]["other"]
    seed_b = 1 if sc["threads"]["mode"] == "two_models" else 0
    rooms = (_rooms(a, device), _rooms(b, device, seed_b))
    with stock():
        refs = [run_scenario(a, False, device, rooms[0], rng_draws=False),
                run_scenario(b, False, device, rooms[1], rng_draws=False, model_seed=seed_b)]
    ons, errors = [None, None], [None, None]
    for s, model_seed in ((a, 0), (b, seed_b)):
        _fresh(model_of(s["family"], s["attn"], model_seed, device, s.get("dtype", "float32")))
    shared = None
    if sc["threads"]["mode"] == "one_model" and "model_config" in (a.get("flag_via"), b.get("flag_via")):
        # the flag set on the shared model's config once, before both threads: set and deleted per call, it would
        # change the config's __dict__ while the other thread's generate() copies it ("dictionary changed size
        # during iteration", a race of this harness that the stock run, which sets nothing, never has)
        shared = model_of(a["family"], a["attn"], 0, device, a.get("dtype", "float32")).generation_config
        before = shared.__dict__.get("async_stopping_criteria", shared)
        shared.async_stopping_criteria = True
        a, b = ({**s, "flag_via": "preset"} if s.get("flag_via") == "model_config" else s for s in (a, b))
    barrier = threading.Barrier(2)

    def job(i, s, model_seed):
        try:
            barrier.wait()
            ons[i] = run_scenario(s, True, device, rooms[i], rng_draws=False, model_seed=model_seed, reset=False)
        except Exception as exc:  # noqa: BLE001
            errors[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=job, args=(0, a, 0)), threading.Thread(target=job, args=(1, b, seed_b))]
    try:
        with _hammering(device, sc["threads"].get("hammer", False)):
            for th in threads:
                th.start()
            for th in threads:
                th.join()
    finally:
        if shared is not None and before is shared:
            del shared.async_stopping_criteria
        elif shared is not None:
            shared.async_stopping_criteria = before
    import usage_runner

    usage_runner.LAST_FORWARD[:] = [path for on in ons if on is not None for path in on.forward]
    for i in (0, 1):
        if errors[i]:
            return "fail", f"thread {i} raised outside generate(): {errors[i]}"
        d = diff(refs[i].trace, ons[i].trace, f"thread{i}.turns")
        if d:
            return "fail", d + _raised(ons[i])
    if refs[0].stock_err or refs[1].stock_err:
        return "stock_err", str(refs[0].stock_err or refs[1].stock_err)[:200]
    return "pass", ""
