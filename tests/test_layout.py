"""The package's layout holds: no import cycle among its modules, and the test-only CUDA-graph emulation
(`transformers_async_stop/testing/`) is not in the shipped import surface.

The import graph is read from the source (the AST of every module), with every `import` and `from ... import`
statement, the ones inside functions included, since a function-level import is a cycle deferred, not avoided.
`from X import a` is an edge to the module `X.a` where that is a module, else to `X`; the implicit import of a
module's parent package is not an edge (a package that imports its own submodules is not a cycle).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

PACKAGE = "transformers_async_stop"
ROOT = Path(__file__).resolve().parent.parent
TESTING = f"{PACKAGE}.testing"


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's `__init__`)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at module level or inside a function."""
    graph = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target:
                        edges.add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source not in modules:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    edges.add(sub if sub in modules else source)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


class NoImportCycle(unittest.TestCase):
    def test_no_module_of_the_package_imports_itself_through_others(self):
        graph = import_graph(package_modules())
        self.assertGreater(len(graph), 50)  # the walk found the package, not an empty folder
        self.assertEqual(cycles(graph), [])

    def test_the_check_sees_function_level_and_relative_imports(self):
        # a cycle closed only by an import inside a function is still found
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
        self.assertEqual(cycles(graph), [["a", "b", "c"]])
        modules = package_modules()
        edges = import_graph(modules)
        # a module-level relative import (loops/beam.py: `from ..config import _mark`) and one inside a function
        self.assertIn(f"{PACKAGE}.config", edges[f"{PACKAGE}.loops.beam"])
        self.assertIn(f"{PACKAGE}.control.step_lists", edges[f"{PACKAGE}.loops.static_loop.tail"])  # in a function

    def test_each_layer_imports_only_from_the_layers_below_it(self):
        # the top-level modules (the face and the patch entry points) aside; docs/how-it-works.md lists the layers
        order = ["state", "undo", "release_checks", "sync_free", "control", "graphs", "loops", "bench", "testing"]

        def layer(name):
            parts = name.split(".")
            return order.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in order) else None

        graph = import_graph(package_modules())
        upward = sorted((name, target) for name, edges in graph.items() for target in edges
                        if layer(name) is not None and layer(target) is not None and layer(target) > layer(name))
        self.assertEqual(upward, [])

    def test_no_runtime_module_imports_the_testing_subpackage(self):
        graph = import_graph(package_modules())
        runtime = {name: edges for name, edges in graph.items() if not name.startswith(TESTING)}
        offenders = {name: sorted(e for e in edges if e.startswith(TESTING)) for name, edges in runtime.items()}
        self.assertEqual({name: e for name, e in offenders.items() if e}, {})


_PROBE = textwrap.dedent("""
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import transformers_async_stop

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 64, (1, 5))
    for extra in ({}, {"cache_implementation": "static"}):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0,
                       async_stopping_criteria=True, **extra)
    assert transformers_async_stop.last_path() is not None
    print(sorted(name for name in sys.modules if name.startswith("transformers_async_stop.testing")))
""")


class EmulationStaysOutOfTheShippedSurface(unittest.TestCase):
    def _probe(self, prelude: str = "") -> str:
        env = dict(os.environ, TRANSFORMERS_ASYNC_STOP_FORCE="1", PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", prelude + _PROBE], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        return done.stdout.strip().splitlines()[-1]

    def test_import_and_a_forced_cpu_generate_leave_the_emulation_unloaded(self):
        self.assertEqual(self._probe(), "[]")

    def test_the_probe_sees_the_emulation_when_a_test_imports_it(self):
        loaded = self._probe("import transformers_async_stop.testing.emulation\n")
        self.assertIn("transformers_async_stop.testing.emulation", loaded)


if __name__ == "__main__":
    unittest.main()
