"""Which undeclared user logits processors the captured tail may replay: proven pure on one real call, then guarded.

A CUDA graph replays the kernels a processor launched at capture and none of its Python. A processor may be replayed
only if its Python, run again, would launch the same kernels on the same memory and change nothing else. That holds
when it reads only state that stays the same (its attributes, its class, the globals and closures of the code it
runs, tensor metadata constant within a call), never a tensor's values on the host nor the length of `input_ids`,
and writes nothing but tensors it creates. This module proves that on one call and checks before each replay that
the state it read is unchanged.

Protocol: one `Guard` per user processor per generate() call. The tail/eligibility owner calls it:

    guard = guard_for(processor)                # plan time. None: eager for the whole call
    scores = guard.observe(input_ids, scores)   # the first eager step, in place of processor(input_ids, scores)
    guard.capturable                            # then True (may capture), or False (eager; `guard.reason` says why)
    guard.unchanged()                           # before the capture, right after it, and before every replay

`observe` *is* that step's call: same arguments, same result, same side effects as stock. The instruments only
record, so it never changes an output. It runs the processor under a `TorchFunctionMode`, a `TorchDispatchMode`
and `sys.setprofile`, and rejects it (capturable False) if it:
- reads the host: `.item()`, `.tolist()`, `bool(t)`, `.cpu()`, `.numpy()`, `data_ptr()`, an op that returns a Python
  value or has a value-dependent shape (`nonzero`, boolean-mask indexing), a copy between devices, host data sent
  to the device (`torch.tensor(..., device="cuda")`);
- uses `input_ids` beyond `input_ids.shape[0]`, `.size(0)`, `len()`, `.device`, `.dtype`, `.ndim`. The graph is
  replayed on a fixed view, so neither the values nor the length of `input_ids` may be read;
- writes in place a tensor it did not create in the call (its inputs or tensor state), or sets a tensor's fields
  (`t.data = ...`, `requires_grad_()`, hooks);
- draws from an explicit `torch.Generator`. Only the device's default generator is registered to a CUDA graph
  (`CUDAGraph::capture_begin`; `CUDAGeneratorState` keeps a per-capture philox offset that each replay advances,
  see ATen/cuda/CUDAGeneratorImpl.h), so its draws in a replay are the ones eager would make;
- changes state it can reach (attributes, class attributes, globals, closures, containers: fingerprinted before the
  call, compared after), writes a global, imports, or raises (the exception propagates, as in stock);
- runs Python code not reached through the snapshotted state, calls into torch modules other than the tensor ops
  and `nn.Module` machinery, or calls a C function not known to be pure (`print`, `time.time`, `random.random`);
- holds state no fingerprint can see: objects of C types other than tensors, containers, functions and scalars;
  tensor subclasses; more than `_LIMIT` objects or `_NODES` fingerprints; a CPU tensor over `_CPU_VALUES` elements.
  (`guard_for` already returns None for such state; a Guard from `guard_for` means "can be judged", not "pure".)

The snapshot holds one node per mutable thing the call could read: the processor, its classes (with the `__call__`
code), the globals and attribute paths each executed code object reads, closures, defaults, containers, tensors
(identity, storage, shape, strides; a CPU tensor's values too, as capture bakes a 0-dim CPU operand into the launch),
torch's default dtype and grad mode. Deterministic Python that reads the same state and the same tensor metadata
takes the same path, so a capture made while `unchanged()` holds launches what `observe` saw. A CUDA tensor in the
state may be written in place between steps: the graph reads its memory live, as eager would.

Trusted, unchecked: torch's own Python (not monkeypatched during a call; torch modules, torch classes and global
hooks compared by identity only). Under `torch.compiler.is_compiling()` nothing is instrumented. While another
profiler is set (`sys.getprofile()`) nothing is proven, and every processor runs eagerly.
"""

from __future__ import annotations

