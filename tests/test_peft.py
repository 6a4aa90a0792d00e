"""Real peft LoRA models (peft is a test dependency, the `[test]` extra): with the flag, every call equals unpatched
transformers on an identical model that went through the same adapter changes.

One model per test goes through a sequence of calls: its first adapter on, adapters disabled (`disable_adapter()`),
`set_adapter` to a second adapter, both adapters active at once, an adapter added and then deleted, every LoRA
layer scaled (`scale_layer`, `set_scale`) and reset (`unscale_layer`), `merge_adapter()` / `unmerge_adapter()`,
adapter layers disabled or enabled mid-call by a stopping criterion, and last `merge_and_unload()`. Each flag-on
call is compared with the stock call of the same sequence on a copy built alike (sequences, scores, logits, the RNG
state after the call); greedy and sampling; DynamicCache and a static cache on Llama, DynamicCache on Qwen2; on the
CPU under the emulation of CUDA graphs (`testing.emulation.emulated()`) and on CUDA (skipped without it).

On the dynamic-cache loop's releases the decode forward of a peft model is the eager one, and `last_path().forward`
names the peft layer the graphed forward has not read; once `merge_and_unload()` leaves only transformers' and torch's
own modules, it is graphed again.
"""

from __future__ import annotations

import contextlib
import unittest

import pytest

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import PAD, TRANSFORMERS_VERSION, assert_same, build, prompt, stock
from transformers_async_stop.testing.emulation import emulated

# heavy: the whole of it runs on 5.17.0 and 5.24.0 in CI (noxfile `SLOW_ON`), the rest of the releases skip it
pytestmark = pytest.mark.slow

try:  # a test dependency; where it is missing or does not import with this torch/transformers, the tests say so
    import peft
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
except Exception as exc:  # noqa: BLE001 (an incompatible release raises more than ImportError)
    peft, NO_PEFT = None, f"peft does not import here ({type(exc).__name__}: {exc}); pip install -e '.[test]'"
else:
    NO_PEFT = ""

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases (its decode forward)
NEW_TOKENS = 8
SWITCH_AT = 3  # generated tokens after which a criterion switches the adapters mid-call


def lora_config(targets, alpha=8):
    # init_lora_weights=False: B is random, not zero, so every adapter changes the outputs
    return LoraConfig(r=4, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                      lora_dropout=0.0)


def lora_model(family, device, dtype):
    """A tiny model of `family` with two LoRA adapters, "first" (active) and "second"; built alike on every call."""
    base = build(family, device=device, dtype=dtype)
    torch.manual_seed(1)
    model = get_peft_model(base, lora_config(("q_proj", "v_proj", "gate_proj", "down_proj")), adapter_name="first")
    torch.manual_seed(2)
    model.add_adapter("second", lora_config(("q_proj", "k_proj", "o_proj", "up_proj"), alpha=16))
    return model.to(device=device, dtype=dtype).eval()


def lora_layers(model):
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


class _SwitchAt(StoppingCriteria):
    """Calls `act()` once, when SWITCH_AT tokens have been generated; never stops. Stock's later forwards see it."""

    def __init__(self, length, act):
        self.length, self.act = length, act

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == self.length:
            self.act()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


# --- the sequence: each turn is a context around one call, yielding (the model to call, extra generate kwargs) ------
@contextlib.contextmanager
def first_adapter(model, ids):
    yield model, {}


@contextlib.contextmanager
def adapters_disabled(model, ids):
    with model.disable_adapter():
        yield model, {}


@contextlib.contextmanager
def set_adapter_second(model, ids):
    model.set_adapter("second")
    yield model, {}


@contextlib.contextmanager
def both_adapters_active(model, ids):
    model.base_model.set_adapter(["first", "second"])
    yield model, {}


@contextlib.contextmanager
def set_adapter_first(model, ids):
    model.set_adapter("first")
    yield model, {}


@contextlib.contextmanager
def adapter_added(model, ids):
    torch.manual_seed(3)
    model.add_adapter("third", lora_config(("q_proj", "v_proj", "up_proj"), alpha=12))
    model.to(dtype=model.base_model.model.dtype)
    model.set_adapter("third")
    yield model, {}


@contextlib.contextmanager
def adapter_deleted(model, ids):
    model.set_adapter("first")
    model.delete_adapter("third")
    yield model, {}


@contextlib.contextmanager
def layers_scaled(model, ids):
    for layer in lora_layers(model):
        layer.scale_layer(0.5)
    yield model, {}


@contextlib.contextmanager
def scale_set(model, ids):
    for layer in lora_layers(model):
        layer.set_scale("first", 3.0)
    yield model, {}


@contextlib.contextmanager
def scale_reset(model, ids):
    for layer in lora_layers(model):
        layer.unscale_layer(None)
    yield model, {}


@contextlib.contextmanager
def merged(model, ids):
    model.merge_adapter()
    yield model, {}


@contextlib.contextmanager
def unmerged(model, ids):
    model.unmerge_adapter()
    yield model, {}


