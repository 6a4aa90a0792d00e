"""The decode benchmark, `python -m transformers_async_stop.bench`: see cli.py's docstring (the --help text),
which is this package's docstring too."""

from .cli import __doc__, main  # noqa: F401  (the package's docstring is the --help text)
from .variants import upstream_available, variant  # scripts/repeatability.py uses these

__all__ = ["main", "upstream_available", "variant"]
