"""The positions a model's forward can reach: no undone extra step may run a forward past them.

A forward that reads a fixed-size table by position fails one position past its end, where stock, stopping at the
table's last row, never runs that forward: GPT-2's `wpe` and OPT's offset `embed_positions` (IndexError; on CUDA a
device-side assert that ends the process's CUDA context), GPT-J's and CodeGen's sin/cos buffer `embed_positions`,
CTRL's `pos_encoding` buffer, MPT's alibi (built to `max_seq_len`, it no longer broadcasts against a longer key),
a BERT-like decoder's `position_ids` buffer. So the controller reads the verdict before any forward at that many
positions, as stock does.

The tables are found from what the forward read, not from names: the call's first forward (the prefill) runs under
`position_reads.PositionReads`, which follows on the host which values grow with the positions and records the index
reads and slices of fixed tensors they drive. The result is kept per model (weakly keyed: freed with it) with a
fingerprint of its parameters, buffers and config values, checked at every call: a model changed since (a table
swapped or resized, `max_seq_len` edited) is observed again at its next call. A call whose model is known observes
nothing. The observation reads no device value and runs every call as stock does; a model whose forward is compiled
(`model.compile()`, a compiled module or `forward`: dynamo would trace the mode into its graph) or holds a module of
torch's with a fused fast path that a function mode turns off (`nn.MultiheadAttention`) is not observed: there the
rule before the watch holds (an `nn.Embedding` named `wpe` or `*pos*`).

Positions are counted from the cache (position ids never exceed its count: padding only lowers them). A table found
wrongly only makes the controller read verdicts at once past it, which costs a sync and never changes an output. Not
found: a table a forward reads only on a path the observed forward did not take, and a table whose slice the
observed forward did not need (a prompt that fills it exactly: no slice op runs). Such an observation stays provisional
(its longest length is the size of a fixed tensor it used), and a later call of another length is observed too.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import nn

from .position_reads import DATA, MASK, POSITIONS, VALUE, PositionReads

# model -> (fingerprint, positions or None, why, None or (the observed call's length, observations left) while
# provisional)
_KNOWN: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_RETRIES = 2

_INPUTS = {"attention_mask": MASK, "decoder_attention_mask": MASK, "cache_position": POSITIONS,
           "position_ids": POSITIONS, "decoder_position_ids": POSITIONS, "input_ids": DATA,
           "decoder_input_ids": DATA}


def fingerprint(model: nn.Module) -> tuple:
    """What the tables depend on: the model's tensors (identity and shape) and its config's plain values. Made at
    every call: a walk of the modules' own dicts, cheaper than `named_parameters()` (no name strings, no memo)."""
    marks = []
    for tensor in _own_tensors(model):
        marks.append(id(tensor))
        marks.append(tensor.shape)
    return tuple(marks), _config_values(getattr(model, "config", None))


def _own_tensors(model: nn.Module):
    """Every parameter and buffer of `model` (a tensor shared by two modules comes twice)."""
    stack = [model]
    while stack:
        module = stack.pop()
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None:
                    yield tensor
        stack.extend(child for child in module._modules.values() if child is not None)


def _config_values(config, depth: int = 0) -> tuple:
    if config is None or depth > 1:
        return ()
    items = []
    for key, value in vars(config).items():
        if value is None or isinstance(value, (bool, int, float, str)):
            items.append((key, value))
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            items.append((key, _config_values(value, depth + 1)))  # a sub-config (`text_config`)
    return tuple(sorted(items, key=lambda item: item[0]))