import collections
import dis
import os
import sys
import sysconfig
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_LIMIT = 5000  # objects in one snapshot
_NODES = 256  # fingerprints checked before each replay (about 0.5 us each): more would cost what capture saves
_CPU_VALUES = 4096  # elements of a CPU tensor in the state, compared by value at every check
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB = tuple({p + os.sep for p in (sysconfig.get_paths()["stdlib"],
                                      os.path.realpath(sysconfig.get_paths()["stdlib"]))})
_TRUSTED = ("torch", "builtins", "math", "operator", "functools", "collections", "abc", "typing", "enum", "types")
# torch's Python that user code may call: tensor ops and the Module call machinery (their ops are checked)
_TORCH_ENTRIES = ("torch.nn.functional", "torch.functional", "torch._tensor", "torch.nn.modules", "torch._jit_internal",
                  "torch.overrides", "torch.autograd.grad_mode", "torch.utils._contextlib", "torch.nn.parameter")
_PURE_BUILTINS = {id(f) for f in (len, isinstance, issubclass, min, max, abs, round, sum, any, all, sorted, getattr,
                                  hasattr, callable, divmod, pow, iter, next, repr, format)}
_PURE_MODULES = {"math", "_operator", "operator"}
_VALUE_TYPES = (list, tuple, dict, set, frozenset, str, bytes, int, float, complex, bool, range, slice)
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
               "data_ptr", "untyped_storage", "storage", "_typed_storage", "__array__", "__dlpack__", "__repr__",
               "__str__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__", "equal", "allclose",
               "is_nonzero", "is_set_to", "_version", "__setstate__", "pin_memory",
               # not host reads, but changes to a tensor's fields that no replay would repeat
               "requires_grad_", "retain_grad", "register_hook", "share_memory_", "record_stream"}
_INPUT_IDS_METADATA = {"device", "dtype", "ndim", "dim", "is_cuda", "__len__"}
_FROM_HOST = {"tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "scalar_tensor"}
_METADATA_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous",
                 "is_non_overlapping_and_dense", "is_strides_like_format", "size", "stride", "numel"}
_TENSOR_RETURNS = {"Tensor", "Tensor[]", "Tensor?", "Tensor?[]"}
_FORBIDDEN_OPS = {"STORE_GLOBAL", "DELETE_GLOBAL", "IMPORT_NAME", "IMPORT_FROM", "IMPORT_STAR", "LOAD_NAME",
                  "STORE_NAME", "DELETE_NAME"}
_SCANS: dict = {}  # code object -> (global attribute paths it reads, why it cannot be proven): bytecode never changes


class _Unprovable(Exception):
    pass


def guard_for(processor) -> "Guard | None":
    """A `Guard` for one user processor for one generate() call, or None: run it eagerly, never capture it."""
    if torch.compiler.is_compiling() or sys.getprofile() is not None:
        return None
    try:
        _Snapshot().add(("processor", processor), {})  # state no fingerprint can see: no proof is possible
    except (_Unprovable, RecursionError):
        return None
    return Guard(processor)


