"""A transformers release the package was not checked against is said once per process, with the fast paths it
turns off; outputs stay exact."""

from __future__ import annotations

import unittest
import warnings

import torch

import transformers_async_stop as tas
from transformers_async_stop.release_checks import release_notice, verified
from transformers_async_stop.release_checks.targets import SHORTCUTS, present_in

from models import PAD, TRANSFORMERS_VERSION, build, prompt, stock

CHECKED_HERE = release_notice.installed_version() <= release_notice.NEWEST_CHECKED


def _a_claimed_shortcut(version) -> str:
    return next(s.name for s in SHORTCUTS if present_in(s, version))


class ReleaseNotice(unittest.TestCase):
    def setUp(self):
        release_notice.reset()
        self.addCleanup(release_notice.reset)
        self.model = build("llama")
        self.ids, self.mask = prompt()

    def _pretend(self, version: str | None = None, off: str | None = None):
        """The installed transformers says `version`; the shortcut `off` has a source the tables do not list."""
        if version is not None:
            saved = release_notice.installed_release
            release_notice.installed_release = lambda: version
            self.addCleanup(setattr, release_notice, "installed_release", saved)
        if off is not None:
            saved = verified._RESULTS.get(off)
            verified._RESULTS[off] = False
            self.addCleanup(lambda: verified._RESULTS.pop(off) if saved is None
                            else verified._RESULTS.update({off: saved}))

    def _generate(self, flag):
        kwargs = dict(max_new_tokens=6, pad_token_id=PAD, do_sample=False)
        if flag:
            kwargs["async_stopping_criteria"] = True
        return self.model.generate(self.ids, attention_mask=self.mask, **kwargs)

    def _flagged_calls(self, n):
        outs, notices = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                outs.append(self._generate(True))
                notices.append(tas.last_path().notice)
        return outs, notices, [w for w in caught if issubclass(w.category, tas.NewerReleaseWarning)]

    def test_a_newer_release_warns_once_naming_it_and_the_fast_paths_off(self):
        shortcut = _a_claimed_shortcut((5, 99))
        self._pretend(version="5.99.0", off=shortcut)
        with stock():
            ref = self._generate(False)
        outs, notices, notes = self._flagged_calls(3)
        self.assertEqual(len(notes), 1, "one warning per process")
        text = str(notes[0].message)
        self.assertIn("transformers 5.99.0", text)
        self.assertIn(shortcut, text)
        self.assertIn("Outputs are still exact", text)
        self.assertEqual(notices, [text] * 3, "every flagged call's last_path() says it")
        for out in outs:
            self.assertTrue(torch.equal(out, ref))

    def test_a_changed_source_on_a_checked_release_is_said_too(self):
        version = release_notice.installed_version()
        if not CHECKED_HERE:
            self.skipTest("this transformers is newer than the releases checked")
        shortcut = _a_claimed_shortcut(TRANSFORMERS_VERSION)
        self._pretend(off=shortcut)
        _, notices, notes = self._flagged_calls(2)
        self.assertEqual(len(notes), 1)
        self.assertIn("sources differ", str(notes[0].message))
        self.assertIn(shortcut, str(notes[0].message))
        self.assertIn(".".join(map(str, version)), notices[1])

    def test_a_checked_release_says_nothing(self):
        if not CHECKED_HERE:
            self.skipTest("this transformers is newer than the releases checked")
        _, notices, notes = self._flagged_calls(1)
        self.assertEqual(notes, [])
        self.assertEqual(notices, [None])

    def test_a_flag_off_call_says_nothing(self):
        self._pretend(version="5.99.0")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=3, pad_token_id=PAD,
                                async_stopping_criteria=False)
        self.assertFalse([w for w in caught if issubclass(w.category, tas.NewerReleaseWarning)])


if __name__ == "__main__":
    unittest.main()
