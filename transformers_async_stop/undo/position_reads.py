"""What a forward reads by position: the tables one forward further would run past.

`PositionReads` is a `TorchFunctionMode` that watches one forward (the call's first, the prefill) and follows, on the
host only (shapes, dtypes, Python scalars: no device value is read), what each tensor's values can be:

- `data`: made from the tokens, the embeddings, the hidden states or the cache's contents;
- `up` / `down`: the values can grow / fall as the positions grow: a position input (`cache_position`,
  `position_ids`), an `arange`, a running count (`cumsum` of a 0/1 mask). Arithmetic keeps them; an op that bounds
  the values drops them (a comparison, a minimum against a bound, `where(x < k, x, y)`, a remainder): T5's bucketed
  relative positions end bounded by their bucket count, and read no table;
- `off`: for a growing tensor, how far its values may run past the position of the forward's last token (OPT adds 2
  to its position ids, a count of a 0/1 mask runs one ahead); None where the ops do not tell;
- where it comes from (`origin`): the model's own tensors (parameters, buffers, tensor attributes), a tensor the
  forward builds from constants and ranges, or the call (its inputs, the cache, the hidden states);
- the lengths of the ranges its values were made from (`ranges`).

Two reads make a table. An index into one of the model's own tensors by a growing index (`embedding`, `[...]`,
`index_select`, `gather`, `take`: GPT-2's `wpe`, GPT-J's and CodeGen's sin/cos buffer, CTRL's `pos_encoding`, a
BERT-like decoder's `token_type_ids` buffer): no forward may reach its rows minus the offset. A slice down to a query
or key length of a model tensor that does not grow (GPT-Neo's causal-mask buffer), or of a growing tensor the
forward built, along a dim as long as the range that made it (MPT's alibi, built to `max_seq_len` and cut to the key
length, which no longer broadcasts once the key is longer): no forward may pass its size. A tensor of the call, or
one shaped by it, is no table (the attention mask, read by position in every padded forward). A function not listed
here keeps growth both ways and loses the offset: a false table only makes the controller read verdicts at once,
which costs a sync and never changes an output.

A function mode, not a dispatch mode: it sees each call before dispatch and runs it as called, so every kernel is
stock's (under `inference_mode` a dispatch mode gets composite ops such as `linear` undecomposed, and running them
from its handler picks other kernels: logits moved by 1e-6). A failure in the bookkeeping ends the observation
(`failed`). While dynamo traces, calls pass through untouched: a function compiled inside an eager forward (flex
attention's kernel) traces the same graph, but dynamo guards on the mode stack and compiles it once more at its next
call. `position_table._observable` keeps compiled forwards and torch's fast-path modules out of it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

MODEL, BUILT, CALL = 0, 1, 2  # origins, ordered: a result has the latest of its inputs'


class Label(tuple):
    """(data, up, down, off, top, bot): `top` / `bot` bound the values of a tensor that does not grow, where known."""

    __slots__ = ()

    def __new__(cls, data=False, up=False, down=False, off=None, top=None, bot=None):
        return tuple.__new__(cls, (data, up, down, off, top, bot))

    data, up, down, off, top, bot = (property(lambda self, i=i: self[i]) for i in range(6))

    def grows(self) -> bool:
        return self[1] or self[2]


VALUE = Label()
DATA = Label(data=True)
POSITIONS = Label(up=True, off=0, bot=0)  # a position input: at most the forward's last position
MASK = Label(top=1, bot=0)  # 0/1 values

# values passed on unchanged (a view, a copy, a cast, a reordering, a join); `__get__`: a property (`.T`)
_SAME = frozenset((
    "view", "reshape", "unsqueeze", "squeeze", "expand", "permute", "transpose", "t", "select", "alias", "detach",
    "clone", "contiguous", "to", "type_as", "long", "int", "short", "float", "double", "half", "bfloat16", "cpu",
    "cuda", "view_as", "reshape_as", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "flatten", "repeat",
    "cat", "concat", "concatenate", "stack", "movedim", "flip", "roll", "unfold", "diagonal", "copy", "index_put",
    "__get__", "tile", "broadcast_to", "as_strided",
))
_MONOTONE = frozenset(("log", "log2", "log10", "log1p", "exp", "sqrt", "floor", "ceil", "round", "trunc", "sigmoid",
                       "tanh"))
_COMPARE = frozenset(("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
                      "isin", "isnan", "isinf", "isfinite", "any", "all", "bool"))
_INDICES = frozenset(("remainder", "fmod", "argmax", "argmin", "argsort", "bucketize", "searchsorted"))
_FACTORIES = frozenset(("zeros", "ones", "full", "empty", "empty_strided", "scalar_tensor", "tensor", "as_tensor",
                        "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full",
                        "new_empty", "new_tensor", "fill", "zero", "rand", "randn", "rand_like", "randn_like",
                        "randint"))
_CONSTANT = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "zero": 0, "ones": 1, "ones_like": 1, "new_ones": 1}
_FILLED = frozenset(("full", "full_like", "new_full", "fill", "scalar_tensor", "tensor", "as_tensor", "new_tensor"))
_READS = frozenset(("embedding", "getitem", "index_select", "gather", "take", "take_along_dim"))
# Python operators: `__radd__` and `__iadd__` are `add` with the operands swapped / written into the first
_OPERATORS = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floor_divide",
              "mod": "remainder", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
              "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "neg": "neg",
              "abs": "abs", "getitem": "getitem", "setitem": "setitem", "pow": "pow", "matmul": "matmul"}


def _tensors(value, found: list) -> list:
    """The tensors in a call's arguments or result (nested tuples, lists, dicts), in order."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plus(off, amount):
    return None if off is None or amount is None else off + amount


