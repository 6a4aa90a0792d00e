"""The graphed decode forward under any attention implementation transformers registers or defaults to
(`graphs/piecewise/proof/attention.py`): eager attention (each modeling module's own `eager_attention_forward`, GPT-J's
`_attn` method on 5.23), run eagerly between the pieces at every replay as SDPA is, with its masks made at every
replay by stock's mask functions (`masks.mask_call`: eager attention needs a materialised 4D mask, never skipped).

Each case runs on CUDA (skipped without it) and on the CPU with the graphs emulated (`testing/emulation.py`):
bit-exact against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after the
call), greedy, sampling and a left-padded batch, two calls (the second replays what the first recorded), and
`last_path()` says the forward was graphed:
- Llama and GPT-2 (read by hand) built with `attn_implementation="eager"`;
- Gemma 2 at its defaults (eager: transformers refuses SDPA for it), its hybrid sliding/full layers with a window that
  slides, attention and final logit soft-capping;
- Gemma 3 (text) with eager attention, its sliding layers and attention soft-capping;
- GPT-J with eager attention (5.24: its `eager_attention_forward`; 5.23 and before: its `_attn` method);
- assisted decoding and prompt lookup whose target has eager attention (the verify forward, K tokens wide), and a
  draft with eager attention.

CPU only: the families whose attention is computed inline (BLOOM, MPT, Falcon) are named; a user's eager function
rebound or registered keeps the forward eager, named, and equal to stock; transformers' own function registered for
"eager" is the one each replay calls; the attention implementation set between calls records under it.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
import transformers
from parameterized import parameterized

import transformers_async_stop as tas
from family_models import _EXTRA, _SMALL
from models import PAD, TRANSFORMERS_VERSION, VOCAB, assert_same, build, prompt, stock
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.testing.emulation import emulated
from test_piecewise import _generate
from test_piecewise_verify import _check_against_stock as _check_assisted_against_stock

ON = {proof.PIECEWISE_ENV: "1"}
RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)  # the dynamic-cache loop's releases
CUDA = torch.cuda.is_available() and RELEASES
_TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             max_position_embeddings=128, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
             initializer_range=0.5)


def _check_against_stock(test, model, ids, mask, **kwargs):
    """The flag's generate() against stock's: outputs, the RNG state after the call, and the returned cache's layout
    (a sliding layer of a batch holds a slice in stock's cache: contiguous where stock's is)."""
    with stock():
        ref, ref_after = _generate(model, ids, mask, None, **kwargs)
    out, after = _generate(model, ids, mask, True, **kwargs)
    assert_same(test, ref, out)
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    for mine, theirs in zip(cache_kwarg.of_output(out).layers, cache_kwarg.of_output(ref).layers):
        test.assertEqual((mine.keys.is_contiguous(), mine.values.is_contiguous()),
                         (theirs.keys.is_contiguous(), theirs.values.is_contiguous()))
    return out


def _from_config(model_type, device, dtype, attn=None, **overrides):
    """A tiny causal LM from its own config class; `attn` None: the implementation transformers picks for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**_TINY, "num_hidden_layers": 2, **overrides})
    torch.manual_seed(0)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    return AutoModelForCausalLM.from_config(config, **kwargs).to(device=device, dtype=dtype).eval()


_GEMMA2_ATTN = "eager" if getattr(transformers.Gemma2PreTrainedModel, "_supports_sdpa", False) else None
# name -> a builder (device, dtype) of a model whose attention is not SDPA. The windows (4) slide within the prompt (6)
# and the 10 new tokens
EAGER = {
    "llama": lambda device, dtype: build("llama", device=device, dtype=dtype, attn="eager"),
    "gpt2": lambda device, dtype: build("gpt2", device=device, dtype=dtype, attn="eager"),
    # its defaults: eager (5.23, 5.24; 5.17 picks SDPA for it, and the test asks for eager), sliding
    # and full layers alternating, attention and final logit soft-capping
    "gemma2": lambda device, dtype: _from_config("gemma2", device, dtype, attn=_GEMMA2_ATTN, num_hidden_layers=4,
                                                 sliding_window=4),
    # 3 sliding layers then a full one, attention soft-capping (which SDPA would ignore; eager applies it)
    "gemma3": lambda device, dtype: _from_config("gemma3_text", device, dtype, attn="eager", num_hidden_layers=4,
                                                 sliding_window=4, attn_logit_softcapping=5.0),
}


def _gptj(device, dtype):
    """GPT-J with eager attention: 5.24 builds it with SDPA unless told (then its `eager_attention_forward`); 5.23
    knows no other (its `_attn` method)."""
    return _small("gptj", device, dtype, attn="eager")


