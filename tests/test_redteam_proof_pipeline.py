"""Red team of the proof as one pipeline (issue 43: e7c2384, 995221e): docs/red-team/2026-11-29-proof-pipeline.md.

The principle under test: a replay is sound only for the code objects the proof saw run, and for the state those
objects can read. Each case is a tiny random-weight model (tests/models.py, tests/family_models.py: Llama and Gemma 3
read by hand, OLMo found) on the CPU with the CUDA graphs emulated. It is recorded by one or two calls (a found family
confirms its first recording at the next position), then something the recorded forward ran or read is changed, and
the flag is run against unpatched stock (`models.stock()`), comparing sequences and logits.

The tests marked `# HOLE n` fail on today's code: the flag replays what stock no longer computes (or, for the two
retry cases, never takes the graphed forward again, or records at every step). The others are attempts that held.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
import unittest
import warnings
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from family_models import build_family
from models import TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _generate
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
_MODULES = {"llama": "transformers.models.llama.modeling_llama", "olmo": "transformers.models.olmo.modeling_olmo"}


def _set_act(model, act) -> None:
    """Every MLP's activation replaced by `act` (a plain attribute: the module `ACT2FN` made is taken out)."""
    for layer in model.model.layers:
        del layer.mlp.act_fn
        layer.mlp.act_fn = act


class _EachStep(LogitsProcessor):
    def __init__(self, action):
        self.action, self.calls = action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        self.action(self.calls)
        return scores


@contextlib.contextmanager
def _installed(module, name, value):
    """`value` as `module.name`, as if installed before this process first saw the name (a patch applied at import,
    as Liger-Kernel and source rewriters apply theirs: the rebinding check has nothing earlier to compare with)."""
    with mock.patch.object(module, name, value), mock.patch.dict(proof.names._FIRST_SEEN, clear=True):
        yield


