"""The instruments of one observed call: what it ran, read and wrote (`_Recorder`), fed by a `TorchFunctionMode`
(the tensor Python API), a `TorchDispatchMode` (the aten ops) and a `sys.setprofile` hook (the Python and C calls).
"""

from __future__ import annotations

import dis
import os
import sys
import sysconfig
import types

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ....graphs.backend import emulates
from .snapshot import _Snapshot, _Unprovable

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB = tuple({p + os.sep for p in (sysconfig.get_paths()["stdlib"],
                                      os.path.realpath(sysconfig.get_paths()["stdlib"]))})
# every file of the package, not only this one: `Guard.observe` (`__init__.py`) calls the processor, and the profile
# hook must tell it, and the snapshot's walks, from the processor's own code
_OWN_DIR = os.path.dirname(__file__) + os.sep
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
               "requires_grad_", "retain_grad", "register_hook", "share_memory_", "record_stream",
               "register_post_accumulate_grad_hook"}
# a tensor's C fields that hold other objects, which user code may rebind between steps unseen by any fingerprint
_C_FIELDS = {"grad", "_grad", "grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks"}
_INPUT_IDS_METADATA = {"device", "dtype", "ndim", "dim", "is_cuda", "__len__"}
_FROM_HOST = {"tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "scalar_tensor"}
_METADATA_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous",
                 "is_non_overlapping_and_dense", "is_strides_like_format", "size", "stride", "numel"}
_TENSOR_RETURNS = {"Tensor", "Tensor[]", "Tensor?", "Tensor?[]"}
_FORBIDDEN_OPS = {"STORE_GLOBAL", "DELETE_GLOBAL", "IMPORT_NAME", "IMPORT_FROM", "IMPORT_STAR", "LOAD_NAME",
                  "STORE_NAME", "DELETE_NAME"}
# attributes that reach a namespace or a frame no fingerprint covers (`f.__globals__["n"] += 1`,
# `error.__traceback__.tb_frame.f_globals`): read or named as a constant (`getattr(f, "__globals__")`), no proof
_INTROSPECTION = frozenset(("__globals__", "__builtins__", "f_globals", "f_locals", "f_builtins", "f_back", "tb_frame",
                            "gi_frame", "cr_frame", "ag_frame", "__self__"))
_SCANS: dict = {}  # code object -> (global attribute paths it reads, why it cannot be proven): bytecode never changes


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
        elif (i.opname in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR", "LOAD_CONST", "LOAD_SUPER_ATTR")
              and type(i.argval) is str and i.argval in _INTROSPECTION):
            reason = f"{code.co_name} reaches {i.argval}, a namespace or frame the guard cannot fingerprint"
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


def _own(code) -> bool:
    return code.co_filename.startswith(_OWN_DIR)


def _kind_of(code) -> str:
    name = code.co_filename
    if _own(code):
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
        if _own(frame.f_code):
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
        if name in _C_FIELDS:
            return self.fail(f"it reads a tensor's {name}, which may be rebound between steps")
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
        # `out[m] = v` on torch 2.13: the kernel turns the mask into indices (on CUDA a host read, and a capture would
        # keep the capture step's mask). torch 2.15 dispatches it as `masked_fill_`, a device kernel: nothing to reject
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

    def check_draw(self, func, args, kwargs, out) -> None:
        """A random op may be captured only if it draws from the default generator of the device the graph is
        captured on: the one CUDA generator a graph registers and advances at each replay. A draw from the CPU
        generator (`torch.rand(())` as a jitter) would be made once at capture and its value baked in."""
        if torch.Tag.nondeterministic_seeded not in func.tags and not any(
                a.name == "generator" for a in func._schema.arguments):
            return
        device = self.input_ids.device
        # the CPU's generator is a graph's only in the tests' emulation, which replays the draw as eager makes it
        graph_device = device.type == "cuda" or emulates(device)
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and (not graph_device or t.device != device):
                name = func._schema.name.split("::")[-1]
                return self.fail(f"it draws ({name}) from the {t.device.type} generator, not the graph's device's")

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
                if rec.reason is None:
                    rec.check_draw(func, args, kwargs, out)
                rec.note_fresh(func, out)
            except Exception as error:
                rec.fail(f"the watch failed ({type(error).__name__}: {error})")
            finally:
                rec.internal = False
        return out
