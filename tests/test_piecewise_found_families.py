"""The graphed decode forward of the families no one read by hand (issue 36): found from the model
(`graphs/piecewise/proof/discover.py`) and proven per recording from what it ran (`proof/verdict.py`).

Every family of the table (tests/family_models.py) on CUDA (skipped without it) and on the CPU with the graphs
emulated: bit-exact against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after
the call), greedy and sampling, batch 1 and a left-padded batch; `last_path().forward` says graphed (padded too), or, for the
families kept eager by design (Falcon; OPT on 5.17), why. Then the proof's own parts: the rules on unread code, the normal
form of modular copies, the op comparison of two recordings, foreign code that ran, a trace function already set.
"""

from __future__ import annotations

import ast
import sys
import textwrap
import unittest
from unittest import mock

import torch
from parameterized import parameterized

import transformers_async_stop as tas
from family_models import EAGER, FAMILIES, build_family, sdpa_supported
from models import TRANSFORMERS_VERSION, prompt
from test_piecewise import _check_against_stock
from transformers_async_stop.graphs import piecewise
from transformers_async_stop.graphs.piecewise.proof import normal_form, rules, verdict
from transformers_async_stop.graphs.piecewise.proof.watch import RunWatch
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
CUDA = torch.cuda.is_available() and RELEASES


