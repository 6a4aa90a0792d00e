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
