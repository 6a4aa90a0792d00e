"""A replay follows the code that runs, not the file and line it names (issue 43, holes 2 to 5).

A recording is sound only for the code objects the proof saw run and for the state they can read. Each case changes
what runs in a way the file's text does not show, then compares the flag with unpatched stock on the CPU with the
graphs emulated (sequences and logits, two calls): stock's next forward runs the new code, so the flag must too (the
path records again, or stays eager, named in `last_path()`).

- code compiled from a string into a modeling module's namespace (a source rewriter's patch), with a counter and a
  settings dict it reads;
- code compiled from an edited source under the modeling file's own name and line numbers;
- a function's `__code__` replaced in place (IPython's `%autoreload`), a decorator's closure cell rebound, defaults
  and keyword defaults set or edited;
- a `functools.partial` activation whose keywords are edited, and a C-level callable whose state the proof cannot
  read (its class's `__call__` swapped).
For a hand-read family (Llama) and a found one (OLMo) where both apply.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
import unittest
from unittest import mock

import torch

import transformers_async_stop as tas
from family_models import build_family
from models import TRANSFORMERS_VERSION, prompt, stock
from test_piecewise import _generate
from transformers_async_stop.graphs.piecewise import proof
from transformers_async_stop.graphs.piecewise.proof.callables import CallableState
from transformers_async_stop.testing.emulation import emulated

RELEASES = (5, 17) <= TRANSFORMERS_VERSION <= (5, 24)
_KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
_MODULES = {"llama": "transformers.models.llama.modeling_llama", "olmo": "transformers.models.olmo.modeling_olmo"}


def _rotate_half_doubled(x):
    """`rotate_half` scaled by 2: the code a user's edit runs (its `__code__` has no free variables, as the
    original's)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1) * 2


class _CAct:
    """A callable whose call is C code (a builtin) and whose state is its class: nothing Python runs in it."""

    __call__ = staticmethod(torch.tanh)


@unittest.skipUnless(RELEASES, "transformers 5.17-5.24")
class ReplaysFollowTheCode(unittest.TestCase):
    def setUp(self):
        self.enterContext(emulated())
        self.ids, self.mask = prompt(batch=1)

    def _same(self, model, before=lambda call: None):
        """Two calls of stock and of the flag, `before(call)` run before each (the same state for stock's call and
        the flag's); equal sequences and logits."""
        for call in range(2):
            before(call)
            with stock():
                ref, _ = _generate(model, self.ids, self.mask, None, **_KW)
            before(call)
            out, _ = _generate(model, self.ids, self.mask, True, **_KW)
            self.assertTrue(torch.equal(ref.sequences, out.sequences), "sequences differ from stock")
            for a, b in zip(ref.logits, out.logits):
                self.assertTrue(torch.equal(a, b), "logits differ from stock")
        return tas.last_path().forward

    def _warm(self, model):
        self._same(model)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)

    @contextlib.contextmanager
    def _installed(self, family, name, function):
        """`function` as the modeling module's `name`, as if installed before this process first saw the name (a
        patcher applied at import: the rebinding check has nothing earlier to compare with)."""
        module = importlib.import_module(_MODULES[family])
        with mock.patch.object(module, name, function), mock.patch.dict(proof.names._FIRST_SEEN, clear=True):
            yield module

    # hole 2: a source rewriter's patch, compiled from a string and run in the modeling module's namespace; it keeps
    # a call counter and reads a settings dict the user edits between calls
    def test_code_compiled_from_a_string_into_a_modeling_module_stays_eager(self):
        for family in ("olmo", "llama"):
            with self.subTest(family=family):
                model = build_family(family)
                module = importlib.import_module(_MODULES[family])
                scope = dict(vars(module))
                exec(compile("SETTINGS = {'scale': 1.0}\ncalls = [0]\n"
                             "def rotate_half(x):\n"
                             "    calls[0] += 1\n"
                             "    x1 = x[..., : x.shape[-1] // 2]\n"
                             "    x2 = x[..., x.shape[-1] // 2:]\n"
                             "    return torch.cat((-x2, x1), dim=-1) * (SETTINGS['scale'] + calls[0] // 30)\n",
                             "<patch>", "exec"), scope)
                with self._installed(family, "rotate_half", scope["rotate_half"]):
                    def edit(call):
                        scope["calls"][0] = 0
                        scope["SETTINGS"]["scale"] = 1.0 + call / 2
                    why = self._same(model, edit)
                self.assertIn("compiled from a string", why)

    # hole 3: the same kind of patch compiled under the modeling file's own name and line numbers: the proof judged
    # the file's text at that line, which is not what ran
    def test_code_compiled_from_another_source_under_the_files_name_stays_eager(self):
        for family in ("olmo", "llama"):
            with self.subTest(family=family):
                model = build_family(family)
                module = importlib.import_module(_MODULES[family])
                text = open(module.__file__).read()
                line = "    return torch.cat((-x2, x1), dim=-1)\n"
                self.assertIn(line, text)
                edited = text.replace(line, "    return torch.cat((-x2, x1), dim=-1) * SETTINGS['scale']\n", 1)
                # the edited `rotate_half`'s code object, made a function of the module itself (its own globals)
                code = next(const for const in compile(edited, module.__file__, "exec").co_consts
                            if getattr(const, "co_name", None) == "rotate_half")
                settings = {"scale": 1.0}
                with self._installed(family, "rotate_half", types.FunctionType(code, vars(module), "rotate_half")), \
                        mock.patch.dict(vars(module), {"SETTINGS": settings}):
                    why = self._same(model, lambda call: settings.update(scale=1.0 + call / 2))
                self.assertIn("not the code its file's text compiles to", why)

    # hole 4: a function's code replaced in place between calls (IPython's `%autoreload`): the function object, which
    # the rebinding check compares, is the same
    def test_a_functions_code_replaced_in_place_between_calls_is_followed(self):
        for family in ("olmo", "llama"):
            with self.subTest(family=family):
                model = build_family(family)
                module = importlib.import_module(_MODULES[family])
                self._warm(model)
                original = module.rotate_half.__code__
                module.rotate_half.__code__ = _rotate_half_doubled.__code__
                try:
                    why = self._same(model)
                finally:
                    module.rotate_half.__code__ = original
                self.assertIn("code the package has not read ran", why)

    # hole 4: a decorator's wrapper keeps the function it wraps in a closure cell; rebound there, the class attribute
    # (the wrapper) is the same object
    def test_a_decorators_closure_cell_rebound_between_calls_is_followed(self):
        model = build_family("llama")
        wrapper = vars(type(model))["forward"]
        cells = [cell for cell in wrapper.__closure__ or () if callable(getattr(cell, "cell_contents", None))]
        self.assertTrue(cells, "LlamaForCausalLM.forward is expected to be a decorator's wrapper")
        cell = cells[0]
        original = cell.cell_contents

        def scaled(*args, **kwargs):
            out = original(*args, **kwargs)
            out.logits.mul_(2)
            return out

        self._warm(model)
        cell.cell_contents = scaled
        try:
            why = self._same(model)
        finally:
            cell.cell_contents = original
        self.assertIn("code the package has not read ran", why)

    # hole 5: a `functools.partial` activation (a C callable: nothing of it is traced) whose keywords are edited
    def test_a_partial_activation_whose_keywords_are_edited_between_calls_is_followed(self):
        for family in ("olmo", "llama"):
            with self.subTest(family=family):
                model = build_family(family)
                act = functools.partial(torch.nn.functional.gelu, approximate="tanh")
                for layer in model.model.layers:
                    del layer.mlp.act_fn
                    layer.mlp.act_fn = act
                self._warm(model)
                act.keywords["approximate"] = "none"
                why = self._same(model)
                self.assertTrue(why.startswith("graphed"), why)

    # hole 5: a callable whose state the proof cannot read (its class's `__call__` is swapped between calls) keeps the
    # forward eager, named
    def test_a_callable_whose_state_cannot_be_read_stays_eager(self):
        model = build_family("olmo")
        act = _CAct()
        for layer in model.model.layers:
            del layer.mlp.act_fn
            layer.mlp.act_fn = act
        with mock.patch.object(_CAct, "__call__", staticmethod(torch.tanh)):
            why = self._same(model, lambda call: setattr(_CAct, "__call__", staticmethod(
                (torch.tanh, torch.sigmoid)[call])))
        self.assertIn("whose state the proof cannot read", why)