def _small(model_type, device="cpu", dtype=torch.float32, attn=None):
    """`family_models.build_family`'s model, with the implementation `attn` (None: the one transformers picks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**_SMALL, **_EXTRA.get(model_type, {})})
    config.initializer_range = 0.5
    torch.manual_seed(0)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    return AutoModelForCausalLM.from_config(config, **kwargs).to(device=device, dtype=dtype).eval()


EAGER["gptj"] = _gptj
# the left-padded batch: a batch of 3 whose rows carry 0, 1 and 2 pads
KINDS = ("greedy", "sample", "padded")


class _EagerAttentionCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"
    DTYPE = torch.bfloat16

    @parameterized.expand([(f"{name}_{kind}", name, kind) for name in EAGER for kind in KINDS])
    def test_a_forward_with_eager_attention_is_graphed_and_equals_stock(self, _, name, kind):
        model = EAGER[name](self.DEVICE, self.DTYPE)
        self.assertNotEqual(model.config._attn_implementation, "sdpa")
        padded = kind == "padded"
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        for _ in range(2):  # the second call replays what the first recorded (a found family: once confirmed)
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=kind == "sample",
                                 eos_token_id=None)
        path = tas.last_path()
        self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward graphed"), path.describe())
        # every decode step of the second call replayed: the masks, padded or sliding, made by stock's functions
        self.assertRegex(path.forward, r"^graphed \(\d+ pieces\): 9 decode steps$")

    @parameterized.expand([(name,) for name in ("llama", "gemma2")])
    def test_a_stop_mid_call_with_eager_attention_equals_stock(self, name):
        # the stop is read one step late: the deferred step's forward (a replay) is undone
        model = EAGER[name](self.DEVICE, self.DTYPE)
        ids, mask = prompt(batch=1, device=self.DEVICE)
        with stock():  # sampled with the seed `_generate` sets: the same draws up to the stop
            free, _ = _generate(model, ids, mask, None, max_new_tokens=10, do_sample=True, eos_token_id=None)
        generated = free.sequences[0, ids.shape[1]:].tolist()
        # a token first drawn at the third step or later (a repeating draw on CUDA may have none: then the first new
        # one after the first step, else the first): the call stops there, before its budget
        firsts = [k for k, t in enumerate(generated[:9]) if t not in generated[:k]]
        eos = generated[next((k for k in firsts if k >= 3), next((k for k in firsts if k >= 1), 0))]
        for _ in range(2):
            out = _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=True, eos_token_id=eos)
        self.assertLess(out.sequences.shape[1], ids.shape[1] + 10)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    @parameterized.expand([(f"{name}_{kind}", name, kind) for name in ("llama", "gpt2", "gemma3_full")
                           for kind in ("greedy", "sample")])
    def test_assisted_decoding_with_an_eager_attention_target_graphs_the_verify_forward(self, _, name, kind):
        # the verify forward (K tokens) makes its mask with stock's function at every round already; with eager
        # attention it is a materialised float mask, and the attention is the module's `eager_attention_forward`
        target = (_from_config("gemma3_text", self.DEVICE, self.DTYPE, attn="eager", attn_logit_softcapping=5.0,
                               layer_types=["full_attention", "full_attention"]) if name == "gemma3_full"
                  else EAGER[name](self.DEVICE, self.DTYPE))
        helper = build("llama", seed=1, device=self.DEVICE, dtype=self.DTYPE)
        ids = prompt(batch=1, device=self.DEVICE)[0]
        for _ in range(2):
            _check_assisted_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24,
                                          do_sample=kind == "sample", eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_prompt_lookup_and_a_padded_prompt_with_an_eager_attention_target_equal_stock(self):
        target = EAGER["llama"](self.DEVICE, self.DTYPE)
        ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 7, 3, 4]], device=self.DEVICE)
        for sample in (False, True):
            _check_assisted_against_stock(self, target, ids, prompt_lookup_num_tokens=3, max_new_tokens=30,
                                          do_sample=sample, eos_token_id=None)
            self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)
        mask = torch.ones_like(ids)
        ids, mask = ids.clone(), mask.clone()
        ids[:, :2], mask[:, :2] = PAD, 0
        helper = build("llama", seed=1, device=self.DEVICE, dtype=self.DTYPE)
        _check_assisted_against_stock(self, target, ids, mask, assistant_model=helper, max_new_tokens=24,
                                      do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().verify.startswith("graphed"), tas.last_path().verify)

    def test_a_draft_with_eager_attention_is_graphed_and_equals_stock(self):
        target = build("llama", device=self.DEVICE, dtype=self.DTYPE)
        helper = build("llama", seed=1, device=self.DEVICE, dtype=self.DTYPE, attn="eager")
        ids = prompt(batch=1, device=self.DEVICE)[0]
        for _ in range(2):
            _check_assisted_against_stock(self, target, ids, assistant_model=helper, max_new_tokens=24,
                                          do_sample=False, eos_token_id=None)
        self.assertTrue(tas.last_path().forward.startswith("draft graphed"), tas.last_path().forward)


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class EagerAttentionOnCuda(_EagerAttentionCases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPE = torch.bfloat16


@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class EagerAttentionOnCudaFp32(_EagerAttentionCases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPE = torch.float32


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class EagerAttentionEmulatedOnCpu(_EagerAttentionCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"
    DTYPE = torch.float32

    def setUp(self):
        self.enterContext(emulated())


def _why(model):
    with torch.no_grad():
        return proof.why_not_model(model, model.__call__)


def _inline(cls_name):
    return (f"the attention is computed inside {cls_name}.forward, not by an attention function: no point to cut the "
            "forward at")


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class WhereTheAttentionIsNotAFunction(unittest.TestCase):
    """The families whose attention is computed inline in the attention module's forward: no call to cut at."""

    @parameterized.expand([("bloom", "BloomAttention"), ("mpt", "MptAttention"), ("falcon", "FalconAttention")])
    def test_an_inline_attention_is_named(self, model_type, cls_name):
        self.assertEqual(_why(_small(model_type)), _inline(cls_name))

    def test_blooms_decode_forward_stays_eager_named_and_equals_stock(self):
        model = _small("bloom")
        ids, mask = prompt(batch=1)
        with emulated():
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        from transformers.generation.utils import GenerationMixin

        if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
            # 5.17's BLOOM makes its own inputs: transformers' loop runs, with no graphed forward to name
            self.assertEqual(tas.last_path().describe(), "deferred")
            self.assertIsNone(tas.last_path().forward)
        else:
            self.assertEqual(tas.last_path().forward, f"eager: {_inline('BloomAttention')}")


