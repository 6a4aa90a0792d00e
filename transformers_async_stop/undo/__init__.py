"""The undo of the one extra decode step, and what must never need one.

- `cache_rollback.py`: the extra step taken back out of a cache the caller will see (static caches included);
- `module_state.py`: modules whose forward changes state they keep on themselves (such a call runs stock's loop);
- `position_table.py`: the positions a model's forward can reach (the tables it reads by position, found per model
  by `position_reads.py` from what its first forward reads), which no forward may pass.
"""