def _normalize(func, args):
    """(name, args in the operator's order, whether it writes into its first argument)."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        if core in _OPERATORS:
            return _OPERATORS[core], args, core == "setitem"
        if core[:1] in "ir" and core[1:] in _OPERATORS:
            op = _OPERATORS[core[1:]]
            if core[0] == "i":
                return op, args, True
            if op == "sub":
                return "rsub", args, False  # other - self
            return op, (args[1], args[0]) + tuple(args[2:]) if len(args) > 1 else args, False
        return name, args, False
    if name.endswith("_") and not name.startswith("_"):
        return name[:-1], args, True  # an in-place method: `masked_fill_`, `add_`, `index_copy_`
    if name == "embedding" and len(args) > 1:  # `F.embedding(input, weight)`: the table first, as for `[...]`
        return name, (args[1], args[0]) + tuple(args[2:]), False
    return name, args, False


class PositionReads(TorchFunctionMode):
    """The calls of one forward; `index_reads`, `slices` and `lengths` are what `position_table` makes positions of."""

    def __init__(self, statics, inputs):
        super().__init__()
        self.labels = WeakIdKeyDictionary()
        self.origin = WeakIdKeyDictionary()
        self.ranges = WeakIdKeyDictionary()
        for t in statics:
            self.labels[t], self.origin[t] = VALUE, MODEL
        for t, label in inputs:
            self.labels[t] = label
            if label.up and t.dim():
                self.ranges[t] = frozenset((t.shape[-1],))
        self.conds = WeakIdKeyDictionary()  # a comparison's result: (op, a weak reference to the compared tensor)
        self.index_reads = []  # (rows along the read dim of a model tensor, the index's offset or None)
        self.slices = []  # (size of the cut dim, size it was cut to)
        self.lengths = set()  # query and key lengths the forward showed (token lookups, attention)
        # the sizes of the fixed tensors the forward used: one as long as the key may be a table it did not need to
        # cut (a prompt that fills MPT's alibi exactly), which a shorter call's forward would show
        self.sizes = set()
        self.failed = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo traces the call as it would without the mode
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.failed is None:
            try:
                self._see(func, args, kwargs, out)
            except Exception as exc:  # the bookkeeping never breaks the forward: the observation ends unresolved
                self.failed = f"{type(exc).__name__}: {exc}"
        return out

    def label(self, t) -> Label:
        if not isinstance(t, torch.Tensor):
            return Label(top=t, bot=t) if _number(t) else VALUE
        label = self.labels.get(t)
        if label is None:  # made before the watch and not an input it was told of: the cache's contents...
            return DATA if t.is_floating_point() or t.is_complex() else VALUE
        return label

    # -- one call ----------------------------------------------------------------------------------------------
    def _see(self, func, args, kwargs, out) -> None:
        outs = _tensors(out, [])
        name, args, writes = _normalize(func, args)
        if not outs and not writes:
            return  # a shape, a dtype, a host value
        tensors = _tensors(kwargs, _tensors(args, []))
        if name in _READS:
            self._read(name, args, kwargs)
        elif name == "narrow" and len(args) > 3:
            self._cut(args[0], args[1], args[3])
        elif name.startswith("scaled_dot_product") and len(args) > 1:
            self.lengths.update((args[0].shape[-2], args[1].shape[-2]))
        result = self._result(name, args, kwargs, [self.label(t) for t in tensors])
        if outs and not result.grows() and all(o.dtype == torch.bool for o in outs):
            result = Label(data=result.data, top=1, bot=0)  # a bool: 0 or 1
        origins = [self.origin.get(t, CALL) for t in tensors]
        for t, origin in zip(tensors, origins):
            if origin != CALL:
                self.sizes.update(t.shape)
        origin = max([BUILT if name == "arange" or name in _FACTORIES else MODEL] + origins)
        ranges = frozenset().union(*(self.ranges.get(t, ()) for t in tensors))
        if name == "arange" and outs:
            ranges = frozenset((outs[0].numel(),))
        elif name == "cumsum":
            dim = args[1] if len(args) > 1 else kwargs["dim"]
            ranges |= {tensors[0].shape[dim]}
        own = [args[0]] if writes and args and isinstance(args[0], torch.Tensor) else []  # `x.add_(...)`, `x[i] = v`
        written = _tensors(kwargs.get("out"), own)
        for o in outs + written:
            self.labels[o], self.origin[o] = result, origin
            if ranges:
                self.ranges[o] = ranges
        if name in ("lt", "le", "gt", "ge") and len(args) > 1 and _number(args[1]) and outs:
            self.conds[outs[0]] = (name, weakref.ref(args[0]))

    def _read(self, name, args, kwargs) -> None:
        source = args[0]
        if name == "getitem":
            reads = self._items(source, args[1])
        elif name == "embedding":
            reads = [(0, args[1])]
        elif name == "take":
            reads = [(None, args[1])]
        elif name == "take_along_dim":  # (input, indices, dim)
            reads = [(args[2] if len(args) > 2 else kwargs.get("dim"), args[1])]
        else:  # index_select, gather: (input, dim, index)
            reads = [tuple((list(args[1:3]) + [kwargs.get("dim"), kwargs.get("index")][len(args) - 1:])[:2])]
        # only the model's own tensors: one the forward builds and reads by index is shaped by the call (a padding
        # mask of ones, read at each row's `arange` of the batch)
        model_table = self.origin.get(source, CALL) == MODEL and not self.label(source).data
        for dim, index in reads:
            if not isinstance(index, torch.Tensor) or dim is None and name != "take":
                continue
            label = self.label(index)
            if model_table and label.up and index.dtype != torch.bool:
                self.index_reads.append((source.numel() if dim is None else source.shape[dim], label.off))
            elif name == "embedding" and label.data:
                self.lengths.add(index.shape[-1])  # a token lookup: the query length

    def _items(self, source, index) -> list:
        """`source[index]`: slices are cuts (recorded here), tensors are reads along the dims they index."""
        items = index if isinstance(index, tuple) else (index,)
        used = sum(1 for item in items if item is not None and item is not Ellipsis)
        reads, dim = [], 0
        for item in items:
            if item is Ellipsis:
                dim += source.dim() - used
            elif item is None:
                continue
            elif isinstance(item, slice):
                if dim < source.dim():
                    self._cut(source, dim, len(range(*item.indices(source.shape[dim]))))
                dim += 1
            elif isinstance(item, torch.Tensor) and item.dtype == torch.bool:
                dim += item.dim()  # a mask over as many dims as it has
            else:
                if isinstance(item, torch.Tensor):
                    reads.append((dim, item))
                dim += 1
        return reads

    def _cut(self, source, dim, cut) -> None:
        if not isinstance(source, torch.Tensor) or not isinstance(cut, int):
            return
        origin, label = self.origin.get(source, CALL), self.label(source)
        rows = source.shape[dim]
        if origin == CALL or label.data or cut >= rows:
            return
        # a model tensor that does not grow (a causal-mask buffer) is cut by position; one the forward built, only
        # if it grows and is cut along a dim as long as the range it was made from (MPT's alibi; not a rope table's
        # head dim, not a mask of ones)
        if (origin == MODEL and not label.grows()) or (label.grows() and rows in self.ranges.get(source, ())):
            self.slices.append((rows, cut))

    # -- what a call's values can be ---------------------------------------------------------------------------
    def _result(self, name, args, kwargs, labels) -> Label:
        data = any(label.data for label in labels)
        if name in _READS:  # the values are the table's; growth of the index does not pass to them
            source = self.label(args[0])
            return Label(data, source.up, source.down, source.off, source.top, source.bot)
        if name in ("narrow", "slice"):
            return self.label(args[0])
        if name == "arange":
            return Label(up=True, off=0)  # a range of positions: its last at most the forward's last
        if name in _FACTORIES:
            value = next((a for a in args if _number(a)), None) if name in _FILLED else _CONSTANT.get(name)
            value = kwargs.get("fill_value", value) if _number(kwargs.get("fill_value")) else value
            return Label(data=False, top=value, bot=value)
        if name in _COMPARE:
            return Label(data=data, top=1, bot=0)
        if name in _INDICES:
            return Label(data=data)
        if name == "setitem":
            return _join(data, [self.label(args[0]), self.label(args[2]) if len(args) > 2 else VALUE])
        if not any(label.grows() for label in labels):
            return self._steady(name, args, kwargs, data, labels)
        if name in _SAME:
            return _join(data, labels)
        if name in _MONOTONE:
            return Label(data=data, up=any(label.up for label in labels), down=any(label.down for label in labels))
        return self._arithmetic(name, args, kwargs, data)

    def _steady(self, name, args, kwargs, data, labels) -> Label:
        """No growing input: known bounds kept through copies and products of 0/1 values; a count of them grows."""
        if name == "cumsum":
            source = labels[0]
            if source.top == 0 and source.bot == 0:
                return Label(data=data, top=0, bot=0)
            if source.top == 1 and source.bot is not None and source.bot >= 0:
                return Label(data=data, up=True, off=1, bot=0)  # a count of ones runs one past the last position
            return Label(data=data, up=True, down=source.bot is None or source.bot < 0)
        if name in _SAME or name in ("mul", "minimum", "maximum", "masked_fill", "where"):
            bounds = labels + [self.label(a) for a in args[1:] if _number(a)]
            tops, bots = [label.top for label in bounds], [label.bot for label in bounds]
            if bounds and None not in tops and None not in bots:
                if name != "mul":
                    return Label(data=data, top=max(tops), bot=min(bots))
                if min(bots) >= 0:
                    return Label(data=data, top=math.prod(tops), bot=0)
        return Label(data=data)

    def _arithmetic(self, name, args, kwargs, data) -> Label:
        """A call with a growing input."""
        first = self.label(args[0])
        other = args[1] if len(args) > 1 else None
        second = self.label(other)
        if name in ("add", "sub"):
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            sign = (alpha if name == "add" else -alpha) if _number(alpha) else None
            if sign is None:
                return Label(data=data, up=True, down=True)
            up = first.up or (second.up if sign > 0 else second.down)
            down = first.down or (second.down if sign > 0 else second.up)
            off = None
            if first.up and not second.grows():
                most = second.top if sign > 0 else second.bot  # the most `other` can add
                off = _plus(first.off, None if most is None else sign * most)
            elif second.up and not first.grows() and sign == 1:
                off = _plus(second.off, first.top)
            return Label(data=data, up=up, down=down, off=off)
        if name in ("rsub", "neg"):  # rsub: other - first
            return Label(data=data, up=first.down, down=first.up)
        if name == "abs":
            return Label(data=data, up=first.up or first.down)
        if name == "mul":
            if _number(other):
                if other == 0:
                    return Label(data=data, top=0, bot=0)
                up, down = (first.down, first.up) if other < 0 else (first.up, first.down)
                return Label(data=data, up=up, down=down, off=first.off if other == 1 else None)
            grower, factor = (first, second) if first.grows() else (second, first)
            if not factor.grows() and factor.top == 1 and factor.bot == 0:
                return Label(data=data, up=grower.up, down=grower.down, off=grower.off)  # kept or zeroed
        if name in ("div", "floor_divide", "true_divide") and _number(other) and other > 0:
            return Label(data=data, up=first.up, down=first.down, off=first.off if other == 1 else None)
        if name in ("min", "max") and not isinstance(other, torch.Tensor):
            return first  # a reduction: some of the values
        if name in ("clamp", "clip"):
            lower = args[1] if len(args) > 1 else kwargs.get("min")
            upper = args[2] if len(args) > 2 else kwargs.get("max")
            capped = upper is not None and not self.label(upper).up
            down = first.down and (lower is None or self.label(lower).down)
            return Label(data=data, up=first.up and not capped, down=down, off=None if capped else first.off)
        if name in ("minimum", "min", "clamp_max"):  # at most either: a bound that does not grow caps it
            capped = not first.up or not second.up
            return Label(data=data, up=not capped, down=first.down or second.down,
                         off=None if capped else first.off)
        if name in ("maximum", "max", "clamp_min"):
            return _join(data, [first, second])  # one of the two
        if name == "masked_fill":
            return _join(data, [first, self.label(args[2]) if len(args) > 2 else VALUE])
        if name == "where" and len(args) == 3:
            return self._where(data, *args)
        return Label(data=data, up=True, down=True)  # not known: may grow either way, by an unknown amount

    def _where(self, data, cond, x, y) -> Label:
        """`where(c, x, y)`: a branch taken only where `c` bounds it (T5's `where(x < k, x, y)`) does not grow."""
        test = self.conds.get(cond) if isinstance(cond, torch.Tensor) else None
        chosen, other = self.label(x), self.label(y)
        if test is not None:
            op, compared = test
            if op in ("lt", "le") and compared() is x:
                chosen = Label(data=chosen.data, down=chosen.down)
            elif op in ("gt", "ge") and compared() is y:
                other = Label(data=other.data, down=other.down)
        return _join(data, [chosen, other])


def _join(data, labels) -> Label:
    """Values that may come from any of `labels`."""
    up, down = any(label.up for label in labels), any(label.down for label in labels)
    if up:
        offs = [label.off for label in labels if label.up]
        # a value that does not grow (4.57's `position_ids.masked_fill_(attention_mask == 0, 1)`) is no further from
        # a table's end one forward later: every forward reads it, stock's last one too, so it sets no offset
        off = None if None in offs else max(offs)
        return Label(data=data, up=True, down=down, off=off)
    tops, bots = [label.top for label in labels], [label.bot for label in labels]
    return Label(data=data, down=down, top=None if None in tops else max(tops, default=None),
                 bot=None if None in bots else min(bots, default=None))