@contextlib.contextmanager
def disabled_mid_call(model, ids):
    criterion = _SwitchAt(ids.shape[1] + SWITCH_AT, model.base_model.disable_adapter_layers)
    try:
        yield model, {"stopping_criteria": StoppingCriteriaList([criterion])}
    finally:
        model.base_model.enable_adapter_layers()


@contextlib.contextmanager
def enabled_mid_call(model, ids):
    model.base_model.disable_adapter_layers()
    criterion = _SwitchAt(ids.shape[1] + SWITCH_AT, model.base_model.enable_adapter_layers)
    try:
        yield model, {"stopping_criteria": StoppingCriteriaList([criterion])}
    finally:
        model.base_model.enable_adapter_layers()


@contextlib.contextmanager
def merged_and_unloaded(model, ids):
    yield model.merge_and_unload(), {}


TURNS = (first_adapter, adapters_disabled, set_adapter_second, both_adapters_active, set_adapter_first,
         adapter_added, adapter_deleted, layers_scaled, scale_set, scale_reset, merged, unmerged, first_adapter,
         disabled_mid_call, enabled_mid_call, merged_and_unloaded)


def run_sequence(model, ids, mask, flag, sample, static, static_kwargs):
    """Every turn's call in order on `model`: [(turn name, output, an RNG draw after the call, forward path)]."""
    seen = []
    for turn in TURNS:
        with turn(model, ids) as (callee, extra):
            torch.manual_seed(7)
            kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=sample,
                          pad_token_id=PAD, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
                          output_logits=True, **extra)
            if static:
                kwargs.update(cache_implementation="static", **static_kwargs)
            if flag:
                kwargs["async_stopping_criteria"] = True
            with torch.no_grad():
                out = callee.generate(**kwargs)
            after = torch.rand(4, device=ids.device)
            path = tas.last_path().forward if flag and tas.last_path() is not None else None
        seen.append((turn.__name__, out, after, path, callee is model))
    return seen


def _eager_for_peft(path):
    # "training mode" too: `add_adapter` leaves the new adapter's modules in training mode (stock runs them so, with
    # dropout 0), a reason the forward may give before the peft layers
    return (path or "").startswith("eager") and any(w in path.lower() for w in ("lora", "peft", "training mode"))


class _PeftCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cpu"
    DTYPES = (torch.float32,)
    STATIC_KWARGS = {}

    @parameterized.expand([
        (f"{family}_{'static' if static else 'dynamic'}_{'sample' if sample else 'greedy'}", family, static, sample)
        for family, static in (("llama", False), ("llama", True), ("qwen2", False))
        for sample in (False, True)
    ])
    def test_every_adapter_change_between_and_within_calls_equals_stock(self, _, family, static, sample):
        for dtype in self.DTYPES:
            with self.subTest(dtype=str(dtype)):
                self._check(family, dtype, static, sample)

    def _check(self, family, dtype, static, sample):
        ids, mask = prompt(batch=1, device=self.DEVICE)
        with stock():
            ref = run_sequence(lora_model(family, self.DEVICE, dtype), ids, mask, False, sample, static,
                               self.STATIC_KWARGS)
        got = run_sequence(lora_model(family, self.DEVICE, dtype), ids, mask, True, sample, static, self.STATIC_KWARGS)

        # the adapters change the outputs (else the sequence could not tell a change the flag ignored)
        self.assertFalse(torch.equal(ref[0][1].logits[0], ref[1][1].logits[0]))
        self.assertFalse(torch.equal(ref[0][1].logits[0], ref[2][1].logits[0]))

        differ, paths = [], []
        for (name, a, a_after, _, _), (_, b, b_after, path, peft_model) in zip(ref, got):
            try:
                assert_same(self, a, b, name)
                self.assertTrue(torch.equal(a_after, b_after), f"{name}: RNG state after generate() differs")
            except AssertionError as exc:
                differ.append(f"{name}: {str(exc).splitlines()[0]}")
            if RELEASES and not static:
                if peft_model and not _eager_for_peft(path):
                    paths.append(f"{name}: forward {path!r} (expected eager, naming the peft layer)")
                if not peft_model and not (path or "").startswith("graphed"):
                    paths.append(f"{name}: forward {path!r} (expected graphed after merge_and_unload)")
        self.assertEqual(differ, [], f"calls that differ from stock (paths: {[g[3] for g in got]})")
        self.assertEqual(paths, [])


@unittest.skipIf(peft is None, NO_PEFT)
class EmulatedOnCpu(_PeftCases, unittest.TestCase):
    """The CPU with each CUDA graph emulated by its recorded ATen ops (on the dynamic-cache loop's releases); on the
    others the flag's deferred path with transformers' own forward."""

    DEVICE = "cpu"

    def setUp(self):
        self.enterContext(emulated())


@unittest.skipIf(peft is None, NO_PEFT)
@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class OnCuda(_PeftCases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPES = (torch.float32, torch.bfloat16)
    # a static cache on CUDA auto-compiles the forward, and dynamo guards on peft's flags: every adapter state of the
    # sequence would be a recompile (minutes). What this checks is the flag's loop around the forward, compiled or not
    STATIC_KWARGS = {"disable_compile": True}


if __name__ == "__main__":
    unittest.main()