class Guard:
    """What one observed call relied on. `unchanged()` says whether all of it still holds."""

    def __init__(self, processor):
        self.processor = processor
        self.capturable = None  # None until observed, then True or False for the rest of the call
        self.reason = "not observed yet"
        self._snapshot = None

    def observe(self, input_ids, scores):
        """This step's call of the processor, recorded; returns its result. Later calls just call it."""
        if self.capturable is not None or torch.compiler.is_compiling():
            return self.processor(input_ids, scores)
        if sys.getprofile() is not None:
            self._reject("another profiler is set: the call cannot be watched")
            return self.processor(input_ids, scores)
        rec = _Recorder(input_ids)
        rec.add_root(("processor", self.processor))
        try:
            with _FunctionWatch(rec), _DispatchWatch(rec):
                sys.setprofile(rec.profile)
                try:
                    out = self.processor(input_ids, scores)
                finally:
                    sys.setprofile(None)
        except BaseException:
            self._reject("it raised")
            raise
        self._conclude(rec, out)
        return out

    def _conclude(self, rec, out) -> None:
        if not isinstance(out, torch.Tensor) or out is rec.input_ids:
            rec.fail(f"it returned {'input_ids' if out is rec.input_ids else type(out).__name__}, not new scores")
        snapshot = rec.snapshot
        try:
            if rec.reason is None and not snapshot.holds():
                rec.fail("it changed state it can reach (an attribute, a global, a closure or a container)")
        except Exception as error:
            rec.fail(f"its state cannot be fingerprinted again ({type(error).__name__})")
        for code in rec.executed:  # all the Python it ran must be code whose reads the snapshot covers
            if rec.reason is None and not any(code is c or _nested_in(code, c) for c in snapshot.codes):
                rec.fail(f"it ran {code.co_name} ({code.co_filename}), not reached through state the guard sees")
        if rec.reason is not None:
            return self._reject(rec.reason)
        self._snapshot = snapshot
        self.capturable, self.reason = True, "pure on the observed call"

    def _reject(self, reason: str) -> None:
        self.capturable, self.reason, self._snapshot = False, reason, None

    def unchanged(self) -> bool:
        """True only if the processor was proven capturable and everything its observed call read is as it was."""
        if self._snapshot is None:
            return False
        try:
            return self._snapshot.holds()
        except Exception:  # a fingerprint that cannot be taken any more: changed
            return False


def _nested_in(code, outer) -> bool:
    return any(isinstance(c, types.CodeType) and (c is code or _nested_in(code, c)) for c in outer.co_consts)


def _scan(code):
    """The global attribute paths `code` reads (`torch.nn.functional.softmax`), and why it cannot be proven."""
    cached = _SCANS.get(code)
    if cached is not None:
        return cached
    paths, reason = [], None
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PRECALL", "EXTENDED_ARG")]
    for n, i in enumerate(ins):
        if i.opname in _FORBIDDEN_OPS:
            reason = f"{code.co_name} uses {i.opname} (writes or imports names)"
        elif i.opname == "LOAD_GLOBAL":
            path, k = [i.argval], n + 1
            while k < len(ins) and ins[k].opname in ("LOAD_ATTR", "LOAD_METHOD"):
                path.append(ins[k].argval)
                k += 1
            if k < len(ins) and ins[k].opname in ("STORE_ATTR", "DELETE_ATTR"):
                reason = f"{code.co_name} writes the attribute {ins[k].argval} of a global"
            paths.append(tuple(path))
    _SCANS[code] = result = (tuple(dict.fromkeys(paths)), reason)
    return result


