"""Red team of the families found and proven per recording (9f641aa, issue 36): docs/red-team/2026-11-28-found-families.md.

Each case: a tiny random-weight model of a found family on the CPU with the graphs emulated, the flag against
unpatched stock (`models.stock()`), sequences and logits compared. The tests of the holes (fixed since) and
`# HOLE n` fail today (the flag replays what stock no longer computes) and pass once the hole is fixed; the others are
attempts that held.
"""

from __future__ import annotations

import sys
import unittest

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import transformers_async_stop as tas
from family_models import build_family
from models import TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _generate
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)


class _AtStep(LogitsProcessor):
    """Runs `action` at its `at`-th call (mid-call user code, as a processor or a streamer may run)."""

    def __init__(self, action, at=3):
        self.calls, self.action, self.at = 0, action, at

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            self.action()
        return scores


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class RedTeamFoundFamilies(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)

    def _same(self, ref, out):
        self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
        for a, b in zip(ref.logits, out.logits):
            self.assertTrue(torch.equal(a, b), "logits differ from stock")

    def _against_stock(self, model, action=None, undo=lambda: None, at=3):
        """One call of stock and one of the flag, each with `action` run mid-call (then `undo`); their outputs."""
        def processors():
            return {"logits_processor": LogitsProcessorList([_AtStep(action, at)])} if action is not None else {}
        try:
            with stock():
                ref, _ = _generate(model, self.ids, self.mask, None, **processors(), **_KW)
        finally:
            undo()
        try:
            out, _ = _generate(model, self.ids, self.mask, True, **processors(), **_KW)
        finally:
            undo()
        return ref, out

    def _warm(self, model):
        for _ in range(2):  # the first recording is confirmed at the next position, then kept
            self._same(*self._against_stock(model))
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    # HOLE 1: the MoE experts registry (`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, an `ExpertsInterface`:
    # a `GeneralInterface`, a MutableMapping but no dict, so `rules.py`'s container rule does not refuse it) is looked
    # up by `use_experts_implementation`'s `forward` at every stock forward. Neither staleness nor `why_not_model`
    # watches it: a function registered between calls (or mid-call) is never run by a replay.
    def test_experts_function_registered_between_calls(self):
        from transformers.integrations import moe

        model = build_family("mixtral")
        self._warm(model)
        grouped = moe.ExpertsInterface._global_mapping["grouped_mm"]
        moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = lambda module, *a, **k: 2 * grouped(module, *a, **k)
        try:
            self._same(*self._against_stock(model))
        finally:
            moe.ALL_EXPERTS_FUNCTIONS._local_mapping.pop("grouped_mm", None)

    # HOLE 1, mid-call: `ExpertsInterface.register` by a processor at the third step
    def test_experts_function_registered_mid_call(self):
        from transformers.integrations import moe

        model = build_family("mixtral")
        self._warm(model)
        grouped = moe.ExpertsInterface._global_mapping["grouped_mm"]
        self._same(*self._against_stock(
            model, lambda: moe.ExpertsInterface.register("grouped_mm", lambda m, *a, **k: 2 * grouped(m, *a, **k)),
            lambda: moe.ExpertsInterface.register("grouped_mm", grouped)))

    # HOLE 2: a global looked up by transformers code outside the modeling module (here `integrations/moe.py`'s
    # `grouped_mm_experts_forward` -> `_grouped_linear`), proven by the rules alone, is not watched: `eligibility.
    # _looked_up` covers the modeling module's own code and the hand-read sources only, yet `rules.py` passes module
    # attributes as "compared before every replay". Rebound mid-call, stock runs the new one, a replay the old.
    def test_a_moe_module_global_rebound_mid_call(self):
        from transformers.integrations import moe

        model = build_family("mixtral")
        self._warm(model)
        linear = moe._grouped_linear

        def doubled(*args, **kwargs):
            return 2 * linear(*args, **kwargs)

        self._same(*self._against_stock(model, lambda: setattr(moe, "_grouped_linear", doubled),
                                        lambda: setattr(moe, "_grouped_linear", linear)))

    # HOLE 2, torch's side: `torch.nn.functional.grouped_mm`, looked up by `moe._grouped_mm`, is not among the torch
    # names `why_foreign_functions` / staleness compare (`code_names.watched_functions`: the modeling module's code)
    def test_a_torch_function_looked_up_outside_the_modeling_module_rebound_mid_call(self):
        functional = torch.nn.functional
        if not hasattr(functional, "grouped_mm"):
            self.skipTest("no torch.nn.functional.grouped_mm")
        model = build_family("mixtral")
        self._warm(model)
        grouped_mm = functional.grouped_mm

        def doubled(*args, **kwargs):
            return 2 * grouped_mm(*args, **kwargs)

        self._same(*self._against_stock(model, lambda: setattr(functional, "grouped_mm", doubled),
                                        lambda: setattr(functional, "grouped_mm", grouped_mm)))

    # HOLE 3: `proof.watch.kind_of` takes every file name in angle brackets as "generated" (dataclasses' `__init__`)
    # and never as foreign: a user's function compiled from a string (`exec`, `python -c`, the IPython terminal's
    # `<ipython-input-...>`, doctests) runs in the recorded forward unseen. Here a stateful experts function (its
    # scale changes at its 14th call) registered before the call: from a file it is refused ("code the package has
    # not read ran"), compiled as "<string>" its first recording is kept and replayed.
    def test_user_code_compiled_from_a_string_is_foreign(self):
        self._stateful_experts("<string>")

    def test_user_code_from_a_file_is_foreign(self):  # held: the same function from a file keeps the call eager
        self._stateful_experts(__file__ + ".user_code")
        self.assertIn("code the package has not read ran", tas.last_path().forward)

    def _stateful_experts(self, filename):
        from transformers.integrations import moe

        model = build_family("mixtral")
        scope = {"grouped": moe.ExpertsInterface._global_mapping["grouped_mm"]}
        exec(compile("calls = [0]\n"
                     "def experts(module, *args, **kwargs):\n"
                     "    calls[0] += 1\n"
                     "    return grouped(module, *args, **kwargs) * (1 + calls[0] // 14)\n", filename, "exec"), scope)
        moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"] = scope["experts"]
        try:
            for _ in range(2):
                with stock():
                    scope["calls"][0] = 0
                    ref, _ = _generate(model, self.ids, self.mask, None, **_KW)
                scope["calls"][0] = 0
                out, _ = _generate(model, self.ids, self.mask, True, **_KW)
                self._same(ref, out)
        finally:
            moe.ALL_EXPERTS_FUNCTIONS._local_mapping.pop("grouped_mm", None)

    # held: an exception (KeyboardInterrupt, ValueError) raised inside the recorded forward leaves no trace function
    # and no dispatch mode behind, reaches the caller as stock's, and the next call is equal
    def test_an_interrupt_inside_the_recording_restores_the_watch(self):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        from transformers.integrations import moe

        linear = moe._grouped_linear
        seen = []
        for error in (KeyboardInterrupt, ValueError):
            model = build_family("mixtral")

            def boom(*args, **kwargs):
                seen.append(sys.gettrace() is not None)
                raise error("boom")

            for flag in (None, True):
                with self.assertRaises(error):
                    with stock() if flag is None else _nothing():
                        _generate(model, self.ids, self.mask, flag, logits_processor=LogitsProcessorList(
                            [_AtStep(lambda: setattr(moe, "_grouped_linear", boom), at=1)]), **_KW)
                moe._grouped_linear = linear
                self.assertIsNone(sys.gettrace())
                self.assertEqual(_get_current_dispatch_mode_stack(), [])
            self._same(*self._against_stock(model))
        self.assertIn(True, seen)  # raised while the watch was installed (a recording's run)

    # held: a global module forward hook registered mid-call ("a hook was added"), peft LoRA on a found family
    def test_a_global_module_hook_mid_call(self):
        model = build_family("olmo")
        self._warm(model)
        handles = []

        def hook(module, args, output):
            return 2 * output if isinstance(output, torch.Tensor) and output.shape[-1] == 32 else output

        def undo():
            while handles:
                handles.pop().remove()

        self._same(*self._against_stock(
            model, lambda: handles.append(torch.nn.modules.module.register_module_forward_hook(hook)), undo))

    def test_peft_lora_on_a_found_family(self):
        try:
            import peft
        except ImportError:
            self.skipTest("no peft")
        model = peft.get_peft_model(build_family("olmo"), peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        self._same(*self._against_stock(model))
        self.assertIn("not a module the graphed forward has read", tas.last_path().forward)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    unittest.main()
