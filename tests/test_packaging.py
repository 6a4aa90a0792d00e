"""The wheel a user would install: built from the package's files alone, installed into a fresh virtual environment
outside the repository, imported from there; its metadata names the licence, the author, the project URLs and only
the requirements the package imports, and the index page's description has no repository-relative link.

Offline: the wheel is built with the running interpreter's setuptools (`--no-build-isolation`) and installed with
`--no-deps`; the fresh environment reaches torch and transformers through a path file, as a system site would."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import unittest
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("setup.py", "README.md", "LICENSE", "CHANGELOG.md", "transformers_async_stop")


def _run(*cmd, cwd=None) -> str:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result.stdout


class Wheel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix="tas-wheel-"))
        source = cls.tmp / "source"
        source.mkdir()
        for name in SHIPPED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, source / name)
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
             "-w", str(cls.tmp / "dist"), str(source))
        (cls.wheel,) = (cls.tmp / "dist").glob("transformers_async_stop-*.whl")
        with zipfile.ZipFile(cls.wheel) as archive:
            cls.names = archive.namelist()
            (meta,) = [n for n in cls.names if n.endswith(".dist-info/METADATA")]
            cls.metadata = email.message_from_bytes(archive.read(meta))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_installs_into_a_fresh_environment_and_imports_from_there(self):
        venv = self.tmp / "venv"
        _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
        python = venv / "bin" / "python"
        site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
        # torch and transformers from the running environment, after the fresh one's own site-packages
        (site / "running_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        _run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
             str(self.wheel))
        out = _run(str(python), "-c", "import transformers_async_stop as tas; print(tas.__file__); "
                   "print(tas.__version__, tas.is_patched(), tas.last_path())", cwd=str(self.tmp))
        path, summary = out.strip().splitlines()[-2:]
        self.assertTrue(Path(path).is_relative_to(site), f"imported from {path}, not the fresh environment")
        self.assertEqual(summary, f"{self._version()} True None")

    def test_metadata_names_licence_author_urls_and_python(self):
        meta = self.metadata
        self.assertEqual(meta["Version"], self._version())
        self.assertEqual(meta["License"] or meta["License-Expression"], "Apache-2.0")
        self.assertEqual(meta["Author"], "transformers_async_stop contributors")
        self.assertEqual(meta["Requires-Python"], ">=3.10")
        self.assertTrue(meta.get_all("Project-URL"))
        self.assertTrue(any(n.endswith("LICENSE") for n in self.names), self.names)

    def test_requirements_are_what_the_package_imports_and_extras_hold_the_rest(self):
        required = [r for r in self.metadata.get_all("Requires-Dist") if "extra ==" not in r]
        self.assertEqual(sorted(re.split(r"[<>=;\s]", r)[0] for r in required), ["numpy", "torch", "transformers"])
        extras = {r.split(";")[0].strip(): r.split("extra ==")[1].strip(' "\'')
                  for r in self.metadata.get_all("Requires-Dist") if "extra ==" in r}
        self.assertEqual(extras, {"pytest": "test", "pytest-xdist": "test", "parameterized": "test",
                                  "accelerate": "test", "peft": "test", "matplotlib": "bench"})

    def test_the_index_page_has_no_repository_relative_link(self):
        description = self.metadata.get_payload()
        self.assertIn("async_stopping_criteria", description)
        relative = re.findall(r"\]\((?![a-z]+:|#)([^)]+)\)", description)
        self.assertEqual(relative, [])

    def test_only_the_package_is_shipped(self):
        top = {n.split("/")[0] for n in self.names}
        self.assertEqual({t for t in top if not t.endswith(".dist-info")}, {"transformers_async_stop"})

    @staticmethod
    def _version() -> str:
        text = (ROOT / "transformers_async_stop" / "__init__.py").read_text(encoding="utf-8")
        return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


if __name__ == "__main__":
    unittest.main()