@contextlib.contextmanager
def _aten_kernel(op: str, kernel, key: str):
    """`kernel` registered from Python for the ATen op `op` under the dispatch key `key`, taken out afterwards."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        library = torch.library.Library("aten", "IMPL")
        library.impl(op, kernel, key)
    try:
        yield library
    finally:
        library._destroy()


class _Base(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)

    def _same(self, model, calls=2, before=lambda call: None, **kwargs):
        """`calls` calls of stock and of the flag, `before(call)` run before each (the same state for stock's call and
        the flag's); equal sequences and logits. The flag's last path."""
        for call in range(calls):
            before(call)
            with stock():
                ref, _ = _generate(model, self.ids, self.mask, None, **_KW, **kwargs)
            before(call)
            out, _ = _generate(model, self.ids, self.mask, True, **_KW, **kwargs)
            self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
            for a, b in zip(ref.logits, out.logits):
                self.assertTrue(torch.equal(a, b), "logits differ from stock")
        return tas.last_path().forward

    def _warm(self, model):
        why = self._same(model)  # a found family's first recording is confirmed at the next position: two calls
        self.assertTrue(why.startswith("graphed"), why)

    def _refused(self, model, reason):
        """The fix of a hole that refuses the recording: equal to stock, and eager with `reason` named."""
        why = self._same(model)
        self.assertIn(reason, why)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class CodeThatRanButIsNotWatched(_Base):
    """Stage 4 hands over the code state (`callables.CallableState`) of the functions it names, not of every function
    the recording ran."""

    # HOLE 1: torch's own Python functions are compared by identity only. `hand_over` puts the torch names the
    # forward's code looks up (`names.watched_functions`: `F.silu` for `SiLUActivation.forward`) and torch's module
    # internals into `ModelGraphs.functions` (identity), and `ModelGraphs.watch` makes code roots only of the names a
    # verdict adds that are not there already (`fresh`): no torch function's `__code__` / `__defaults__` is ever a root
    # of `CallableState`. Torch's frames are not traced either (`watch.kind_of` -> "torch"). So `F.silu.__code__`
    # replaced in place (IPython's `%autoreload` of a patched torch, a rewriter) after the recording: the object is the
    # same, stock's next forward runs the new code, the flag replays the old kernels.
    def test_a_torch_functions_code_replaced_in_place_between_calls_is_followed(self):
        def silu_doubled(input, inplace=False):
            return torch._C._nn.silu(input) * 2

        for family in ("llama", "olmo"):
            with self.subTest(family=family):
                model = build_family(family)
                self._warm(model)
                silu = torch.nn.functional.silu
                original = silu.__code__
                silu.__code__ = silu_doubled.__code__
                try:
                    self._same(model, calls=1)
                finally:
                    silu.__code__ = original

    # HOLE 1 (b): a transformers function reached by attribute, not by a global name, is no root of `CallableState`
    # either: the roots are the objects under the names the code that ran looks up in its module (`verdict._looked_up`),
    # the rebinding list's objects (`names.watched`: module classes' methods) and the modules' callable attributes. The
    # recording ran `PreTrainedConfig.__getattribute__` at every config read (`self.config.clip_qkv`), found through the
    # config's class: its `__code__` replaced in place (what `%autoreload` does to a method of an edited module) is
    # unseen, and the config class is not in the snapshot's class tables either (hole 6).
    def test_a_config_method_whose_code_is_replaced_in_place_between_calls_is_followed(self):
        from transformers.configuration_utils import PreTrainedConfig

        class Edited:
            def __getattribute__(self, key):  # the file's method, with one line added (`super()`: one free variable)
                if key == "clip_qkv":
                    return 0.05
                if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
                    key = super().__getattribute__("attribute_map")[key]
                return super().__getattribute__(key)

        model = build_family("olmo")
        self._warm(model)
        method = PreTrainedConfig.__getattribute__
        original = method.__code__
        method.__code__ = vars(Edited)["__getattribute__"].__code__
        try:
            self._same(model, calls=1)
        finally:
            method.__code__ = original

    # HOLE 2: a function is watched in the module its globals *name*, not in the globals it runs with. `watch._call`
    # keeps `frame.f_globals["__name__"]`, and `verdict._looked_up` / `names.watched` then read
    # `vars(sys.modules[name])`. A patcher that copies a function with a copy of its module's globals
    # (`types.FunctionType(f.__code__, dict(vars(module)), ...)`, or a source rewriter's `exec` into such a copy) runs
    # code the file's text compiles to (`identity.why_not_file_code` passes), with transformers' file name, yet every
    # global it looks up comes from a dict nobody compares: `scope["rotate_half"] = ...` after the recording is unseen.
    def test_a_function_run_with_a_copy_of_its_modules_globals_is_followed(self):
        for family in ("llama", "olmo"):
            with self.subTest(family=family):
                module = importlib.import_module(_MODULES[family])
                model = build_family(family)
                inner = inspect.unwrap(module.apply_rotary_pos_emb)
                scope = dict(vars(module))  # the patcher's copy of the module's globals
                copied = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__,
                                            inner.__closure__)
                original = module.rotate_half
                with _installed(module, "apply_rotary_pos_emb", copied):
                    self._refused(model, "globals other than its module's")
                    scope["rotate_half"] = lambda x: original(x) * 2
                    self._same(model, calls=1)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class StateBehindCallables(_Base):
    """`callables.CallableState` follows functions, partials, methods and containers, and takes callables of torch's,
    transformers' and the standard library's own types as stateless."""

    # HOLE 3: a torch module outside the model, reached through a callable, is taken as stateless. `_STATELESS` holds
    # `torch.nn.Module` ("their state is the module snapshot's"), but the snapshot holds the model's modules only:
    # `functools.partial(torch.nn.Softplus(beta=1.0))` as an activation (`default_deny._why_instance` refuses an
    # unregistered *module* in a `__dict__`, not a partial holding one) runs torch's own code (untraced) and reads
    # `self.beta`, which the recording baked in as a scalar. `softplus.beta = 3.0` after it is unseen.
    def test_a_torch_module_inside_a_partial_edited_between_calls_is_followed(self):
        for family in ("llama", "olmo"):
            with self.subTest(family=family):
                model = build_family(family)
                softplus = torch.nn.Softplus(beta=1.0)
                _set_act(model, functools.partial(softplus))
                self._warm(model)
                softplus.beta = 3.0
                self._same(model, calls=1)

    # HOLE 3 (a bound method): `CallableState` follows a method's `__func__` and drops its `__self__`; a bound method
    # of a module outside the model (`mlp.act_fn = softplus.forward`) is not a module in a `__dict__` either.
    def test_a_bound_method_of_a_module_outside_the_model_edited_between_calls_is_followed(self):
        model = build_family("llama")
        softplus = torch.nn.Softplus(beta=1.0)
        _set_act(model, softplus.forward)
        self._warm(model)
        softplus.beta = 3.0
        self._same(model, calls=1)

    # HOLE 3 (a tensor): a tensor a callable holds (a partial's keyword, a bound builtin's `__self__`) is in no list of
    # the snapshot's tensors (`ModelGraphs.tensors`: parameters, buffers and tensor attributes of the modules and
    # configs), so its storage rebound (`t.data = ...`) after the recording is unseen: the replay reads the old
    # memory, as a CUDA graph reads the old address.
    def test_a_tensor_held_by_a_partial_rebound_between_calls_is_followed(self):
        model = build_family("llama")
        scale = torch.full((64,), 1.0)
        _set_act(model, functools.partial(torch.mul, other=scale))
        self._warm(model)
        scale.data = torch.full((64,), 2.0)
        self._same(model, calls=1)

    # HOLE 4: a subclass of `functools.partial` is compared as a partial (`isinstance`): its function, arguments and
    # keywords, not its class. `__call__` set on the subclass after the recording (a partial's call is C code: nothing
    # of it was traced) is what stock's next forward runs; no class table of it is in the snapshot.
    def test_a_partial_subclass_given_a_call_between_calls_is_followed(self):
        class Activation(functools.partial):
            pass

        model = build_family("llama")
        _set_act(model, Activation(torch.nn.functional.silu))
        self._refused(model, 'whose state the proof cannot read')
        Activation.__call__ = lambda self, x: torch.sigmoid(x)
        self._same(model, calls=1)

    # held: a partial inside a torch decorator's closure (`torch.no_grad()(partial)`): the wrapper is a function (its
    # closure is followed), the partial's keywords are compared
    def test_a_partial_in_a_closure_edited_between_calls_is_followed(self):
        model = build_family("llama")
        act = functools.partial(torch.nn.functional.gelu, approximate="tanh")
        _set_act(model, torch.no_grad()(act))
        self._warm(model)
        act.keywords["approximate"] = "none"
        self._same(model, calls=1)

    # held: a TorchScript function as the activation (no Python runs in it; its globals were frozen when scripted, for
    # stock as for the flag)
    def test_a_scripted_function_as_an_activation_is_replayed_exactly(self):
        @torch.jit.script
        def act(x):
            return torch.nn.functional.silu(x) * 1.5

        model = build_family("llama")
        _set_act(model, act)
        self.assertTrue(self._same(model).startswith("graphed"), tas.last_path().forward)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class KernelsRegisteredForOps(_Base):
    """What the dispatcher runs for an ATen op is not part of the snapshot."""

    # HOLE 5: a Python kernel registered for an ATen op (`torch.library.Library("aten", "IMPL").impl(...)`) before the
    # first call is refused when its Python runs (`watch.py` sees a foreign frame); a C-level one is not: a
    # `functools.partial` of an op overload runs no Python frame. Registered under `AutogradCPU` (above the Python
    # dispatch key, so the op log and the capture see the ops it dispatches, here `aten.sigmoid` for `aten.silu`), its
    # target swapped through `__setstate__` after the recording: stock runs the new kernel (`tanh`), the flag replays
    # the recorded `sigmoid`. No registration (`torch.library._impls`, the kernel objects) is in the snapshot or the key.
    # On CUDA the same holds for a kernel under `CUDA` or `AutogradCUDA`.
    def test_an_aten_kernel_swapped_between_calls_is_followed(self):
        kernel = functools.partial(torch.ops.aten.sigmoid.default)
        model = build_family("llama")
        with _aten_kernel("silu", kernel, "AutogradCPU"):
            self._refused(model, 'from outside torch')
            kernel.__setstate__((torch.ops.aten.tanh.default, (), {}, None))
            self._same(model, calls=1)

    # HOLE 5 (registered after the recording): a kernel registered for an op the recording captured, after it, is what
    # stock's next forward runs; a CUDA graph replays the kernels it captured. The emulation cannot show the difference
    # (its replay dispatches each recorded op again, through the new kernel), so this asserts what the package decides:
    # a recording made before the registration must not be replayed after it (recorded again, or eager).
    def test_an_aten_kernel_registered_between_calls_is_not_replayed_over(self):
        model = build_family("llama")
        self._warm(model)
        replayed = []
        for recording in list(forward.graphs_of(model).recordings.values()):
            recording.replay = functools.partial(
                lambda original, *args, **kwargs: replayed.append(1) or original(*args, **kwargs), recording.replay)

        def silu_as_sigmoid(x):
            return torch.sigmoid(x)

        with _aten_kernel("silu", silu_as_sigmoid, "AutogradCPU"):
            self._same(model, calls=1)
        self.assertFalse(replayed, "a recording made before the kernel was registered was replayed after it")

    # held: a Python kernel registered for an ATen op before the first call runs as a frame of the user's file: refused
    def test_a_python_kernel_for_an_aten_op_keeps_the_forward_eager(self):
        def silu_as_sigmoid(x):
            return torch.sigmoid(x)

        model = build_family("llama")
        with _aten_kernel("silu", silu_as_sigmoid, "AutogradCPU"):
            self.assertIn("code the package has not read ran", self._same(model, calls=1))

    # held: a custom op (`torch.library.custom_op`) as the activation: its kernel's frame is foreign (and the op itself
    # is outside ATen's namespace)
    def test_a_custom_op_keeps_the_forward_eager(self):
        @torch.library.custom_op("tas_redteam::act", mutates_args=())
        def act(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x)

        model = build_family("llama")
        _set_act(model, torch.ops.tas_redteam.act.default)
        self.assertIn("not proven", self._same(model, calls=1))


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class ConfigClasses(_Base):
    """The snapshot compares the configs' instance `__dict__`s, not their classes."""

    # HOLE 6: a config's class table is in no snapshot (`ModelGraphs.dicts` holds the modules' `__dict__`s, the
    # configs' and the module classes' tables, not the config classes'), and `PreTrainedConfig.__getattribute__` reads
    # the class at every config read. A property set on the config class (a data descriptor: it wins over the
    # instance's field) after the recording is what stock reads: OLMo's `clip_qkv` (found family), Gemma 3's
    # `final_logit_softcapping` (read by hand).
    def test_a_property_set_on_a_config_class_between_calls_is_followed(self):
        for family, field, value in (("olmo", "clip_qkv", 0.05), ("gemma3_text", "final_logit_softcapping", 0.5)):
            with self.subTest(family=family):
                model = build_family(family)
                self._warm(model)
                config_class = type(model.config)
                # a setter that keeps nothing: 5.17's `_get_generation_parameters` builds a default config of the
                # class, whose `__init__` sets every field
                setattr(config_class, field, property(lambda self, value=value: value, lambda self, new: None))
                try:
                    self._same(model, calls=1)
                finally:
                    delattr(config_class, field)

    # HOLE 6 (the class-level `attribute_map`): `__getattribute__` maps a name through the class's `attribute_map`
    # before reading it; a map set on the config class after the recording sends `config.clip_qkv` to another field.
    def test_a_config_class_attribute_map_set_between_calls_is_followed(self):
        model = build_family("olmo")
        model.config.initializer_range = 0.05  # a field the map will send `clip_qkv` to
        self._warm(model)
        config_class = type(model.config)
        config_class.attribute_map = {"clip_qkv": "initializer_range"}
        try:
            self._same(model, calls=1)
        finally:
            del config_class.attribute_map


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class RetriedRecordings(_Base):
    # HOLE 7 (a failure that should retry never does): a recording refused for a Python kernel registered for an ATen
    # op is remembered in `ModelGraphs.failed` until the snapshot changes (`forward._failed`). Taking the kernel out
    # (`Library._destroy()`) changes nothing the snapshot holds (no registration is in it: hole 5), so the model stays
    # eager for good, with a reason naming code that no longer runs.
    def test_a_refused_aten_kernel_taken_out_is_tried_again(self):
        def silu_as_sigmoid(x):
            return torch.sigmoid(x)

        model = build_family("llama")
        with _aten_kernel("silu", silu_as_sigmoid, "AutogradCPU"):
            self.assertIn("code the package has not read ran", self._same(model, calls=1))
        why = self._same(model)
        self.assertTrue(why.startswith("graphed"), why)

    # HOLE 8 (thrash): a found family whose snapshot changes at every step (a processor setting a config field: a
    # steering schedule, a counter) records at every step and never replays: each change clears the recordings and
    # `first_runs` (`PiecewiseForward.__call__`), so the first recording is never confirmed, and `failed_here` bounds
    # failed keys only. Seven captures and proofs for seven steps, all eager ("recorded once, to be confirmed").
    def test_a_found_family_changed_at_every_step_does_not_record_at_every_step(self):
        model = build_family("olmo")
        self._warm(model)
        recordings = []
        real = forward.record

        def counted(*args, **kwargs):
            recordings.append(1)
            return real(*args, **kwargs)

        def edit(step):
            model.config.tas_redteam_step = step

        try:
            with mock.patch.object(forward, "record", counted):
                self._same(model, calls=1, logits_processor=LogitsProcessorList([_EachStep(edit)]))
        finally:
            vars(model.config).pop("tas_redteam_step", None)
        self.assertLessEqual(len(recordings), 2, f"{len(recordings)} recordings in one call of 8 tokens")


def _liger_rms_norm_forward(self, hidden_states):
    """Stands in for `LigerRMSNorm.forward` (a Triton kernel in Liger-Kernel; the same math here)."""
    variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)).to(hidden_states.dtype)


