"""The decode loop of a static cache, owned by the package: forward inputs kept in place, the rest of the step
replayed from one CUDA graph (flag on, transformers 5.17+).

With a static cache transformers already runs the model's forward from CUDA graphs, but everything around it is
eager Python: `prepare_inputs_for_generation` (slices, clones, the 4D mask), `_update_model_kwargs_for_generation`
(two `torch.cat`s), the logits copy, every logits processor, the token selection, the stopping criteria, one more
`torch.cat`. On a small model that is nearly all of a step's time (docs/benchmarks.md). Here, for one `_sample`
call:

- **inputs** (`inputs.py`): the first decode step's inputs come from the real `prepare_inputs_for_generation`; after
  that the same tensors are advanced on the device (next token, position + 1, the mask from the cache's counter),
  which is what stock's per-step rebuild computes;
- **tail** (`tail.py`): processors, token selection, the EOS criterion, the sequence write and the input advance
  run as one body: eagerly, or, on CUDA when every processor is graph-safe, captured once per phase into a CUDA
  graph and replayed;
- **loop** (`loop.py`): the stock `_sample` of 5.17-5.23 around them, with the one-step-late verdict of `AsyncStop`.

Where the conditions are not met (`eligibility.py`) the deferred path of `generation.py` runs, as before.
`TRANSFORMERS_ASYNC_STOP_STATIC_LOOP=0` turns this loop off; `TRANSFORMERS_ASYNC_STOP_CAPTURE=0` keeps it but runs
the tail eagerly.
"""

from .eligibility import graph_safe, plan_loop
from .loop import run

__all__ = ["graph_safe", "plan_loop", "run"]
