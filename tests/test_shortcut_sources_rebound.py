"""`verified.matches` answers from the lookups that resolved a shortcut's sources, compared by identity at each call
(issue 38: it runs at every step of some loops): any of them rebound, a module, a class on its way or the function
itself, takes the verdict again from the installed source, as resolving every source by name did."""

from __future__ import annotations

import sys
import unittest

from transformers_async_stop.release_checks import verified
from transformers_async_stop.release_checks.targets import SHORTCUTS


def _shortcut(predicate):
    for shortcut in SHORTCUTS:
        if verified.matches(shortcut.name) and any(predicate(source) for source in shortcut.sources):
            return shortcut, next(source for source in shortcut.sources if predicate(source))
    raise unittest.SkipTest("no shortcut of that shape matches this release")


class ShortcutSourcesRebound(unittest.TestCase):
    def test_a_method_rebound_on_its_class_turns_the_shortcut_off(self):
        shortcut, source = _shortcut(lambda source: source.partition(":")[2].count(".") == 1)
        obj, holder, attr = verified.resolve_source(source)
        self.addCleanup(setattr, holder, attr, obj)

        def foreign(*args, **kwargs):  # user code: its source is none of the digested ones
            return obj(*args, **kwargs)

        setattr(holder, attr, foreign)
        self.assertFalse(verified.matches(shortcut.name))
        setattr(holder, attr, obj)
        self.assertTrue(verified.matches(shortcut.name))

    def test_a_class_rebound_in_its_module_turns_the_shortcut_off(self):
        shortcut, source = _shortcut(lambda source: source.partition(":")[2].count(".") == 1)
        module_name, _, qualname = source.partition(":")
        module, class_name = sys.modules[module_name], qualname.split(".")[0]
        original = getattr(module, class_name)
        replaced = type(class_name, (original,), {qualname.split(".")[1]: lambda self, *a, **k: None})
        self.addCleanup(setattr, module, class_name, original)
        setattr(module, class_name, replaced)
        self.assertFalse(verified.matches(shortcut.name))
        setattr(module, class_name, original)
        self.assertTrue(verified.matches(shortcut.name))

    def test_a_module_replaced_in_sys_modules_takes_the_verdict_again(self):
        shortcut, source = _shortcut(lambda source: True)
        module_name = source.partition(":")[0]
        original = sys.modules[module_name]
        self.addCleanup(sys.modules.__setitem__, module_name, original)
        sys.modules[module_name] = type(original)(module_name)  # an empty module of that name: nothing resolves
        self.assertFalse(verified.matches(shortcut.name))
        sys.modules[module_name] = original
        self.assertTrue(verified.matches(shortcut.name))

    def test_every_matching_shortcut_keeps_its_verdict_when_nothing_moved(self):
        matched = [shortcut.name for shortcut in SHORTCUTS if verified.matches(shortcut.name)]
        self.assertTrue(matched)
        self.assertTrue(all(verified.matches(name) for name in matched))
        # classmethod sources resolve to a new bound method at each lookup: compared by their function
        self.assertTrue(all(verified._LINKS.get(name) is not None for name in matched))


class ShortcutFunctionBodies(unittest.TestCase):
    """A source function's code, defaults or closure replaced in place (the same function object) takes the verdict
    again (red team of the issue-38 cuts, hole 2)."""

    def _function(self, predicate=lambda function: True):
        import types
        from unittest import mock

        for shortcut in SHORTCUTS:
            if not verified.matches(shortcut.name):
                continue
            for source in shortcut.sources:
                obj = verified.resolve_source(source)[0]
                function = getattr(obj, "__func__", obj)
                if type(function) is types.FunctionType and predicate(function):
                    return shortcut.name, function, mock
        raise unittest.SkipTest("no shortcut function of that shape")

    def _retaken(self, name, mock):
        with mock.patch.object(verified, "installed_digests", wraps=verified.installed_digests) as digests:
            verified.matches(name)
        return digests.call_count

    def test_code_replaced_in_place_takes_the_verdict_again(self):
        name, function, mock = self._function()
        code = function.__code__
        self.addCleanup(setattr, function, "__code__", code)
        self.assertEqual(self._retaken(name, mock), 0)
        function.__code__ = code.replace()  # an equal copy: another object
        self.assertEqual(self._retaken(name, mock), 1)
        function.__code__ = code
        self.assertEqual(self._retaken(name, mock), 1)
        self.assertEqual(self._retaken(name, mock), 0)

    def test_defaults_replaced_in_place_take_the_verdict_again(self):
        name, function, mock = self._function(lambda function: function.__defaults__)
        defaults = function.__defaults__
        self.addCleanup(setattr, function, "__defaults__", defaults)
        function.__defaults__ = tuple(defaults)[:-1] + (object(),)
        self.assertEqual(self._retaken(name, mock), 1)

    def test_a_closure_cell_rebound_takes_the_verdict_again(self):
        name, function, mock = self._function(
            lambda function: function.__closure__ and any(self._full(cell) for cell in function.__closure__))
        cell = next(cell for cell in function.__closure__ if self._full(cell))
        contents = cell.cell_contents
        self.addCleanup(setattr, cell, "cell_contents", contents)
        self.assertEqual(self._retaken(name, mock), 0)
        cell.cell_contents = object()
        self.assertEqual(self._retaken(name, mock), 1)

    @staticmethod
    def _full(cell) -> bool:
        try:
            cell.cell_contents
        except ValueError:
            return False
        return True