def _liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Stands in for `liger_kernel.transformers.rope.liger_rotary_pos_emb`."""
    def rotate(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class _LigerRMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    forward = _liger_rms_norm_forward


def _bind_method_to_module(module, name, method):
    """Liger-Kernel's `_bind_method_to_module`, as it is."""
    module.__dict__[name] = method.__get__(module, module.__class__)


def _patch_rms_norm_module(module, offset=0.0, eps=1e-6, casting_mode="llama", in_place=True):
    """Liger-Kernel's `_patch_rms_norm_module` (its non-peft branch), with the stand-in forward."""
    module.offset = offset
    module.casting_mode = casting_mode
    module.variance_epsilon = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or eps
    module.in_place = in_place
    module.row_mode = None
    _bind_method_to_module(module, "forward", _liger_rms_norm_forward)
    _bind_method_to_module(module, "_get_name", lambda self: "LigerRMSNorm")


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class PatchingLibraries(_Base):
    """The patch patterns of the libraries users apply to transformers, reproduced (none is installed here)."""

    # held: `apply_liger_kernel_to_llama()` before the model is built rebinds the modeling module's classes and
    # `apply_rotary_pos_emb`; the model's norms are a class no one read, and the rotary function is foreign code
    def test_liger_style_patch_before_the_model_is_built_keeps_it_eager(self):
        module = importlib.import_module(_MODULES["llama"])
        with _installed(module, "LlamaRMSNorm", _LigerRMSNorm):
            model = build_family("llama")
        self.assertIn("not a module the graphed forward has read", self._same(model, calls=1))
        model = build_family("llama")
        with _installed(module, "apply_rotary_pos_emb", _liger_rotary_pos_emb):
            self.assertIn("code the package has not read ran", self._same(model, calls=1))

    # held: `apply_liger_kernel_to_llama(model=model)` on a recorded model binds forwards on its instances
    def test_liger_style_patch_of_a_recorded_model_is_followed(self):
        model = build_family("llama")
        self._warm(model)
        _patch_rms_norm_module(model.model.norm)
        for layer in model.model.layers:
            _patch_rms_norm_module(layer.input_layernorm)
            _patch_rms_norm_module(layer.post_attention_layernorm)
        self.assertIn("forward", self._same(model, calls=1))

    # held: the kernels hub's `kernelize` binds a hub layer's forward on each module whose class carries
    # `kernel_layer_name` (`use_kernel_forward_from_hub("RMSNorm")`); here a layer from a user's file
    def test_kernels_hub_style_forward_replacement_keeps_it_eager(self):
        class HubRMSNorm:
            forward = _liger_rms_norm_forward

        model = build_family("llama")
        self._warm(model)
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = types.MethodType(HubRMSNorm.forward, module)
        self.assertIn("forward", self._same(model, calls=1))

    # held: an unsloth-style rewrite (the source read with `inspect.getsource`, edited, run in the modeling module's
    # namespace), compiled from a string or under a cache file's name, installed before the first call
    def test_an_unsloth_style_source_rewrite_keeps_it_eager(self):
        module = importlib.import_module(_MODULES["llama"])
        source = inspect.getsource(module.LlamaMLP.forward)
        source = source.replace("self.act_fn(self.gate_proj(x))", "self.act_fn(self.gate_proj(x)) * SCALE[0]")
        self.assertIn("SCALE[0]", source)
        for filename in ("<string>", "/tmp/unsloth_compiled_cache/unsloth_compiled_module_llama.py"):
            with self.subTest(filename=filename):
                scope = dict(vars(module), SCALE=[1.0])
                exec(compile("import torch\n" + "\n".join(line[4:] for line in source.splitlines()), filename,
                             "exec"), scope)
                model = build_family("llama")
                with _installed(module.LlamaMLP, "forward", scope["forward"]):
                    why = self._same(model, calls=1)
                self.assertTrue(why.startswith("eager"), why)

    # held: a helper that a helper of another transformers module calls (`masking_utils.padding_mask_function`,
    # called by `sdpa_mask`, called by `create_causal_mask`) rebound between calls, with a left-padded batch
    def test_a_mask_helper_of_a_helper_rebound_between_calls_is_followed(self):
        from transformers import masking_utils

        self.ids, self.mask = prompt(batch=2, left_pad=True)
        model = build_family("llama")
        self._warm(model)
        original = masking_utils.padding_mask_function

        def ignoring_padding(padding_mask):
            return lambda batch_idx, head_idx, q_idx, kv_idx: kv_idx >= 0

        with mock.patch.object(masking_utils, "padding_mask_function", ignoring_padding):
            self._same(model, calls=1)
        self.assertIs(masking_utils.padding_mask_function, original)


if __name__ == "__main__":
    unittest.main()