class CodeStateCompared(unittest.TestCase):
    """`callables.CallableState`: what `ModelGraphs.changed` compares of the functions a replay skips."""

    def test_code_defaults_keyword_defaults_and_closures_are_compared(self):
        def outer():
            scale = 2

            def inner(x, y=1, *, z=3):
                return x * scale + y + z
            return inner

        inner = outer()
        for change, undo in (
                (lambda: setattr(inner, "__defaults__", (5,)), lambda: setattr(inner, "__defaults__", (1,))),
                (lambda: inner.__kwdefaults__.update(z=4), lambda: inner.__kwdefaults__.update(z=3)),
                (lambda: setattr(inner.__closure__[0], "cell_contents", 7),
                 lambda: setattr(inner.__closure__[0], "cell_contents", 2))):
            undo()
            state = CallableState([inner])
            self.assertFalse(state.changed())
            change()
            self.assertTrue(state.changed())
            undo()

    def test_a_code_object_swapped_in_place_is_a_change(self):
        def f(x):
            return x + 1

        state = CallableState([f])
        original = f.__code__
        f.__code__ = (lambda x: x + 2).__code__
        self.assertTrue(state.changed())
        f.__code__ = original
        self.assertFalse(state.changed())

    def test_a_partials_keywords_and_its_function_inside_are_compared(self):
        def g(x, scale=1):
            return x * scale

        act = functools.partial(g, scale=2)
        state = CallableState([act])
        self.assertFalse(state.changed())
        act.keywords["scale"] = 3
        self.assertTrue(state.changed())
        act.keywords["scale"] = 2
        g.__defaults__ = (4,)
        self.assertTrue(state.changed(), "the function a partial holds is followed")

    def test_a_callable_of_a_users_class_is_named_unreadable(self):
        self.assertIn("whose state the proof cannot read", CallableState([_CAct()]).unreadable)
        self.assertIsNone(CallableState([torch.tanh, torch.nn.functional.gelu, len]).unreadable)


if __name__ == "__main__":
    unittest.main()