class _Snapshot:
    """The state reachable from some roots: one node per mutable thing, each with a cheap identity fingerprint.

    A fingerprint holds the ids of what a node contains (an object's or class's `__dict__`, a list, a function's
    code, defaults and closure cells, a global's attribute path) or a tensor's metadata. The snapshot keeps every
    object it met alive, so no new object can take an old id: equal fingerprints mean the same objects in the same
    places, and by induction the same state. An attribute rebound to an equal but new object counts as a change (a
    needless recapture, never a stale replay).
    """

    def __init__(self):
        self.nodes = [(_fp_torch_state, None, _fp_torch_state(None))]
        self.keep, self.codes, self._seen = [], set(), set()

    def holds(self) -> bool:
        for fingerprint, obj, expected in self.nodes:
            if fingerprint(obj) != expected:
                return False
        return True

    def _node(self, fingerprint, obj) -> None:
        if len(self.nodes) >= _NODES:
            raise _Unprovable("its state is too large to check at every step")
        self.nodes.append((fingerprint, obj, fingerprint(obj)))

    def _own(self, inner) -> None:  # a dict fingerprinted by its owner's node: walk it, no node of its own
        self._seen.add(id(inner))
        self.keep.append(inner)
        for item in list(inner.items()):
            self.freeze(item)

    def add(self, root, globals_of) -> None:
        kind, value = root
        if kind == "processor":
            return self.freeze(value)
        where = (*globals_of[value[0]], value[1])  # (globals, builtins, path) of an executed code object
        self._node(_fp_path, where)
        try:
            value = _walk_path(*where)[-1]
        except (KeyError, AttributeError):
            return
        if isinstance(value, types.ModuleType) and not _trusted(value.__name__):
            raise _Unprovable(f"it uses the module {value.__name__} as a value")
        self.freeze(value)

    def freeze(self, v) -> None:
        t = type(v)
        if v is None or t in _LEAVES or id(v) in self._seen:
            return
        self._seen.add(id(v))
        self.keep.append(v)  # no new object can take the id of one we compare while the guard lives
        if len(self._seen) > _LIMIT:
            raise _Unprovable("its state is too large to check at every step")
        if isinstance(v, torch.Tensor):
            if t not in (torch.Tensor, torch.nn.Parameter) and not getattr(t, "_is_buffer", False):
                raise _Unprovable(f"it holds a tensor subclass {t.__name__}")
            if v.is_cpu and v.numel() > _CPU_VALUES:
                raise _Unprovable("it holds a large CPU tensor, whose values a capture could bake in")
            self._node(_fp_tensor, v)
        elif isinstance(v, tuple) and not hasattr(v, "__dict__") and not _slots(t):  # immutable: ids in its parent
            self.freeze(t)
            for item in v:
                self.freeze(item)
        elif t in (list, set, frozenset, dict, collections.OrderedDict):
            self._node(_fp_dict if isinstance(v, dict) else _fp_set if isinstance(v, (set, frozenset)) else _fp_seq, v)
            for item in (list(v.items()) if isinstance(v, dict) else list(v)):
                self.freeze(item)
        elif t is types.FunctionType:
            self.codes.add(v.__code__)
            self._node(_fp_function, v)
            self._own(v.__dict__)
            for part in (v.__defaults__, v.__kwdefaults__, *(_cell(c) for c in v.__closure__ or ())):
                self.freeze(part)
        elif t is types.MethodType:
            self.freeze(v.__func__)
            self.freeze(v.__self__)
        elif t is types.BuiltinFunctionType:
            if not isinstance(v.__self__, (types.ModuleType, type, type(None))):
                self.freeze(v.__self__)  # a bound C method of a value, e.g. `self.ids.append`
        elif t in (staticmethod, classmethod):
            self.freeze(v.__func__)
        elif t is property:
            for part in (v.fget, v.fset, v.fdel):
                self.freeze(part)
        elif t.__name__ == "partial" and t.__module__ == "functools":
            for part in (v.func, v.args, v.keywords, getattr(v, "__dict__", None)):
                self.freeze(part)
        elif isinstance(v, types.ModuleType):
            if not _trusted(v.__name__):
                raise _Unprovable(f"it holds the module {v.__name__}, whose attributes it may read")
        elif isinstance(v, type):
            if _python_class(v) and not _trusted(v.__module__):  # C and trusted classes: identity is enough
                self._node(_fp_class, v)  # its bases, class attributes, methods, `__call__` and its code
                for part in (type(v), *v.__mro__[1:]):
                    self.freeze(part)
                self._own(v.__dict__)
        elif t not in _C_DESCRIPTORS:  # C descriptors never change
            if not all(base is object or _python_class(base) for base in t.__mro__):
                raise _Unprovable(f"it holds a {t.__name__}, whose state lives in C")
            attributes = getattr(v, "__dict__", None)
            self._node(_fp_object, v)
            self.freeze(t)
            if type(attributes) is dict:
                self._own(attributes)
            for slot in _slots(t):
                self.freeze(getattr(v, slot, None))


