"""How a replay of a decode step gets its attention masks, decided from the step's own mask, cache and config: the
mask kind is part of the recording key (`forward.PiecewiseForward._step`).

- `True` / `False` (SDPA, one token, full-attention layers, no padded 2D mask): the attention gets the mask
  `steps.attention_mask` works out on the host, handed to the replay as it is (True: none, SDPA's own causal path;
  False: the loop's grown 4D mask, `dynamic_loop/wide_mask.py`);
- `("sliding", layout)` (SDPA, one token, sliding-window layers or a window in the config, no padding): each recorded
  mask call is answered on the host (`masks.host_mask`), per layer kind, for the cache's layout it was recorded with;
- `("remade", impl)`: each replay calls the modeling module's mask functions again with the step's own 2D mask, cache
  and positions (`masks.mask_call`), as stock's forward does inside every step: under an implementation other than
  SDPA (eager attention's materialised mask, flex attention's block mask), and under SDPA for a padded batch,
  sliding-window layers or not (stock's `sdpa_mask` then builds the 4D mask, and skips it where nothing is masked:
  the same function decides the same at each replay). The attention function is looked up again at each replay under
  the implementation the key holds;
- K > 1 tokens without sliding layers: `None`, the step's own mask, from which each replay makes stock's
  (`steps.wide_mask`).
"""

from __future__ import annotations

from . import steps

try:
    from transformers.cache_utils import DynamicSlidingWindowLayer as _SLIDING
except ImportError:  # a release without it: no cache holds one
    _SLIDING = None


def of_step(mask, batch: int, cache, config, impl, width: int, remakes_padded: bool):
    """(the mask the recording or replay takes, the mask kind for the key, None), or (None, None, why the step runs
    eagerly). `mask`: the step's `attention_mask` input; `batch`: its ids' batch size. `remakes_padded`: a padded 2D
    mask over full-attention layers is remade (off where the loop grows a 4D mask from the first decode step on: a
    step handed the 2D mask again there stays eager, and no batch size takes two recordings)."""
    layout = tuple(map(type, cache.layers))
    if width != 1 and _SLIDING in layout:
        return None, None, "sliding-window layers in a forward of more than one token"
    remade = impl != "sdpa"
    # sliding-window layers, or a window in the config (its forward may build a sliding mask, over any cache: red
    # team hole F)
    sliding = not remade and width == 1 and (
        _SLIDING in layout or getattr(config, "sliding_window", None) is not None)
    if sliding:
        why = steps.sliding_step(mask, cache, config, _SLIDING in layout)
        if why == steps.SLIDING_PADDED or (why == steps.PADDED_2D and remakes_padded):
            remade = True  # a padded batch: stock builds each kind's 4D mask in the forward
        elif why is not None:
            return None, None, why
        else:
            return mask, ("sliding", layout), None
    if not remade and width == 1:
        made, why = steps.attention_mask(mask, batch, cache)
        if why == steps.PADDED_2D and remakes_padded:
            remade = True  # stock builds the 4D mask inside the forward (`sdpa_mask`, padding included)
        elif why is not None:
            return None, None, why
        else:
            return made, made is None, None
    made, why = steps.wide_mask(mask, batch, width, cache)
    if why is not None:
        return None, None, why
    return made, ("remade", impl) if remade else None, None
