"""The mask of a forward of K > 1 tokens, made at each replay as stock's forward makes it (`graphs.py`).

With a cache, stock builds a 4D mask inside every forward of more than one token (`create_causal_mask` ->
`sdpa_mask`, padding included; it never skips it then), from the step's 2D mask, the cache and the positions. A
K-token recording intercepts the modeling module's mask functions: each call gets a sentinel of its own, and its
keyword arguments are kept with markers where the step's mask, cache and positions go. Every replay calls the
module's function again with this step's values (`mask_call`). The embeddings tensor the call got is piece 0's output,
a fixed buffer holding the replay's embeddings by then: the mask functions read its shape, dtype and device (5.17-5.24:
`_preprocess_mask_arguments`, digested for the path in `targets/piecewise_rows.py`).
"""

from __future__ import annotations

import contextlib

import torch


class Marker:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<{self.name}>"


POSITIONS = Marker("positions buffer")
MASK = Marker("the step's attention mask")
CACHE = Marker("the step's cache")
# the modeling modules' mask functions a K-token recording intercepts (those a module has; Gemma 3 calls both)
MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask")
EMBEDDINGS = ("inputs_embeds", "input_embeds")  # the embeddings' keyword (its name changed across releases)
SCALARS = (bool, int, float, str, type(None))  # kept as they are by a recording (a mask call's, an attention's)


def mask_call(function, kwargs: dict, mask, cache, positions):
    """A mask function called with a recorded call's keywords, the markers replaced by this step's mask, cache and
    the positions buffer (which holds this step's positions)."""
    resolved = {key: (mask if value is MASK else cache if value is CACHE else positions if value is POSITIONS
                      else value) for key, value in kwargs.items()}
    return function(**resolved)


def recorded_kwargs(kwargs: dict, sentinel, cache, positions) -> tuple[dict | None, str | None]:
    """A mask call's keywords as a recording keeps them (markers for the step's mask, cache and positions), or
    (None, the keyword a replay could not give again)."""
    from transformers.configuration_utils import PretrainedConfig

    recorded = {}
    for key, value in kwargs.items():
        if value is sentinel:
            recorded[key] = MASK
        elif value is cache:
            recorded[key] = CACHE
        elif value is positions:
            recorded[key] = POSITIONS
        elif key in EMBEDDINGS and isinstance(value, torch.Tensor):
            recorded[key] = value  # piece 0's output: a fixed buffer holding each replay's embeddings
        elif isinstance(value, SCALARS) or isinstance(value, PretrainedConfig):
            recorded[key] = value  # the config: the model's own object (a replaced one is a stale recording)
        else:
            return None, f"{key!r} is a {type(value).__name__}"
    if MASK not in recorded.values() or CACHE not in recorded.values():
        return None, "no mask or cache of the forward's"
    return recorded, None


def _intercept(name, original, active):
    def mask_function(*args, **kwargs):
        recorder = active.get()
        if recorder is None or recorder.mask_module is None:
            return original(*args, **kwargs)
        return recorder.mask(name, original, args, kwargs)

    mask_function._tas_piecewise_original = original
    return mask_function


@contextlib.contextmanager
def swapped(module, active):
    """The modeling module's mask functions replaced by interceptors for a K-token recording (`module` None: none);
    restored whatever happens. Another thread's forward passes through (`active` is the recording context's)."""
    if module is None:
        yield
        return
    table = vars(module)
    before = {name: table[name] for name in MASK_FUNCTIONS if name in table}
    mine = {name: _intercept(name, original, active) for name, original in before.items()}
    for name, interceptor in mine.items():
        setattr(module, name, interceptor)
    try:
        yield
    finally:
        for name, original in before.items():
            # another thread's rebinding meanwhile stays (red team hole 3): only our own interceptor is undone
            if table.get(name) is mine[name]:
                setattr(module, name, original)