@unittest.skipUnless(RELEASES, "the dynamic-cache loop's releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class TheEagerFunctionEachReplayCalls(unittest.TestCase):
    """Each replay looks the attention function up as the forward does; one that is not transformers' own is seen."""

    def setUp(self):
        self.enterContext(emulated())
        self.model = EAGER["llama"]("cpu", torch.float32)
        self.ids, self.mask = prompt(batch=1)

    def _compare(self):
        _check_against_stock(self, self.model, self.ids, self.mask, max_new_tokens=8, do_sample=False,
                             eos_token_id=None)
        return tas.last_path().forward

    def test_a_users_eager_function_rebound_in_the_modeling_module_keeps_the_forward_eager(self):
        from transformers.models.llama import modeling_llama

        own = modeling_llama.eager_attention_forward
        calls = []

        def user_eager(*args, **kwargs):  # stock runs it at every step: so does the flag, eagerly
            calls.append(1)
            return own(*args, **kwargs)

        self.assertTrue(self._compare().startswith("graphed"))
        with mock.patch.object(modeling_llama, "eager_attention_forward", user_eager):
            path = self._compare()
        self.assertTrue(path.startswith("eager: "), path)
        self.assertTrue("eager_attention_forward was replaced" in path or "not transformers' own" in path, path)
        self.assertTrue(calls)
        self.assertTrue(self._compare().startswith("graphed"), "restored: graphed again")

    def test_a_users_function_registered_for_eager_keeps_the_forward_eager(self):
        from transformers import AttentionInterface
        from transformers.models.llama import modeling_llama

        def user_eager(*args, **kwargs):
            return modeling_llama.eager_attention_forward(*args, **kwargs)

        with mock.patch.dict(AttentionInterface._global_mapping, {"eager": user_eager}):
            path = self._compare()
        self.assertTrue(path.startswith("eager: "), path)
        self.assertIn("an attention function for eager that is not transformers' own", path)

    def test_transformers_own_function_registered_for_eager_is_the_one_each_replay_calls(self):
        # `get_interface("eager", eager_attention_forward)` returns a registered "eager" first: the recording
        # intercepts it there, and each replay calls it (SDPA's function over eager's materialised mask, whose
        # numbers differ from the module's eager function's)
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        with mock.patch.dict(AttentionInterface._global_mapping, {"eager": sdpa_attention_forward}):
            for _ in range(2):
                path = self._compare()
        self.assertTrue(path.startswith("graphed"), path)

    def test_the_attention_implementation_set_between_calls_records_under_it(self):
        model = build("llama")
        ids, mask = prompt(batch=1)
        for attn in ("sdpa", "eager", "sdpa", "eager"):
            model.set_attn_implementation(attn)
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
            self.assertTrue(tas.last_path().forward.startswith("graphed"), (attn, tas.last_path().forward))
        kinds = {key[5] for key in forward.graphs_of(model).recordings}
        self.assertIn(("remade", "eager"), kinds)

    def test_the_attention_weights_stand_in_refuses_any_op(self):
        from transformers_async_stop.graphs.piecewise import graphs

        weights = torch.Tensor._make_subclass(graphs._UnreadWeights, torch.empty(0, device="meta"))
        self.assertIsInstance(weights, torch.Tensor)
        with self.assertRaisesRegex(graphs.NotRecordable, "used the attention weights"):
            torch.add(weights, 1)
        with self.assertRaises(graphs.NotRecordable):
            weights.sum()


if __name__ == "__main__":
    unittest.main()
