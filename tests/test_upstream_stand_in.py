"""The upstream check (scripts/upstream_check.sh, CI's `nox -s upstream`) runs tests/models.py and
tests/test_equivalence.py with an inert stand-in for the plug-in. Every plug-in attribute those files use must exist on
the stand-in, or the check dies with an AttributeError that only CI's last session shows (it did once: `passive_hook`)."""

import ast
import sys
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import upstream_equality  # noqa: E402  (defines the stand-in; imports nothing of the plug-in at import time)


def _plug_in_names(path):
    """`X` of every `from transformers_async_stop import X` and of every `tas.X` / `transformers_async_stop.X`, under whatever name the file imports the plug-in as."""
    tree = ast.parse(path.read_text())
    aliases, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "transformers_async_stop"}
        elif isinstance(node, ast.ImportFrom) and node.module == "transformers_async_stop":
            imported |= {a.name for a in node.names}
    return imported | {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
    }


class UpstreamStandIn(unittest.TestCase):
    def test_the_stand_in_has_every_plug_in_attribute_the_shared_cases_use(self):
        stand_in = upstream_equality.stand_in_module()
        seen = set()
        for path in upstream_equality.CASE_FILES:
            with self.subTest(file=path.name):
                used = _plug_in_names(path)
                seen |= used
                missing = sorted(name for name in used if not hasattr(stand_in, name))
                self.assertEqual(missing, [], f"{path.name} uses these plug-in names the stand-in lacks")
        self.assertIn("passive_hook", seen, "the scan no longer finds the plug-in's names in the shared cases")

    def test_the_stand_in_passive_hook_returns_the_hook_itself(self):
        hook = lambda module, args, output: None  # noqa: E731
        self.assertIs(upstream_equality.stand_in_module().passive_hook(hook), hook)


if __name__ == "__main__":
    unittest.main()
