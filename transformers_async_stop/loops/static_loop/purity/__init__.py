"""Which undeclared user logits processors the captured tail may replay: proven pure on one real call, then guarded.

A CUDA graph replays the kernels a processor launched at capture and none of its Python. A processor may be replayed
only if its Python, run again, would launch the same kernels on the same memory and change nothing else. That holds
when it reads only state that stays the same (its attributes, its class, the globals and closures of the code it
runs, tensor metadata constant within a call), never a tensor's values on the host nor the length of `input_ids`,
and writes nothing but tensors it creates. This package proves that on one call and checks before each replay that
the state it read is unchanged (`recorder.py` watches the call, `snapshot.py` fingerprints the state).

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
- draws from an explicit `torch.Generator`, or from any generator but the default one of the device of its inputs
  (a CPU draw such as `torch.rand(())` would be made once at capture and its value baked in). Only the device's
  default generator is registered to a CUDA graph (`CUDAGraph::capture_begin`; `CUDAGeneratorState` keeps a
  per-capture philox offset that each replay advances, see ATen/cuda/CUDAGeneratorImpl.h), so its draws in a replay
  are the ones eager would make. Seeding or reading a generator's state (`torch.manual_seed`, `get_rng_state`,
  `fork_rng`, `Generator.manual_seed`) runs torch Python outside the allowed entries or a C method of a generator:
  refused like any other such call, as are Python's `random` and NumPy's (modules and C objects, below);
- changes state it can reach (attributes, class attributes, globals, closures, defaults, containers, and the Python
  attributes of the tensors it holds: fingerprinted before the call, compared after), writes a global, imports, or
  raises (the exception propagates, as in stock);
- keeps or reads state as Python attributes on the tensors it is given or returns (`scores._mark = n`): a tensor's
  attributes are read and written without any Python or torch function the instruments see, and stock hands out
  new tensors each step. A processor whose inputs carry attributes, or that leaves one on its inputs or result, is
  refused;
- writes, through an alias, the namespace of a module or a trusted class (`type(scores).n += 1`,
  `f = torch.nn.functional; f.n = 1`; the globals of any function met, builtins, `torch.Tensor`: compared once
  after the call), reaches a namespace or frame by name (`__globals__`, `f_globals`, `tb_frame`, `__self__`, ...),
  or reads a tensor's `.grad` or `grad_fn` (C fields user code may rebind between steps);
- runs Python code not reached through the snapshotted state, calls into torch modules other than the tensor ops
  and `nn.Module` machinery, or calls a C function not known to be pure (`print`, `time.time`, `random.random`);
- holds state no fingerprint can see: objects of C types other than tensors, containers, functions and scalars;
  tensor subclasses; more than `_LIMIT` objects or `_NODES` fingerprints; a CPU tensor over `_CPU_VALUES` elements.
  (`guard_for` already returns None for such state; a Guard from `guard_for` means "can be judged", not "pure".)

The snapshot holds one node per mutable thing the call could read: the processor, its classes (with the `__call__`
code), the globals and attribute paths each executed code object reads, closures, defaults, containers, tensors
(identity, storage, shape, strides; a CPU tensor's values too, as capture bakes a 0-dim CPU operand into the launch),
torch's default dtype and grad mode, and the global module hooks when it holds an `nn.Module` (its call runs
them). Deterministic Python that reads the same state and the same tensor metadata
takes the same path, so a capture made while `unchanged()` holds launches what `observe` saw. A CUDA tensor in the
state may be written in place between steps: the graph reads its memory live, as eager would.

Trusted, unchecked: torch's own Python (not monkeypatched during a call; torch modules and classes compared by
identity only at a replay: an attribute a user adds to one between steps and a processor reads through an alias, or
a function's globals read through a computed attribute name, are not seen). Under `torch.compiler.is_compiling()`
nothing is instrumented. While another profiler is set (`sys.getprofile()`) nothing is proven, and every processor
runs eagerly.
"""

from __future__ import annotations

import sys
import types

import torch

from .recorder import _DispatchWatch, _FunctionWatch, _Recorder
from .snapshot import _Snapshot, _Unprovable

__all__ = ["Guard", "guard_for"]


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
        if _tagged(input_ids, scores):  # it may read them (`getattr(scores, "_mark", 0)`) unseen: no proof
            rec.fail("its inputs carry Python attributes or a class, which it may read and a capture would bake in")
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
        self._conclude(rec, out, scores)
        return out

    def _conclude(self, rec, out, scores) -> None:
        if not isinstance(out, torch.Tensor) or out is rec.input_ids:
            rec.fail(f"it returned {'input_ids' if out is rec.input_ids else type(out).__name__}, not new scores")
        elif _tagged(rec.input_ids, scores, out):  # a replay sets no attribute: stock's fresh tensors would carry it
            rec.fail("it set a Python attribute or the class of a tensor it was given or returns (`scores._m = 1`)")
        snapshot = rec.snapshot
        try:
            if rec.reason is None and not snapshot.holds():
                rec.fail("it changed state it can reach (an attribute, a global, a closure or a container)")
        except Exception as error:
            rec.fail(f"its state cannot be fingerprinted again ({type(error).__name__})")
        if rec.reason is None and not snapshot.trusted_held():
            rec.fail("it changed a module's globals, or a torch or standard class, through an alias")
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


def _tagged(*tensors) -> bool:
    """Whether any of these tensors has Python attributes (a `__dict__` entry) or a class other than a plain tensor
    (`scores.__class__ = Sub`), which no fingerprint of the call covers: attribute reads and writes on a tensor run no
    Python and no torch function the instruments could see."""
    return any(isinstance(t, torch.Tensor) and (t.__dict__ or type(t) is not torch.Tensor) for t in tensors)


def _nested_in(code, outer) -> bool:
    return any(isinstance(c, types.CodeType) and (c is code or _nested_in(code, c)) for c in outer.co_consts)
