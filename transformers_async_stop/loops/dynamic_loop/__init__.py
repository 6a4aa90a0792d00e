"""The decode loop of a dynamic cache (the default), owned by the package: per step only what varies per step
(flag on, transformers 5.17+).

With a `DynamicCache` the model's forward is eager and small models spend a large share of each step in
`generate()`'s own Python: `prepare_inputs_for_generation` (slices, clones, a dict, a device check, a remote-code
check), `_update_model_kwargs_for_generation` (two `torch.cat`s and an `arange`), `_has_unfinished_sequences`, the
processor and criteria list wrappers, the stop-check object, and the `generation_config` reads. Here, for one
`_sample` call:

- **inputs** (`inputs.py`): the first decode step's inputs come from the real `prepare_inputs_for_generation`; after
  that each step's are made from the previous step's: the new token, the position plus one, the 2D mask plus a
  column of ones (the model builds its 4D mask from it inside its forward, as in stock);
- **loop** (`loop.py`): the stock `_sample` of 5.17-5.23 around them, with the processor plan and criteria fold of
  the deferred path and the one-step-late verdict of `AsyncStop`, used as the static-cache loop uses it;
- **eligibility** (`eligibility.py`): which calls take it; encoder-decoders (BART, mBART, Marian, Pegasus,
  Blenderbot, BlenderbotSmall, T5, Whisper) in `encoder_decoder.py`: their decoder's inputs advanced under stock's names for them, the extra step
  undone in the self-attention cache;
- **prefill** (`prefill.py`): an assistant's two-token prefill on a filled cache (each assisted round after the
  first) through the same forward as the decode steps; every other prefill is stock's `_prefill`.

Where the conditions are not met the deferred path of `generation.py` runs, as before.
`TRANSFORMERS_ASYNC_STOP_DYNAMIC_LOOP=0` turns this loop off.
"""

from .eligibility import DYNAMIC_LOOP_ENV, plan_loop
from .loop import run

__all__ = ["DYNAMIC_LOOP_ENV", "plan_loop", "run"]
