"""The built-in cases: the plain ones (cases.py) and assisted decoding's (assisted.py), which build on them."""

from __future__ import annotations

from .assisted import assisted_cases
from .cases import Case, plain_cases


def builtin_cases() -> dict[str, Case]:
    return {**plain_cases(), **assisted_cases()}