class SourcesReadOncePerObject(unittest.TestCase):
    """A source's digest is read once per (object, code): rebinding sources back and forth to objects already read
    (the benchmark's `unpatch()` / `apply()` around every stock call) reads and tokenizes no file again (issue 38:
    about 90 ms per call on an H200 host), while an object or code not read before still is."""

    def _verdicts(self):
        return {shortcut.name: verified.matches(shortcut.name) for shortcut in SHORTCUTS}

    def _cycle(self):
        import transformers_async_stop as tas

        tas.unpatch()
        try:
            unpatched = self._verdicts()
        finally:
            tas.apply()
        return unpatched, self._verdicts()

    def test_unpatch_apply_cycles_read_no_source_again(self):
        from unittest import mock

        first = self._cycle()  # the unpatched objects read once
        with mock.patch.object(verified.inspect, "getsource", wraps=verified.inspect.getsource) as read:
            again = [self._cycle() for _ in range(3)]
        self.assertEqual(read.call_count, 0, "sources read again for objects already read")
        self.assertTrue(all(cycle == first for cycle in again), "a verdict changed with nothing rebound")
        self.assertTrue(any(first[1].values()), "no shortcut matches this release: nothing was compared")

    def test_a_wrapped_chain_pointed_elsewhere_is_read_again(self):
        import functools
        import types

        shortcut, source = _shortcut(lambda source: source.partition(":")[2].count(".") == 1)
        obj, holder, attr = verified.resolve_source(source)
        function = getattr(obj, "__func__", obj)
        if type(function) is not types.FunctionType:
            raise unittest.SkipTest("the source is no plain function")
        self.addCleanup(setattr, holder, attr, holder.__dict__[attr])

        @functools.wraps(function)
        def wrapper(*args, **kwargs):  # transformers-looking wrapper: its source is this file's, not digested
            return function(*args, **kwargs)

        wrapper._transformers_async_stop_patched = True  # passes `_foreign_wrapper`: what it reads is `__wrapped__`
        setattr(holder, attr, wrapper)
        self.assertTrue(verified.matches(shortcut.name), "the wrapped original's source is the digested one")

        def other(*args, **kwargs):
            return function(*args, **kwargs)

        wrapper.__wrapped__ = other  # the same wrapper object, now showing another source
        self.assertNotEqual(verified.source_digest(wrapper), verified.source_digest(function))

    # red team of the memo (hole 1): `inspect` follows `__func__` for a bound method only; a replacement that holds
    # the original in a `__func__` attribute is its own source, read as such
    def _function_source(self):
        import types

        shortcut, source = _shortcut(lambda source: source.partition(":")[2].count(".") == 1)
        obj, holder, attr = verified.resolve_source(source)
        if type(obj) is not types.FunctionType:
            raise unittest.SkipTest("the source is no plain function")
        self.addCleanup(setattr, holder, attr, holder.__dict__[attr])
        return shortcut.name, obj, holder, attr

    def test_a_replacement_holding_the_original_as_func_is_read_as_itself(self):
        name, original, holder, attr = self._function_source()
        self.assertTrue(verified.matches(name))

        def replacement(*args, **kwargs):  # user code, not the digested source
            return original(*args, **kwargs)

        replacement.__func__ = original
        setattr(holder, attr, replacement)
        self.assertFalse(verified.matches(name), "the replacement was taken for the original it holds")

        class Held:  # a callable instance holding it the same way
            __func__ = original

            def __call__(self, *args, **kwargs):
                return original(*args, **kwargs)

        setattr(holder, attr, Held())
        self.assertFalse(verified.matches(name))
        setattr(holder, attr, original)
        self.assertTrue(verified.matches(name), "the original restored is the digested source again")

    def test_a_digest_is_each_objects_own(self):
        import hashlib
        import inspect
        import textwrap

        name, original, holder, attr = self._function_source()

        def fresh(obj):
            return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode("utf-8")).hexdigest()[:12]

        def other(*args, **kwargs):
            return original(*args, **kwargs)

        other.__func__ = original
        self.assertEqual(verified.source_digest(other), fresh(other))
        self.assertEqual(verified.source_digest(original), fresh(original))
        self.assertNotEqual(verified.source_digest(other), verified.source_digest(original))

    def test_a_digested_replacement_is_not_kept_alive(self):
        import gc
        import weakref

        name, original, holder, attr = self._function_source()

        class Payload:  # what a user's replacement may capture: a model, tensors
            pass

        payload = Payload()
        kept = weakref.ref(payload)

        def replacement(*args, _payload=payload, **kwargs):
            return original(*args, **kwargs)

        setattr(holder, attr, replacement)
        self.assertFalse(verified.matches(name))
        setattr(holder, attr, original)
        self.assertTrue(verified.matches(name))
        del replacement, payload
        gc.collect()
        self.assertIsNone(kept(), "the memo keeps a digested replacement (and what it captured) alive")
