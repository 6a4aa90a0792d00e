"""The static-cache loop reads, at every step, what stock reads at every step (red team static, f04 and f01).

- An `EosTokenCriteria` whose `eos_token_id` another criterion rebinds or edits in place mid-call: stock's criterion
  reads its ids at every call, so the loop's tail must too (it used to concatenate them once per call).
- Code inside the forward that keeps the tensors it is fed (an instance-level `forward` wrapper on a submodule, a
  user `nn.Module` subclass inside the model): stock feeds new tensors each step, the loop's in-place inputs would be
  rewritten under it. Such a model gets stock's per-step inputs, and `last_path()` says why.
Compared with unpatched transformers (`models.stock`). CUDA variants skip without CUDA.
"""

from __future__ import annotations

import contextlib
import unittest

import torch
from parameterized import parameterized
from transformers import EosTokenCriteria, StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from adversarial_helpers import static_cache
from models import PAD, TRANSFORMERS_VERSION, build, stock

DEVICES = ["cpu", "cuda"]
# before 5.17 there is no static-cache loop: a static cache takes the plain deferred path (transformers' own loop), so
# these calls must still equal stock, and the report names that path with no reason
STATIC_LOOP = TRANSFORMERS_VERSION >= (5, 17)
LOOP = "static loop" if STATIC_LOOP else "deferred"
_nothing = contextlib.nullcontext


def _skip_without(device):
    if device == "cuda" and not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")


class SwitchStopTokens(StoppingCriteria):
    """At length 8, makes `eos` stop on 13 / 15 instead: rebinding its ids, or writing them in place."""

    def __init__(self, eos, how, ids):
        self.eos, self.how, self.ids = eos, how, ids

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] == 8:
            new = torch.tensor(self.ids, device=input_ids.device)
            if self.how == "rebind":
                self.eos.eos_token_id = new
            else:
                self.eos.eos_token_id.copy_(new)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _eos_switch_run(device, how, ids, flag, do_sample=False):
    model = build("llama", device=device)
    prompt = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    eos = EosTokenCriteria([46, 47])
    extra = {"async_stopping_criteria": True} if flag else {}
    torch.manual_seed(0)
    out = model.generate(prompt, past_key_values=static_cache(model, 40, 2), max_new_tokens=12, pad_token_id=PAD,
                         do_sample=do_sample, stopping_criteria=StoppingCriteriaList([eos, SwitchStopTokens(eos, how, ids)]),
                         **extra)
    return out.cpu(), eos.eos_token_id.cpu()


class EosIdsChangedMidCall(unittest.TestCase):
    @parameterized.expand([(d, how, ids, s) for d in DEVICES for how in ("rebind", "inplace")
                           for ids in ([13, 15], [13, 13]) for s in (False, True)])
    def test_static_loop_follows_eos_ids_changed_by_another_criterion(self, device, how, ids, do_sample):
        _skip_without(device)
        with stock():
            want, want_ids = _eos_switch_run(device, how, ids, False, do_sample)
        got, got_ids = _eos_switch_run(device, how, ids, True, do_sample)
        self.assertEqual(tas.last_path().path, LOOP)
        self.assertEqual(got.tolist(), want.tolist())
        self.assertEqual(got_ids.tolist(), want_ids.tolist())

    @parameterized.expand(DEVICES)
    def test_static_loop_follows_eos_ids_rebound_to_another_count(self, device):
        _skip_without(device)
        with stock():
            want, _ = _eos_switch_run(device, "rebind", [13, 15, 20], False)
        got, _ = _eos_switch_run(device, "rebind", [13, 15, 20], True)
        self.assertEqual(got.tolist(), want.tolist())


def _eos_after_switch_run(device, how, flag):
    """The criterion changing the ids comes first: stock's EOS criterion sees the new ids at the same step."""
    model = build("llama", device=device)
    model.generation_config.eos_token_id = None  # no default EOS criterion: the caller's list keeps its order
    prompt = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    with stock():
        plain = model.generate(prompt, past_key_values=static_cache(model, 40, 2), max_new_tokens=12,
                               pad_token_id=PAD, do_sample=False)
    token = plain[0, 7].item()  # row 0's token at length 8, where the ids change
    eos = EosTokenCriteria([46, 47])
    extra = {"async_stopping_criteria": True} if flag else {}
    return model.generate(prompt, past_key_values=static_cache(model, 40, 2), max_new_tokens=12, pad_token_id=PAD,
                          do_sample=False, stopping_criteria=StoppingCriteriaList(
                              [SwitchStopTokens(eos, how, [token, token]), eos]), **extra).cpu()


