import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# The one place that names the project's home: the package index page's links and the project URLs derive from it.
REPOSITORY = "https://github.com/transformers-async-stop/transformers_async_stop"


def version() -> str:
    """`__version__` of the package, read without importing it (importing patches transformers)."""
    text = (ROOT / "transformers_async_stop" / "__init__.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def long_description(tag: str) -> str:
    """README.md with its repository-relative links made absolute: a package index page has no `docs/` folder."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")

    def absolute(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:|^#", target):
            return match.group(0)
        kind = "tree" if target.endswith("/") else "blob"
        return f"{match.group(1)}({REPOSITORY}/{kind}/{tag}/{target})"

    return re.sub(r"(\[[^\]]*\])\(([^)\s]+)\)", absolute, text)


VERSION = version()
TAG = f"v{VERSION}"

setup(
    name="transformers_async_stop",
    version=VERSION,
    description="Sync-free stopping criteria for HuggingFace generate(): the host reads the stop flag one step late, "
                "with output identical to the flag-off run.",
    long_description=long_description(TAG),
    long_description_content_type="text/markdown",
    author="transformers_async_stop contributors",
    license="Apache-2.0",
    license_files=["LICENSE"],
    url=REPOSITORY,
    project_urls={
        "Documentation": f"{REPOSITORY}/blob/{TAG}/README.md",
        "How it works": f"{REPOSITORY}/blob/{TAG}/docs/how-it-works.md",
        "Paths": f"{REPOSITORY}/blob/{TAG}/docs/paths.md",
        "Benchmarks": f"{REPOSITORY}/blob/{TAG}/docs/benchmarks.md",
        "Changelog": f"{REPOSITORY}/blob/{TAG}/CHANGELOG.md",
        "Source": REPOSITORY,
    },
    keywords=["transformers", "generate", "stopping criteria", "cuda", "inference", "llm"],
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["transformers_async_stop", "transformers_async_stop.*"]),
    python_requires=">=3.10",
    # The floors are what CI tests (`nox -s floor`, noxfile.py); the package imports nothing else (`packaging` comes
    # with transformers). No upper bound within 5.x: a release newer than the ones checked (5.24.0) is not blocked,
    # it is warned about once per process, outputs exact (`release_notice.py`, `nox -s newest`).
    install_requires=["torch>=2.6", "transformers>=4.57.6,<6", "numpy"],
    extras_require={
        # peft: tests/test_peft.py runs real LoRA models (tested with peft 0.21.2 on transformers 4.57.6 to 5.24.0)
        "test": ["pytest", "pytest-xdist", "parameterized", "accelerate", "peft"],
        "bench": ["matplotlib"],
    },
)
