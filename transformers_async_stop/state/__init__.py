"""Per-call state: what one `generate()` call carries (`call_state.py`) and which threads are inside one now
(`concurrency.py`, with the lock a CUDA graph capture holds)."""
