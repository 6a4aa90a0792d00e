"""Models whose own input preparation drops the cache mid-call: no undone extra step may be the forward that refills it.

Phi-3's `prepare_inputs_for_generation` (PhiMoE's is the same) passes no cache to the forward whose input first is
longer than `original_max_position_embeddings` (its rope switches from short to long factors there), and that forward
fills a new cache: with the whole sequence from 5.20 on, with the last token alone before (so that 5.15-5.19 drop it
again at every later step). The flag undoes an extra step by cropping the cache; a refill cannot be cropped back to
the cache stock returns (and 5.17+'s stop check would crop the dropped cache, not the new one). So from that length on
each verdict is read at once, as stock reads it, for the rest of the call (`AsyncStop.record`).

Where the preparation is a model's own and the config has an `original_max_position_embeddings`, but the source is
not one read (`targets.shortcuts`, "rope switch drops the cache"), every verdict of the call is read at once.
"""

from __future__ import annotations

import sys

from .verified import matches

_READ = {  # family: (modeling module, causal LM class whose `prepare_inputs_for_generation` was read)
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM"),
    "phimoe": ("transformers.models.phimoe.modeling_phimoe", "PhimoeForCausalLM"),
}


def own_prepare(module: str, name: str):
    """The `prepare_inputs_for_generation` class `name` of modeling module `module` defines itself (None: the module is
    not imported, or the class keeps an inherited one)."""
    cls = getattr(sys.modules.get(module), name, None)
    return None if cls is None else cls.__dict__.get("prepare_inputs_for_generation")


def drop_length(model) -> tuple[int, str] | None:
    """(length, why): the sequence length past which each verdict is read at once (0: from the first step), and why;
    None where the model's input preparation keeps the cache (transformers' generic one, or one with no rope switch)."""
    from transformers.generation.utils import GenerationMixin

    own = getattr(type(model), "prepare_inputs_for_generation", None)
    if own is None or own is GenerationMixin.prepare_inputs_for_generation:
        return None
    limit = getattr(getattr(model, "config", None), "original_max_position_embeddings", None)
    if type(limit) is not int:
        return None
    for family, (module, name) in _READ.items():
        if own is own_prepare(module, name):
            if matches(f"rope switch drops the cache ({family} inputs)"):
                return limit, (f"the model's input preparation drops the cache past {limit} positions: each verdict "
                               "is read before a forward")
            break
    return 0, ("the model's own input preparation may drop the cache (it has an `original_max_position_embeddings`) "
               "and was not read for this release: each verdict is read at once")