_LEAVES = frozenset((bool, int, float, str, bytes, complex, torch.dtype, torch.device, torch.layout,
                     torch.memory_format, type(Ellipsis), type(NotImplemented), types.CodeType, range, slice,
                     types.UnionType, types.GenericAlias))  # immutable all the way down
_C_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
                  types.MemberDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType,
                  type(collections.namedtuple("_", "a").a))  # a namedtuple's field getters
_EMPTY = object()
_SLOTS: dict = {}
_PYTHON_CLASSES: dict = {}


def _trusted(module_name) -> bool:
    return str(module_name or "").split(".")[0] in _TRUSTED


def _python_class(cls) -> bool:
    """Made by a class statement: its instances' state is their `__dict__` and slots. A C extension's classes are
    heap types too, but their state is a C struct no fingerprint sees, which shows as a larger instance size."""
    known = _PYTHON_CLASSES.get(cls)
    if known is None:
        bases = [b for b in cls.__bases__ if b is not object]
        own = cls.__dict__.get("__slots__", ())
        own = [own] if isinstance(own, str) else [n for n in own if n not in ("__dict__", "__weakref__")]
        grown = cls.__basicsize__ - max((b.__basicsize__ for b in cls.__bases__), default=object.__basicsize__)
        known = _PYTHON_CLASSES[cls] = bool(
            cls.__flags__ & (1 << 9) and all(_python_class(b) for b in bases)  # Py_TPFLAGS_HEAPTYPE
            and 0 <= grown <= 8 * (len(own) + 2)  # slots, then at most a dict and a weakref pointer
            and (cls.__dictoffset__ != 0 or "__slots__" in cls.__dict__))
    return known


def _slots(cls) -> tuple:
    names = _SLOTS.get(cls)
    if names is None:
        names = []
        for base in cls.__mro__:
            declared = base.__dict__.get("__slots__", ())
            names += [declared] if isinstance(declared, str) else list(declared)
        _SLOTS[cls] = names = tuple(n for n in names if n not in ("__dict__", "__weakref__"))
    return names


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _ids(d):
    return tuple(map(id, d)), tuple(map(id, d.values()))


def _fp_torch_state(_):
    return torch.get_default_dtype(), torch.is_grad_enabled()


def _fp_dict(d):
    return _ids(d)


def _fp_seq(s):
    return tuple(map(id, s))


def _fp_set(s):
    return frozenset(map(id, s))


def _fp_function(f):
    return (id(f.__code__), id(f.__defaults__), id(f.__kwdefaults__), id(f.__dict__), _ids(f.__dict__),
            tuple(id(_cell(c)) for c in f.__closure__) if f.__closure__ else ())


def _fp_class(c):
    return id(type(c)), id(c.__mro__), _ids(c.__dict__)


def _fp_object(o):
    d = getattr(o, "__dict__", None)
    return (id(type(o)), id(d), _ids(d) if type(d) is dict else None,
            tuple(id(getattr(o, s, _EMPTY)) for s in _slots(type(o))))


def _fp_tensor(t):
    # the graph reads device memory live: only where and how it reads must stay. A CPU tensor's values are baked
    # into the launches at capture (a 0-dim operand), so they are compared too (`.data` writes skip `_version`)
    return (t.dtype, t.device, t.shape, t.stride(), t.storage_offset(), t.untyped_storage().data_ptr(),
            t.tolist() if t.is_cpu else None)


def _walk_path(globs, builtins_, path):
    value = globs[path[0]] if path[0] in globs else builtins_[path[0]]
    values = [value]
    for name in path[1:]:
        if not isinstance(value, (types.ModuleType, type)):
            break  # the attributes of an object: the object's own nodes cover them
        value = getattr(value, name)
        values.append(value)
    return values


def _fp_path(where):
    try:
        return tuple(map(id, _walk_path(*where)))
    except (KeyError, AttributeError):
        return None
_TORCH_OPS: set = set()