class _FamilyCases:
    """Each family on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"
    DTYPE = torch.bfloat16

    @parameterized.expand([(f"{family}_{kind}", family, kind) for family in FAMILIES
                           for kind in ("greedy", "sample", "padded")])
    def test_each_family_equals_stock_and_says_its_path(self, _, family, kind):
        if not sdpa_supported(family):
            self.skipTest(f"{family}: this release builds it without SDPA")
        model = build_family(family, device=self.DEVICE, dtype=self.DTYPE)
        padded = kind == "padded"
        ids, mask = prompt(batch=3 if padded else 1, left_pad=padded, device=self.DEVICE)
        for _ in range(2):  # the second call replays what the first recorded (a family proven per recording)
            _check_against_stock(self, model, ids, mask, max_new_tokens=10, do_sample=kind == "sample",
                                 eos_token_id=None)
        path = tas.last_path()
        self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward "), path.describe())
        # a padded batch too: each replay makes its masks with stock's functions from the step's 2D mask
        if family in EAGER:
            self.assertTrue(any(why in path.forward for why in EAGER[family]), f"{family}: {path.forward}")
        else:
            self.assertTrue(path.forward.startswith("graphed ("), f"{family}: {path.forward}")


@unittest.skipUnless(CUDA, "CUDA and transformers 5.17-5.24")
class FoundFamiliesCuda(_FamilyCases, unittest.TestCase):
    pass


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class FoundFamiliesEmulated(_FamilyCases, unittest.TestCase):
    DEVICE = "cpu"
    DTYPE = torch.float32

    def setUp(self):
        self.enterContext(emulated())


# transformers' activations (`ACT2FN`) a config may name: each runs its own class, read with no family but Llama's
# SiLU, GPT-2's new GELU and Gemma 3's GELU-tanh
ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_pytorch_tanh",
               "laplace", "linear", "mish", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "silu", "tanh")


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class ActivationsAndDecoders(unittest.TestCase):
    """A hand-read family running a class no one read with it, and a decoder with cross-attention (emulated)."""

    def setUp(self):
        self.enterContext(emulated())

    @parameterized.expand([(name,) for name in ACTIVATIONS])
    def test_a_read_family_with_any_activation_equals_stock_and_is_proven_per_recording(self, activation):
        from models import build

        model = build("llama", config_kwargs={"hidden_act": activation})
        ids, mask = prompt(batch=1)
        for _ in range(2):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        forward = tas.last_path().forward
        act = type(model.model.layers[0].mlp.act_fn)
        if act.__module__.startswith("transformers.") or act in (torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh,
                                                                 torch.nn.GELU, torch.nn.Identity):
            self.assertTrue(forward.startswith("graphed ("), f"{activation}: {forward}")
        else:  # a torch module off the proven list (`proven.TORCH_MODULES`): named
            self.assertIn(act.__name__, forward)

    def test_whispers_causal_lm_steps_aside_named(self):
        from transformers import WhisperConfig, WhisperForCausalLM

        config = WhisperConfig(vocab_size=48, d_model=16, decoder_layers=2, decoder_attention_heads=2,
                               encoder_layers=2, encoder_attention_heads=2, decoder_ffn_dim=32, encoder_ffn_dim=32,
                               max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               decoder_start_token_id=1)
        torch.manual_seed(0)
        model = WhisperForCausalLM(config).eval()
        model.config._attn_implementation = "sdpa"
        ids, mask = prompt(batch=1)
        _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        # found (its decoder layers' self-attention, beside the cross-attention), but it finds its positions itself
        self.assertEqual(tas.last_path().forward,
                         "eager: a forward without position_ids (the model finds the positions itself)")


def _def(source: str):
    return ast.parse(textwrap.dedent(source)).body[0]


def _all_lines(node) -> set:
    return set(range(node.lineno, node.end_lineno + 1))


class TheRulesRefuseWhatAReplayWouldBakeIn(unittest.TestCase):
    """`proof/rules.py` on functions that ran every line."""

    CASES = {
        "reads 'get_seq_length' on the host (a cache's length)": "def f(x, past_key_values):\n"
                                                                 "    n = past_key_values.get_seq_length()\n"
                                              "    return x[:, :n]",
        "reads the cache on the host (len())": "def f(x, cache):\n    return x * len(cache)",
        "reads 'get_mask_sizes' on the host (a cache's length)": "def f(x, **kwargs):\n    c = kwargs['cache']\n"
                                                                 "    return x[:, :c.get_mask_sizes()[0]]",
        "reads the cache on the host (getattr())": "def f(x, past_key_values):\n"
                                                   "    return getattr(past_key_values, 'layers')",
        "sets the attribute 'calls'": "def f(self, x):\n    self.calls += 1\n    return x",
        "a global statement": "def f(x):\n    global STEP\n    return x",
        "writes into an object it did not make": "def f(self, x):\n    self.seen[0] = x\n    return x",
        "reads 'time' on the host": "def f(x):\n    return x * time.time()",
        "reads the device on the host (.item())": "def f(x):\n    return x * x.sum().item()",
        "writes a log every step (logger.warning)": "def f(x):\n    logger.warning('step')\n    return x",
        "reads the global 'KNOBS', a dict its module keeps": "def f(x):\n    return x * KNOBS['scale']",
    }

    @parameterized.expand(list(CASES.items()))
    def test_a_rule_refuses(self, why, source):
        node = _def(source)
        refused = rules.why_refused(node, _all_lines(node), {"KNOBS": {"scale": 2.0}})
        self.assertIsNotNone(refused)
        self.assertIn(why, refused)

    def test_what_a_decode_forward_does_passes(self):
        node = _def("""
        def forward(self, hidden_states, past_key_values=None, input=None, **kwargs):
            if past_key_values is not None:
                keys, values = past_key_values.update(hidden_states, hidden_states, self.layer_idx)
            out = torch.zeros_like(hidden_states)
            out[..., :2] = hidden_states[..., :2] * self.scaling
            logger.warning_once("once")
            return self.proj(out), past_key_values, input
        """)
        self.assertIsNone(rules.why_refused(node, _all_lines(node), {}))

    def test_lines_that_did_not_run_are_not_judged(self):
        node = _def("""
        def forward(self, x, past_key_values, position_ids=None):
            if position_ids is None:
                position_ids = past_key_values.get_seq_length()
            return x
        """)
        ran = {node.lineno + 1, node.lineno + 3}  # the `if` and the return: its body did not run
        self.assertIsNone(rules.why_refused(node, ran, {}))
        self.assertIsNotNone(rules.why_refused(node, ran | {node.lineno + 2}, {}))


class ModularCopiesAreTheReadCode(unittest.TestCase):
    """`proof/normal_form.py`: a family's copy of read code, renamed, has the read code's normal digest."""

    @unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
    def test_olmos_decoder_layer_is_llamas_and_its_attention_is_not(self):
        from transformers.models.llama import modeling_llama
        from transformers.models.olmo import modeling_olmo

        def digest(function, prefix):
            return normal_form.normal_digest(normal_form.function_node(function), prefix)

        self.assertEqual(digest(modeling_olmo.OlmoDecoderLayer.forward, "Olmo"),
                         digest(modeling_llama.LlamaDecoderLayer.forward, "Llama"))
        # Olmo's attention clips q/k/v by a config value: not Llama's
        self.assertNotEqual(digest(modeling_olmo.OlmoAttention.forward, "Olmo"),
                            digest(modeling_llama.LlamaAttention.forward, "Llama"))

    def test_docstrings_and_annotations_do_not_count_but_code_does(self):
        a = _def('def f(x: int) -> int:\n    """doc"""\n    return AbcMLP(x)')
        b = _def("def f(x):\n    return XyzMLP(x)")
        c = _def("def f(x):\n    return XyzMLP(x) + 1")
        self.assertEqual(normal_form.normal_digest(a, "Abc"), normal_form.normal_digest(b, "Xyz"))
        self.assertNotEqual(normal_form.normal_digest(a, "Abc"), normal_form.normal_digest(c, "Xyz"))


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class TheProofOfARecording(unittest.TestCase):
    """`proof/verdict.py` and its use by the piecewise forward (CPU, emulated)."""

    def setUp(self):
        self.enterContext(emulated())

    def _olmo(self):
        model = build_family("olmo")
        ids, mask = prompt(batch=1, device="cpu")
        return model, ids, mask

    def test_ops_that_differ_between_two_positions_keep_the_forward_eager(self):
        model, ids, mask = self._olmo()
        runs = []
        original = piecewise.proof.judge_recording

        def judged(watch, family):
            runs.append(watch)
            if len(runs) == 2:  # the second recording ran one op more: a decision that moved with the position
                watch.ops.append(("aten.mul.Tensor", ("a scalar that moved",), ()))
            return original(watch, family)

        with mock.patch.object(piecewise.proof, "judge_recording", judged):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self.assertEqual(len(runs), 2)
        self.assertIn("two positions ran different ops", tas.last_path().forward)

    def test_a_family_that_ran_checked_code_replays_once_confirmed(self):
        model, ids, mask = self._olmo()
        verdicts = []
        original = piecewise.proof.judge_recording

        def judged(watch, family):
            given = original(watch, family)
            verdicts.append(given)
            return given

        with mock.patch.object(piecewise.proof, "judge_recording", judged):
            _check_against_stock(self, model, ids, mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
        self.assertEqual(len(verdicts), 2, "a first recording, then the one that confirms it")
        self.assertTrue(verdicts[0].checked, "Olmo's attention and layer norm differ from the read code")
        self.assertRegex(tas.last_path().forward, r"^graphed \(3 pieces\): \d+ decode steps; 1 eager: recorded once")

    def test_code_the_package_has_not_read_that_ran_keeps_the_forward_eager(self):
        model, ids, mask = self._olmo()
        norm = type(model.model.norm)
        original = norm.forward.__code__

        def user_norm(self, x):  # a user's function, in a test file: not transformers' code
            return x * 1.0

        # a code object swapped in place keeps the function object (no rebinding to see), as a debugger's edit would
        norm.forward.__code__ = user_norm.__code__
        try:
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        finally:
            norm.forward.__code__ = original
        forward = tas.last_path().forward
        self.assertTrue("not transformers' own" in forward or "has not read ran in the forward" in forward, forward)

    def test_a_trace_function_already_set_keeps_the_forward_eager(self):
        model, ids, mask = self._olmo()

        def tracer(frame, event, arg):
            return None

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
            self.assertIs(sys.gettrace(), tracer, "the recording left the caller's trace function in place")
        finally:
            sys.settrace(previous)
        self.assertIn("a trace function is set", tas.last_path().forward)

    def test_an_op_between_a_cache_update_and_its_attention_refuses_the_recording(self):
        watch = RunWatch(trace_ops=True)
        with watch:
            x = torch.ones(2)
            watch.between = True
            x = x * 2  # what a query scaled after the cache update would be
        judged = verdict.judge(watch, mock.Mock(causal_lm="OlmoForCausalLM", module="m"), frozenset())
        self.assertIn("ran between a cache update and its attention", judged.why)

    def test_the_names_two_recordings_ran_are_watched_once(self):
        from transformers_async_stop.graphs.piecewise.forward import graphs_of

        model = build_family("olmo")
        for batch in (1, 2):  # two recording keys, each proven and confirmed
            ids, mask = prompt(batch=batch, device="cpu")
            for _ in range(2):
                _check_against_stock(self, model, ids, mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        graphs = graphs_of(model)
        self.assertEqual(len(graphs.recordings), 2)
        pairs = [(id(table), name) for table, name, _ in graphs.functions]
        self.assertEqual(len(pairs), len(set(pairs)))
