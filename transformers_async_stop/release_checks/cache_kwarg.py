"""The name the decoding loop keeps its cache under: `past_key_values` up to transformers 5.23, `cache` from 5.24.

5.24 renames the cache nearly everywhere: `model_kwargs["cache"]` inside `generate()`, the `cache` field of the
output dataclasses, `cache=` on `prepare_inputs_for_generation`, the `create_*_mask` functions and the model
forwards. `past_key_values` (and `cache_params`) stay accepted as deprecated keywords: `generate()` renames them to
`cache` before anything reads them (`deprecate_kwarg`), and so does an output dataclass's `__init__` (with a
deprecation warning that stock's own calls never print). The name is read from the running release the way stock
reads it, from `ALL_CACHE_NAMES` (its first entry is the default name: `past_key_values` in 4.57-5.23, `cache` in
5.24), once per process.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def name() -> str:
    """The keyword the running release keeps the loop's cache under in `model_kwargs`, the model inputs and the
    output dataclasses."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"


def get(mapping):
    """The loop's cache in `model_kwargs` / model inputs / a model output (None: none)."""
    if mapping is None:
        return None
    return mapping.get(name())


def put(mapping: dict, cache) -> None:
    mapping[name()] = cache


def of_output(outputs):
    """A model or generate output's cache, read under the running release's field name (5.24's `past_key_values`
    property logs a deprecation warning: stock never reads it)."""
    return getattr(outputs, name(), None)


def output_field(cache) -> dict:
    """`{name: cache}`, the keyword an output dataclass takes the cache under on the running release."""
    return {name(): cache}


def user_cache(kwargs: dict):
    """The cache a caller passed to `generate()`: `cache=` on 5.24+ (where `past_key_values=` and `cache_params=` are
    its deprecated spellings, renamed by stock before use), `past_key_values=` before."""
    if name() == "cache":
        for key in ("cache", "past_key_values", "cache_params"):
            if kwargs.get(key) is not None:
                return kwargs[key]
        return None
    return kwargs.get("past_key_values")