def _pure_c(fn) -> bool:
    """A C function user code may call: a tensor op (the modes check it), a pure builtin, a method of a value (one
    that changes reachable state is caught by the before/after compare)."""
    if not _TORCH_OPS:
        for owner in (torch._C._VariableFunctions, torch._C._nn, torch._C._special, torch._C._linalg, torch._C._fft):
            _TORCH_OPS.update(id(f) for f in map(lambda n: getattr(owner, n, None), dir(owner))
                              if isinstance(f, types.BuiltinFunctionType))
    owner = getattr(fn, "__self__", None)
    return (isinstance(owner, (torch.Tensor, *_VALUE_TYPES)) or id(fn) in _PURE_BUILTINS or id(fn) in _TORCH_OPS
            or (isinstance(owner, types.ModuleType) and owner.__name__ in _PURE_MODULES))


def _kind_of(code) -> str:
    name = code.co_filename
    if name == __file__:
        return "self"
    if name.startswith(_TORCH_DIR):
        return "torch"
    if name.startswith(_STDLIB + ("<frozen",)) and "-packages" + os.sep not in name:
        return "stdlib"
    return "user"


class _Recorder:
    """What one observed call did. `reason`: the first thing found that rules out a capture."""

    def __init__(self, input_ids):
        self.input_ids = input_ids
        self.reason = None
        self.globals_of, self.executed = {}, set()
        self.snapshot = _Snapshot()  # nodes added as the call reaches them, fingerprinted before it can change them
        self.fresh, self._alive = set(), []  # storages of the tensors the call made (kept alive: no address reuse)
        self.internal = False  # the recorder's own Python is running: nothing to record

    def fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def add_root(self, root) -> None:
        self.internal = True
        try:
            self.snapshot.add(root, self.globals_of)
        except (_Unprovable, RecursionError) as error:
            self.fail(str(error) or type(error).__name__)
        finally:
            self.internal = False

    def _kind(self, frame) -> str:
        kind = _kind_of(frame.f_code)
        back = frame.f_back  # the standard library runs as its caller: as user code when user code called it
        while kind == "stdlib" and back is not None:
            kind, back = _kind_of(back.f_code), back.f_back
        if frame.f_code.co_filename == __file__:
            return "self"
        return {"stdlib": "torch", "self": "user"}.get(kind, kind)  # below `observe`: the processor's own call

    def profile(self, frame, event, arg):
        if self.reason is not None or self.internal:
            return
        try:
            if event == "call":
                kind = self._kind(frame)
                if kind == "user" and frame.f_code not in self.executed:
                    self._enter(frame)
                elif kind == "torch" and frame.f_back is not None and self._kind(frame.f_back) == "user":
                    module = frame.f_globals.get("__name__", "")
                    if not module.startswith(_TORCH_ENTRIES):
                        self.fail(f"it calls {module}.{frame.f_code.co_name}")
            elif event == "c_call" and self._kind(frame) == "user" and not _pure_c(arg):
                self.fail(f"it calls {getattr(arg, '__qualname__', arg)!r}, not known to be pure")
        except Exception as error:  # never disturb the call: no proof instead
            self.fail(f"the watch failed ({type(error).__name__}: {error})")

    def _enter(self, frame) -> None:
        code = frame.f_code
        self.executed.add(code)
        paths, reason = _scan(code)
        if reason is not None:
            return self.fail(reason)
        self.globals_of.setdefault(code, (frame.f_globals, frame.f_builtins))
        for path in paths:  # a global is fingerprinted before the code that reads it runs
            self.add_root(("path", (code, path)))

    # --- torch functions (the Python API) ----------------------------------------------------------------------
    def check_function(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", "")
        if name in ("__set__", "__delete__"):  # `t.data = ...`, `t.grad = ...`: the call changes a tensor's fields
            return self.fail(f"it sets a tensor's {getattr(getattr(func, '__self__', None), '__name__', '?')}")
        if name == "__get__":  # a tensor property, e.g. `.shape`
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _HOST_READS:
            return self.fail(f"it reads the host ({name})")
        if name in _FROM_HOST and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            return self.fail(f"it sends host data to the device ({name}): a CUDA graph cannot replay that copy")
        if any(leaf is self.input_ids for leaf in tree_leaves((args, kwargs))) and not (
                name in _INPUT_IDS_METADATA
                or (name == "size" and (args[1:2] or [kwargs.get("dim")])[0] in (0, -self.input_ids.dim()))
                or (name == "shape" and self._takes_batch(sys._getframe(1)))):
            self.fail(f"it reads input_ids ({name}): the graph replays a fixed view, not the growing sequence")

    def _takes_batch(self, frame) -> bool:
        """Whether the user code reading `input_ids.shape` takes `[0]` of it at once (the batch size: constant)."""
        while frame is not None and _kind_of(frame.f_code) != "user":
            frame = frame.f_back
        if frame is None:
            return False
        ins = [i for i in dis.get_instructions(frame.f_code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
        at = next((n for n, i in enumerate(ins) if i.offset == frame.f_lasti), None)
        if at is None or at + 2 >= len(ins) or ins[at].argval != "shape":
            return False
        index, subscript = ins[at + 1], ins[at + 2]
        return (index.opname in ("LOAD_CONST", "LOAD_SMALL_INT") and type(index.argval) is int
                and index.argval in (0, -self.input_ids.dim())
                and (subscript.opname == "BINARY_SUBSCR"
                     or (subscript.opname == "BINARY_OP" and subscript.argrepr.strip() == "[]")))

    # --- aten ops (the dispatcher) -----------------------------------------------------------------------------
    def check_op(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        if torch.Tag.data_dependent_output in func.tags:
            return self.fail(f"it reads the host ({name})")
        if torch.Tag.dynamic_output_shape in func.tags and (name not in ("index", "_unsafe_index")
                                                            or _bool_indices(args)):
            return self.fail(f"its output shape depends on values ({name}): the host must read them")
        if name in ("index_put", "index_put_", "_index_put_impl_") and _bool_indices(args):
            return self.fail(f"it indexes with a boolean mask ({name}): the host must read it")
        if any(str(r.type) not in _TENSOR_RETURNS for r in func._schema.returns) and name not in _METADATA_OPS:
            return self.fail(f"it reads the host ({name} returns a Python value)")
        bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        if bound.get("generator") is not None:
            return self.fail("it draws from an explicit torch.Generator, which a CUDA graph does not advance")
        if (name == "_to_copy" and bound.get("device") is not None and torch.device(bound["device"]) != args[0].device
                or name in ("copy_", "_copy_from", "_copy_from_and_resize") and args[0].device != args[1].device):
            return self.fail("it copies between devices")
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                for t in tree_leaves(bound.get(a.name)):
                    if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in self.fresh:
                        return self.fail(f"it writes in place ({name}) a tensor it did not create in the call")

    def note_fresh(self, func, out) -> None:
        if func._schema.name != "aten::lift_fresh" and any(r.alias_info is not None for r in func._schema.returns):
            return  # a view or an in-place result: no new memory
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.fresh.add(t.untyped_storage().data_ptr())
                self._alive.append(t)


def _bool_indices(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.internal and rec.reason is None:
            rec.internal = True
            try:
                rec.check_function(func, args, kwargs)
            except Exception as error:  # never disturb the call: no proof instead
                rec.fail(f"the watch failed ({type(error).__name__}: {error})")
            finally:
                rec.internal = False
        return func(*args, **kwargs)


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        if not rec.internal:
            rec.internal = True
            try:
                if rec.reason is None:
                    rec.check_op(func, args, kwargs)
                rec.note_fresh(func, out)
            except Exception as error:
                rec.fail(f"the watch failed ({type(error).__name__}: {error})")
            finally:
                rec.internal = False
        return out
