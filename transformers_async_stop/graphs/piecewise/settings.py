"""torch's process-wide settings that can change which kernel an op runs or what it computes, read as a recording key.

A CUDA graph replays the kernels chosen when it was captured: cuBLAS's math mode (TF32, reduced-precision reductions,
fp16 accumulation), the preferred BLAS / linear-algebra library, cuDNN's switches, the SDPA backends, deterministic
algorithms, the default dtype. Stock's next forward picks its kernels under the settings as they are then, so every
such setting is part of the key of a recording (`forward.PiecewiseForward._step`): a change between calls or mid-call
(a processor toggling `allow_fp16_accumulation`) records again under the new settings instead of replaying the old
kernels.

The list is every zero-argument `torch._C._get_*` reader of such a setting for CUDA, plus the fp32-precision readers
and two Python-level ones; `NOT_CUDA` names the CPU and ROCm ones, `IGNORED` the readers that are not settings of an
op's kernel. `tests/test_torch_settings.py`
fails when a torch release grows a reader in neither list, so a new setting is reviewed rather than missed. A reader
this torch does not have is left out (older releases).
"""

from __future__ import annotations

import functools
import operator

import torch

# zero-argument readers in torch._C whose value can change a CUDA op's kernel or its numerics
READERS = (
    "_get_blas_preferred_backend", "_get_blas_default_backend", "_get_linalg_preferred_backend",
    "_get_cublas_allow_tf32", "_get_cublas_allow_fp16_reduced_precision_reduction",
    "_get_cublas_allow_bf16_reduced_precision_reduction", "_get_cublas_allow_fp16_accumulation",
    "_get_float32_matmul_precision", "_get_sm_carveout_experimental",
    "_get_cudnn_enabled", "_get_cudnn_benchmark", "_get_cudnn_deterministic", "_get_cudnn_allow_tf32",
    "_get_cudnn_depthwise_kernel",
    "_get_cudnn_sdp_enabled", "_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled",
    "_get_fa3_sdp_enabled", "_get_overrideable_sdp_enabled", "_get_math_sdp_allow_fp16_bf16_reduction",
    "_get_sdp_priority_order",
    "_get_deterministic_algorithms", "_get_deterministic_algorithms_warn_only",
    "_get_deterministic_fill_uninitialized_memory",
    # torch 2.15: cuBLASLt's grouped GEMM preference, FlashAttention-4 for SDPA, and the switches of torch's
    # ahead-of-time compiled native kernels (`torch._native`: a topk, say), each of which picks another kernel
    "_get_cublaslt_prefer_grouped_gemm", "_get_fa4_sdp_enabled", "_get_native_aot_enabled",
    "_get_native_aot_unconditional_masked",
)
# TunableOp (`torch.cuda.tunable`): while on, a GEMM runs the solution it tuned (or tunes one) instead of the BLAS
# library's default choice. Its readers are named `_cuda_tunableop_*`, not `_get_*` (the drift test does not see them);
# CUDA builds only
TUNABLE_OP = ("_cuda_tunableop_is_enabled", "_cuda_tunableop_tuning_is_enabled")
# settings of CPU or ROCm kernels only: a CUDA graph holds none of them, and the CPU emulation's replay dispatches
# every op again, under the settings as they are then
NOT_CUDA = frozenset((
    "_get_cpu_allow_fp16_reduced_precision_reduction", "_get_mkldnn_enabled", "_get_mkldnn_deterministic",
    "_get_onednn_allow_tf32", "_get_nnpack_enabled", "_get_qengine", "_get_miopen_immediate",
    "_get_rocm_fa_preferred_backend",
))
# `torch._C._get_*` readers that are no setting of an op's kernel (checked by the drift test)
IGNORED = frozenset((
    "_get_DTensor_sharding_propagator_cache_stats", "_get_accelerator", "_get_all_dtypes",
    "_get_autograd_fallback_mode", "_get_backcompat_broadcast_warn", "_get_backcompat_keepdim_warn",
    "_get_caught_jit_exception_class_name", "_get_caught_jit_exception_original_msg", "_get_constant_bool_symnode",
    "_get_cpp_backtrace", "_get_cpu_capability", "_get_custom_class_python_wrapper",
    "_get_default_device",  # the device context is part of the key (`forward._default_device`)
    "_get_dispatch_mode", "_get_dispatch_stack_at", "_get_function_stack_at",  # modes step aside (`forward._why_mode`)
    "_get_dtensor_allow_implicit_replication", "_get_file_format", "_get_graph_exec_group",
    "_get_graph_executor_optimize", "_get_max_operator_version", "_get_mobile_model_contained_types",
    "_get_mobile_model_contained_types_from_buffer", "_get_model_bytecode_version",
    "_get_model_bytecode_version_from_buffer", "_get_model_extra_files", "_get_model_extra_files_from_buffer",
    "_get_model_ops_and_info", "_get_model_ops_and_info_from_buffer", "_get_module_info_from_flatbuffer",
    "_get_nested_int", "_get_obj_in_tls", "_get_operation_overload", "_get_operator_version_map",
    "_get_privateuse1_backend_name", "_get_schema", "_get_tensor_metadata", "_get_thread_name",
    "_get_torch_function_state",  # modes step aside
    "_get_tracing_state", "_get_upgrader_ranges", "_get_upgraders_entry_map", "_get_upgraders_map_size",
    "_get_value_trace", "_get_version_calculator_flag", "_get_warnAlways",
    "_get_cudnn_batch_norm_reserve_space_size",  # a per-tensor query (it takes arguments), not a setting
    "_get_fp32_precision_getter",  # takes arguments: read with each (backend, op) in `_FP32_PRECISION`
    "_get_fake_constant",  # torch 2.15: a per-tensor query (it takes a tensor), not a setting
    "_get_symbolize_mode",  # torch 2.15: how C++ stack traces are symbolized
))
# the fp32-precision API (torch 2.9+): one reading per (backend, op)
_FP32_PRECISION = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
                   ("cudnn", "all"), ("cudnn", "conv"), ("cudnn", "rnn"))