class PositionWatch:
    """The observation of one call's first forward; `finish` resolves it once the cache after it is known."""

    def __init__(self, model: nn.Module, key: tuple, input_ids, model_kwargs, previous=None):
        self.model = weakref.ref(model)
        self.key = key
        self.previous = previous  # a provisional result for this very model, which this observation completes
        self.length = _length(input_ids, model_kwargs)
        statics = itertools.chain(_own_tensors(model), _module_tensors(model))
        inputs = [(input_ids, DATA)] if isinstance(input_ids, torch.Tensor) else []
        for name, value in (model_kwargs or {}).items():
            if isinstance(value, torch.Tensor):
                label = _INPUTS.get(name)
                if label is None or label is MASK and value.is_floating_point():
                    label = DATA if value.is_floating_point() else VALUE
                inputs.append((value, label))
        self.reads = PositionReads(statics, inputs)
        self.reads.__enter__()
        self.open = True

    @classmethod
    def start(cls, model, input_ids=None, model_kwargs=None) -> tuple:
        """(positions known for `model` or None, why, a watch of the forward to come where they are not known yet)."""
        if not isinstance(model, nn.Module):
            return None, None, None
        key = fingerprint(model)
        known = _KNOWN.get(model)
        if known is not None and known[0] != key:
            known = None  # the model changed since
        length = _length(input_ids, model_kwargs)
        if known is not None and (known[3] is None or known[3][0] == length):
            return known[1], known[2], None
        if not _observable(model):
            return _named_tables(model), None, None  # nothing observed, nothing kept: the next call asks again
        # a provisional result bounds this call already; its observation, at another length, completes it
        watch = cls(model, key, input_ids, model_kwargs, known)
        return (known[1], known[2], watch) if known is not None else (None, None, watch)

    def stop(self) -> None:
        """End the observation (the forward ran, or an exception left the loop before it)."""
        if self.open:
            self.open = False
            self.reads.__exit__(None, None, None)

    def finish(self, cache) -> tuple[int | None, str | None]:
        """(positions the forward can reach, or None: no table; why they are limited)."""
        self.stop()
        reads = self.reads
        if reads.failed is not None:
            # not kept: the next call observes again; this one reads every verdict at once
            return 0, f"the watch of the forward's position reads failed ({reads.failed}): each verdict is read at once"
        lengths = set(reads.lengths)
        lengths.update(_cache_lengths(cache))
        longest = max(lengths, default=0)
        limits = [rows - math.ceil(off) for rows, off in reads.index_reads if off is not None]
        # a cut to a length the forward showed, from a size longer than any: cut to a longer key, it fails
        limits += [rows for rows, cut in reads.slices if cut in lengths and rows > longest]
        positions, why = min(limits) if limits else None, None
        if any(off is None for _, off in reads.index_reads):
            positions, why = 0, ("the model's forward reads a table by a position it adds an unknown amount to: each "
                                 "verdict is read at once")
        before = self.previous
        if before is not None and before[1] is not None and (positions is None or before[1] < positions):
            positions, why = before[1], before[2]
        # provisional where the longest length is also the size of a fixed tensor the forward used: a later call of
        # another length is observed too (twice at most: a static cache as long as a weight is ambiguous every time)
        retries = _RETRIES if before is None else before[3][1] - 1
        provisional = (self.length, retries) if longest in reads.sizes and retries > 0 else None
        model = self.model()
        if model is not None:
            _KNOWN[model] = (self.key, positions, why, provisional)
        return positions, why


# torch's modules that take a fused fast path only where no torch function mode is on (`has_torch_function`)
_FAST_PATHS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _observable(model: nn.Module) -> bool:
    """Whether the watch can run over the forward without changing a kernel or a graph: not where the forward runs
    compiled (`model.compile()`, a compiled module or instance `forward`: dynamo would trace the mode into it), nor
    where a module of torch's would leave its fast path under the mode (a vision tower's attention pooling)."""
    if torch.compiler.is_compiling():
        return False
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule":
            return False
        if hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable") or isinstance(module, _FAST_PATHS):
            return False
    return True


def _named_tables(model: nn.Module) -> int | None:
    """Where the forward is not observed, the rule before the watch: an `nn.Embedding` other than the token
    embeddings named `wpe` or `*pos*` is a table (OPT's and BART's shift their ids by `offset`)."""
    skip = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            skip.add(id(getattr(model, getter)()))
        except Exception:  # a model without them (NotImplementedError) has nothing to skip
            pass
    sizes = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and id(module) not in skip and (last == "wpe" or "pos" in last):
            offset = getattr(module, "offset", 0)
            sizes.append(module.num_embeddings - (offset if isinstance(offset, int) else 0))
    return min(sizes) if sizes else None


def _module_tensors(model: nn.Module):
    """Tensors kept as plain module attributes (neither parameter nor buffer): constants the forward may read."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value


def _length(input_ids, model_kwargs):
    """The call's sequence length as it starts (the prompt, or the embeddings fed instead)."""
    embeds = (model_kwargs or {}).get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return embeds.shape[1]
    return input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else None


def _cache_lengths(cache) -> list:
    """The key lengths the forward's attention saw, on the host: a fixed-size cache's size, a growing cache's count."""
    if cache is None:
        return []
    from .cache_rollback import capacity

    fixed = capacity(cache)
    if fixed is not None:
        return [fixed]
    try:
        length = cache.get_seq_length()
    except Exception:  # a cache that cannot tell: the lengths the forward showed itself
        return []
    return [length] if isinstance(length, int) else []

