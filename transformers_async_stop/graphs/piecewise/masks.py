"""The mask of a forward of K > 1 tokens, made at each replay as stock's forward makes it (`graphs.py`).

With a cache, stock builds a 4D mask inside every forward of more than one token (`create_causal_mask` ->
`sdpa_mask`, padding included; it never skips it then), from the step's 2D mask, the cache and the positions. A
K-token recording intercepts the modeling module's mask functions: each call gets a sentinel of its own, and its
keyword arguments are kept with markers where the step's mask, cache and positions go. Every replay calls the
module's function again with this step's values (`mask_call`). The embeddings tensor the call got is piece 0's output,
a fixed buffer holding the replay's embeddings by then: the mask functions read its shape, dtype and device (5.17-5.24:
`_preprocess_mask_arguments`, digested for the path in `targets/piecewise_rows.py`).

**A one-token forward of a cache with sliding-window layers** is recorded the same way (its mask calls intercepted,
stock's masks made for the recording step by stock's functions), but its replays make no call: each recorded call's
mask is answered on the host (`host_mask`), as `create_causal_mask` / `create_sliding_window_causal_mask` make it for a
decode step without padding (`steps.sliding_step` keeps every other step eager). So each layer gets its own mask kind,
as the model's forward handed it out at the recording, observed, not assumed per family.
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


ENCODER_MASK = Marker("the step's encoder attention mask")
ENCODER_STATES = Marker("the step's encoder hidden states")
CROSS_MASK_FUNCTION = "create_bidirectional_mask"  # an encoder-decoder's decoder makes its cross-attention mask so


def recorded_cross_kwargs(kwargs: dict, encoder_mask, encoder_states) -> tuple[dict | None, str | None]:
    """A decoder's cross-attention mask call's keywords as a recording keeps them (markers for the step's encoder
    mask, which it must be handed as `attention_mask`, None or not, and its encoder states), or (None, why not)."""
    from transformers.configuration_utils import PretrainedConfig

    recorded = {}
    for key, value in kwargs.items():
        if key == "attention_mask" and value is encoder_mask:
            recorded[key] = ENCODER_MASK
        elif key == "encoder_hidden_states" and value is encoder_states:
            recorded[key] = ENCODER_STATES
        elif key in EMBEDDINGS and isinstance(value, torch.Tensor):
            recorded[key] = value  # piece 0's output: a fixed buffer (its shape, dtype and device are read)
        elif key not in ("attention_mask", "encoder_hidden_states") and (
                isinstance(value, SCALARS) or isinstance(value, PretrainedConfig)):
            recorded[key] = value  # the config: the decoder's own object (a replaced one is a stale recording)
        else:
            return None, f"{key!r} is not the step's own"
    if recorded.get("attention_mask") is not ENCODER_MASK or recorded.get("encoder_hidden_states") is not ENCODER_STATES:
        return None, "not handed the step's encoder mask and states"
    return recorded, None


def cross_mask_call(function, recorded: dict, encoder_mask, encoder_states):
    """`function` (the modeling module's `create_bidirectional_mask`) called with a recorded call's keywords, the
    markers replaced by this step's encoder mask and states: stock's cross-attention mask for the step."""
    return function(**{key: (encoder_mask if value is ENCODER_MASK else encoder_states if value is ENCODER_STATES
                             else value) for key, value in recorded.items()})


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


# the mask calls a one-token recording of a cache with sliding-window layers answers on the host (`host_mask`), and the
# keywords they may take: the step's mask, the cache and the positions (markers), the embeddings, the model's config
HOST_ANSWERED = ("create_causal_mask", "create_sliding_window_causal_mask")
_HOST_KEYWORDS = frozenset(("config", "attention_mask", "cache", "past_key_values", "position_ids", *EMBEDDINGS))


def why_not_host(name: str, recorded: dict, config) -> str | None:
    """Why the host cannot answer a recorded mask call at each replay (None: it can): another function, another
    keyword (an `and_mask_function`, a `layer_idx`...), another config than the model's, or a marker elsewhere."""
    if name not in HOST_ANSWERED:
        return f"{name} is not answered on the host"
    if not _HOST_KEYWORDS.issuperset(recorded) or recorded.get("config") is not config:
        return f"a {name} call with keywords the host does not answer for"
    if (recorded.get("attention_mask") is not MASK or recorded.get("position_ids", POSITIONS) is not POSITIONS
            or CACHE not in (recorded.get("cache"), recorded.get("past_key_values"))):
        return f"a {name} call with keywords the host does not answer for"
    return None


def host_mask(name: str, recorded: dict, step_mask, batch: int, cache, device, made: dict):
    """What stock's `name` returns at a one-token decode step of a batch without padding (`step_mask`: None or the
    2D mask of ones, `steps.sliding_step`), with `cache` before this step's update (5.17.0-5.24.0, digests in
    `targets/piecewise_rows.py` `_COMMON`):
    - `create_causal_mask`: no local size, one query, no padding: `_ignore_causal_mask_sdpa` skips it, None;
    - `create_sliding_window_causal_mask`: sized by the cache's first sliding layer (`is_sliding.index(True)`), whose
      window is the config's (`steps.sliding_step`). While it holds fewer than `window - 1` positions, `kv_length <
      window` and the mask is skipped: None. From there on `kv_length == window` and `sdpa_mask` materialises it:
      every entry True (the keys span `[cl - window + 1, cl]` for the query at `cl`); `(1, 1, 1, window)` from the
      overlay and causal functions, expanded to the batch, without a 2D mask; with one, the padding function's
      indexing makes it a contiguous `(batch, 1, 1, window)`. Made once per (window, 2D mask or not) and kept in
      `made` (SDPA only reads it).
    """
    if name == "create_causal_mask":
        return None
    window = recorded["config"].sliding_window
    layer = cache.layers[cache.is_sliding.index(True)]
    if layer.cumulative_length < window - 1:
        return None
    key = (window, step_mask is not None)
    full = made.get(key)
    if full is None:
        if step_mask is None:
            full = torch.ones((1, 1, 1, window), dtype=torch.bool, device=device).expand(batch, -1, 1, window)
        else:
            full = torch.ones((batch, 1, 1, window), dtype=torch.bool, device=device)
        made[key] = full
    return full