def _readers() -> tuple:
    found = [getattr(torch._C, name) for name in READERS if hasattr(torch._C, name)]
    found = [(lambda reader=reader: tuple(reader())) if isinstance(reader(), list) else reader for reader in found]
    found += [getattr(torch._C, name) for name in TUNABLE_OP if hasattr(torch._C, name)]
    found.append(torch.get_default_dtype)
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is not None:
        for backend, op in _FP32_PRECISION:
            try:
                getter(backend, op)
            except Exception:  # a pair this torch does not know
                continue
            found.append(functools.partial(getter, backend, op))
    return tuple(found)


_OPT_EINSUM = getattr(torch.backends, "opt_einsum", None)


def _opt_einsum() -> tuple:
    return getattr(_OPT_EINSUM, "enabled", None), getattr(_OPT_EINSUM, "strategy", None)


_READ = _readers() + ((_opt_einsum,) if _OPT_EINSUM is not None else ())
# each reader called from C (`map`) rather than by a Python loop: read at every decode step
_CALL = getattr(operator, "call", None) or (lambda reader: reader())  # operator.call: Python 3.11+


def read() -> tuple:
    """Every setting, as a hashable tuple (a few microseconds: C readers).

    A reader may raise where stock reads nothing: `_get_float32_matmul_precision` (torch 2.13 here) refuses to answer
    once the legacy and the new fp32-precision APIs disagree (`set_float32_matmul_precision("high")`, then
    `allow_tf32 = False`), and stock's `generate()` never asks it, so the flag must not raise either (the usage
    fuzzer, seed 31396). Such a reader is keyed by the error's type and message: the same state gives the same key, and
    the state itself is in the other readers (the per-backend fp32 precisions, cuBLAS's TF32 switch)."""
    try:
        return tuple(map(_CALL, _READ))
    except Exception:  # noqa: BLE001 (rare: the guarded reads below)
        return tuple(map(_guarded, _READ))


def _guarded(reader):
    try:
        return reader()
    except Exception as error:  # noqa: BLE001
        return ("unreadable", type(error).__name__, str(error))