class EosAfterAUserCriterion(unittest.TestCase):
    @parameterized.expand([(d, how) for d in DEVICES for how in ("rebind", "inplace")])
    def test_eos_criterion_after_one_changing_its_ids_sees_them_at_the_same_step(self, device, how):
        _skip_without(device)
        with stock():
            want = _eos_after_switch_run(device, how, False)
        got = _eos_after_switch_run(device, how, True)
        self.assertEqual(got.tolist(), want.tolist())


class LoggingEmbedding(torch.nn.Embedding):
    """A user module inside the model that keeps every input it is fed."""

    def forward(self, input):
        self.seen.append(input)
        return super().forward(input)


def _keeping_run(device, kind, flag):
    model = build("llama", device=device)
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    kept = []
    emb = model.model.embed_tokens
    if kind == "wrapper":
        orig = emb.forward
        emb.forward = lambda input: (kept.append(input), orig(input))[1]
    else:
        new = LoggingEmbedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx).to(device)
        new.load_state_dict(emb.state_dict())
        new.seen = kept
        model.model.embed_tokens = new
    extra = {"async_stopping_criteria": True} if flag else {}
    out = model.generate(prompt, cache_implementation="static", max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                         **extra)
    return out.cpu(), [t.flatten().tolist() for t in kept]


class ForwardKeepsItsInputs(unittest.TestCase):
    @parameterized.expand([(d, k) for d in DEVICES for k in ("wrapper", "module")])
    def test_code_keeping_forward_inputs_sees_stocks_inputs(self, device, kind):
        _skip_without(device)
        with stock():
            want_out, want_kept = _keeping_run(device, kind, False)
        got_out, got_kept = _keeping_run(device, kind, True)
        report = tas.last_path()
        self.assertEqual(got_kept, want_kept)
        self.assertEqual(got_out.tolist(), want_out.tolist())
        if STATIC_LOOP:
            self.assertEqual(report.path, LOOP)
            self.assertIn("per-step inputs", report.reason or "")
        elif kind == "module":
            # before 5.17 the user's module class is code the package has not read: each verdict is read at once
            self.assertEqual(report.path, "immediate")
            self.assertIn("LoggingEmbedding", report.reason or "")
        else:
            self.assertEqual(report.path, LOOP)
            self.assertIsNone(report.reason)

    def test_accelerate_device_hook_keeps_in_place_inputs_a_user_accelerate_hook_does_not(self):
        # accelerate's own device hooks set an instance forward but keep no input; a user `ModelHook` may
        from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module

        class Keep(ModelHook):
            def pre_forward(self, module, *args, **kwargs):
                kept.append(args[0] if args else kwargs.get("input"))
                return args, kwargs

        prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(1))
        # the static loop's reason for stepping aside; the deferred path before 5.17 has none to give
        keep_reason = "instance-level forward" if STATIC_LOOP else None
        for hook, reason in ((AlignDevicesHook(execution_device="cpu"), None), (Keep(), keep_reason)):
            runs = []
            for flag in (False, True):
                model, kept = build("llama"), []
                add_hook_to_module(model.model.embed_tokens, hook)
                with stock() if not flag else _nothing():
                    out = model.generate(prompt, cache_implementation="static", max_new_tokens=6, do_sample=False,
                                         pad_token_id=PAD, **({"async_stopping_criteria": True} if flag else {}))
                remove_hook_from_module(model.model.embed_tokens)
                runs.append((out.tolist(), [t.flatten().tolist() for t in kept]))
            self.assertEqual(runs[1], runs[0])
            if reason is None:
                self.assertIsNone(tas.last_path().reason)
            else:
                self.assertIn(reason, tas.last_path().reason or "")

    def test_plain_model_keeps_in_place_inputs(self):
        # the detection must not catch transformers' and torch's own modules
        model = build("llama")
        prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(1))
        model.generate(prompt, cache_implementation="static", max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                       async_stopping_criteria=True)
        self.assertIsNone(tas.last_path().reason)


if __name__ == "__main__":
    unittest.main()
