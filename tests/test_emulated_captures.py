"""The CUDA-only test classes of the static loop's captured tail, run on the CPU with the graphs emulated
(`testing/emulation.py`): the tail is captured and replayed without its Python, as on CUDA, so CI (no GPU) runs the
capture decisions, the guards before each replay and what a replay bakes in. Each class here is its CUDA class with
`device = "cpu"` under `emulated()`; the CUDA classes are imported as module attributes so that pytest does not
collect them twice."""

from __future__ import annotations

import unittest

import test_static_loop
import test_static_loop_usage
import test_static_processors
import test_usage_holes
from models import TRANSFORMERS_VERSION
from transformers_async_stop.testing.emulation import emulated

# cases of the CUDA classes that need CUDA itself, not a captured tail
_CUDA_ITSELF = (
    # torch.compile of the forward (inductor on the CPU is another kernel set and takes minutes to build)
    "test_the_blog_experiment_with_the_compiled_forward",
    # CUDA's synchronisations, counted with torch.cuda.set_sync_debug_mode
    "test_zero_syncs_per_decode_step_with_the_captured_tail",
)


class _Emulated:
    device = DEVICE = "cpu"
    __unittest_skip__ = False

    def setUp(self):
        if TRANSFORMERS_VERSION < (5, 17):
            self.skipTest("the static-cache loop (whose tail is captured) is taken on transformers 5.17+")
        if self._testMethodName.startswith(_CUDA_ITSELF):
            self.skipTest("needs CUDA itself, not a captured tail")
        super().setUp()
        self.enterContext(emulated())


class StaticLoopUsageEmulated(_Emulated, test_static_loop_usage.StaticLoopUsageCuda):
    pass


class UsageHolesEmulated(_Emulated, test_usage_holes.UsageHolesCuda):
    pass


class CapturedTailEmulated(_Emulated, test_static_loop.CudaCapturedTail):
    pass


class CapturedProcessorsEmulated(_Emulated, test_static_processors.CudaCapturedProcessors):
    pass


if __name__ == "__main__":
    unittest.main()
