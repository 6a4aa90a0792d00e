"""The positions a model's learned absolute position table holds: no forward may go past them.

GPT-2, GPT-Neo, GPT-BigCode, ImageGPT (`wpe`), OPT, BioGPT, BART-likes, Whisper (`embed_positions`) and others look
each position id up in an `nn.Embedding` with one row per position (OPT/BioGPT/BART add an offset of 2 to the ids
first: `module.offset`). A forward at a position past the last row raises (IndexError; on CUDA a device-side assert
that ends the process's CUDA context), so the undone extra step must never make one where stock did not.

Generic rule: every `nn.Embedding` submodule other than the input/output token embeddings whose attribute name is
`wpe` or contains "pos" is taken for a position table. A table found wrongly (a bucket or 2D-layout embedding) only
makes the controller read the last verdicts before the forward at that many positions, as stock does, which costs
a sync and never changes an output; the smallest table counts (an encoder's table is larger or irrelevant but safe).
Position ids never exceed the cache's position count (padding only lowers them), so counting from the cache is safe.
"""

from __future__ import annotations

from torch import nn


def _is_position_name(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return last == "wpe" or "pos" in last


def _find(model: nn.Module) -> list:
    skip = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except Exception:  # a model without them (NotImplementedError) has nothing to skip
            module = None
        if module is not None:
            skip.add(id(module))
    return [m for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) and id(m) not in skip and _is_position_name(name)]


def table_positions(model) -> int | None:
    """Position ids 0..n-1 the model's learned position tables can all look up (None: no table found)."""
    if not isinstance(model, nn.Module):
        return None
    # found per call (one module walk, no device work): a table swapped or resized between calls is seen
    sizes = []
    for table in _find(model):
        offset = getattr(table, "offset", 0)
        sizes.append(table.num_embeddings - (offset if isinstance(offset, int) else 0))
    return min(sizes) if sizes else None
