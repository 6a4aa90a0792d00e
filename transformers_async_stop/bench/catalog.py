"""The built-in cases: the plain ones (cases.py), assisted decoding's (assisted.py), which build on them, one per
family group the graphed forward proves without a hand read (family_cases.py), an encoder-decoder's
(encoder_decoder_cases.py), and the workloads (workloads/)."""

from __future__ import annotations

from .assisted import assisted_cases
from .cases import Case, plain_cases
from .encoder_decoder_cases import encoder_decoder_cases
from .family_cases import family_cases
from .workloads import workload_cases


def builtin_cases() -> dict[str, Case]:
    return {**plain_cases(), **assisted_cases(), **family_cases(), **encoder_decoder_cases(), **workload_cases()}
