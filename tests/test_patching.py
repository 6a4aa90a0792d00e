"""apply()/unpatch()/is_patched(): identity, idempotence, and drift against the installed transformers."""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import subprocess
import sys
import textwrap
import unittest

import pytest
from parameterized import parameterized
from transformers import GenerationConfig

import transformers_async_stop as tas
from transformers_async_stop import patching
from transformers_async_stop.release_checks import verified
from transformers_async_stop.release_checks.targets import SHORTCUTS, TARGETS, Target, present_in

from models import PAD, TRANSFORMERS_VERSION, build, prompt

# the drift test (`drift`): `nox -s releases` runs it with the `core` tests on every minor release (pytest.ini); the
# fresh-interpreter apply/unpatch test (13 s on 2 cores, most of it importing transformers) runs in the full suites

TARGETS_FILE = inspect.getsourcefile(importlib.import_module("transformers_async_stop.release_checks.targets"))


class ApplyUnpatch(unittest.TestCase):
    def test_unpatch_restores_the_very_same_objects_and_apply_patches_again(self):
        # A fresh interpreter sees transformers' own objects before our import touches them.
        script = textwrap.dedent(f"""
            import importlib, importlib.util
            # read the target table without importing the package (whose import patches)
            spec = importlib.util.spec_from_file_location("targets_only", {str(TARGETS_FILE)!r})
            targets_only = importlib.util.module_from_spec(spec)
            import sys; sys.modules["targets_only"] = targets_only
            spec.loader.exec_module(targets_only)
            TARGETS = targets_only.TARGETS
            def raw():
                found = {{}}
                for t in TARGETS:
                    owner = t.resolve_owner()
                    found[t.name] = vars(owner).get(t.attr, "<absent>")
                return found
            import transformers.generation.utils, transformers.masking_utils
            before = raw()
            import transformers_async_stop as tas
            patched = raw()
            changed = [n for n in before if before[n] is not patched[n]]
            assert changed, "nothing was patched"
            assert tas.is_patched()
            assert tas.apply() == [], "a second apply() must be a no-op"
            importlib.reload(tas)  # a second import runs apply() again
            again = raw()
            assert all(again[n] is patched[n] for n in patched), "re-import replaced patches"
            tas.unpatch()
            assert not tas.is_patched()
            restored = raw()
            wrong = [n for n in before if restored[n] is not before[n]]
            assert not wrong, f"not restored exactly: {{wrong}}"
            tas.apply()
            assert all(raw()[n] is not before[n] for n in changed), "apply() after unpatch() did not patch"
            print("CHANGED", len(changed))
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("CHANGED", result.stdout)

    @pytest.mark.drift
    def test_patched_methods_keep_name_signature_and_original(self):
        from transformers.generation.utils import GenerationMixin

        for name in ("generate", "_sample", "_has_unfinished_sequences"):
            patched = getattr(GenerationMixin, name)
            self.assertEqual(patched.__name__, name)
            self.assertTrue(hasattr(patched, "__wrapped__"))
            self.assertEqual(inspect.signature(patched), inspect.signature(patched.__wrapped__))

    @pytest.mark.drift
    def test_a_missing_target_is_logged_once_not_raised(self):
        ghost = Target("GenerationMixin._ghost", "transformers.generation.utils", "GenerationMixin",
                       "_ghost_target_removed_upstream", "generation:patched_generate", why="test")
        saved = patching.TARGETS
        patching.TARGETS = saved + (ghost,)
        try:
            with self.assertLogs("transformers_async_stop", level=logging.WARNING) as logs:
                patching.apply()
                patching.apply()
            self.assertEqual(sum("_ghost_target_removed_upstream" in line or "GenerationMixin._ghost" in line
                                 for line in logs.output), 1)
            self.assertIn("GenerationMixin._ghost", tas.skipped())
        finally:
            patching.TARGETS = saved
            patching._SKIPPED.pop("GenerationMixin._ghost", None)


@pytest.mark.drift
class UnpatchLeavesStock(unittest.TestCase):
    """After `unpatch()`, objects created while patched behave as stock transformers treats them: the field is an
    unknown generate() keyword again. `apply()` brings the field back with its values."""

    def setUp(self):
        self.addCleanup(tas.apply)

    def _generate(self, model, **kw):
        ids, mask = prompt(batch=1)
        return model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kw)

    def _stock_error(self, value):
        tas.unpatch()
        with self.assertRaises(ValueError) as raised:
            self._generate(build("llama"), async_stopping_criteria=value)
        tas.apply()
        return str(raised.exception)

    def test_a_model_built_while_patched_rejects_the_flag_like_stock_after_unpatch(self):
        for value in (True, "yes"):
            with self.subTest(value=value):
                expected = self._stock_error(value)
                model = build("llama")  # built while patched: its generation config holds the field
                tas.unpatch()
                with self.assertRaises(ValueError) as raised:
                    self._generate(model, async_stopping_criteria=value)
                self.assertEqual(str(raised.exception), expected)
                self.assertIn("async_stopping_criteria", expected)
                tas.apply()

    def test_a_config_created_while_patched_loses_the_field_after_unpatch(self):
        config = GenerationConfig(async_stopping_criteria=True)
        tas.unpatch()
        self.assertFalse(hasattr(config, "async_stopping_criteria"))
        self.assertFalse(hasattr(GenerationConfig(), "async_stopping_criteria"))
        # stock keeps an unknown keyword as a plain attribute, unchecked
        self.assertEqual(GenerationConfig(async_stopping_criteria="yes").async_stopping_criteria, "yes")

    def test_apply_after_unpatch_gives_the_values_back(self):
        model = build("llama")
        model.generation_config.async_stopping_criteria = True
        tas.unpatch()
        tas.apply()
        self.assertIs(model.generation_config.async_stopping_criteria, True)
        with self.assertRaises(ValueError):
            GenerationConfig(async_stopping_criteria="yes")
        self._generate(model)  # the model's own flag is valid again

    def test_a_deep_copy_validated_while_patched_loses_the_field_too(self):
        copied = copy.deepcopy(GenerationConfig(do_sample=True))
        copied.validate()
        tas.unpatch()
        self.assertFalse(hasattr(copied, "async_stopping_criteria"))


@pytest.mark.drift
class Drift(unittest.TestCase):
    """Fails loudly when transformers renames, removes, or re-signs a target this release is expected to have."""

    @parameterized.expand([(t.name, t) for t in TARGETS])
    def test_target_matches_the_installed_transformers(self, name, target):
        expected = present_in(target, TRANSFORMERS_VERSION)
        owner = target.resolve_owner()
        if expected is None:
            return  # a field we add: nothing upstream to drift
        original = patching.original(target.name)
        if not expected:
            self.assertIsNone(original, f"{name} is back in transformers {TRANSFORMERS_VERSION}: update targets/patches.py")
            return
        self.assertIsNotNone(original, f"{name} is gone from transformers {TRANSFORMERS_VERSION}: update targets/patches.py")
        self.assertTrue(hasattr(owner, target.attr))
        if target.params:
            params = inspect.signature(original.__init__ if inspect.isclass(original) else original).parameters
            missing = [p for p in target.params if not any(name in params for name in p.split("|"))]
            self.assertFalse(missing, f"{name} lost parameters {missing}: its replacement relies on them")

    @parameterized.expand([(s.name, s) for s in SHORTCUTS])
    def test_shortcut_sources_are_ones_it_was_checked_against(self, name, shortcut):
        """On the releases a shortcut claims, every upstream source behind it has a digest listed in targets/shortcuts.py; a
        release that changed one fails here (the shortcut is off there: the stock code runs, exact but slower)."""
        expected = present_in(shortcut, TRANSFORMERS_VERSION)
        found = verified.installed_digests(name)
        unknown = {src: digest for src, digest in found.items() if digest not in shortcut.digests.get(src, {})}
        if expected:
            self.assertEqual(unknown, {}, f"{name}: sources not read for this release; review them and list "
                                          "their digests in targets.SHORTCUTS (scripts/source_digests.py)")
            self.assertTrue(verified.matches(name))
        else:
            self.assertFalse(verified.matches(name), f"{name} matches outside the releases it claims")

    def test_every_expected_target_is_patched(self):
        patched = {entry[0] for entry in patching._ORIGINALS.values()}
        for target in TARGETS:
            if present_in(target, TRANSFORMERS_VERSION):
                self.assertIn(target.name, patched)

    def test_reload_keeps_the_registry(self):
        importlib.reload(tas)
        self.assertTrue(tas.is_patched())


if __name__ == "__main__":
    unittest.main()
