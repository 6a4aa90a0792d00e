"""The one place that knows which transformers releases have which patch targets and which shortcut sources.

Every object this package replaces is listed here, with the releases it was seen in and the parameters its
replacement relies on. At runtime targets are found by feature detection (`hasattr`), never by version string;
the release ranges are documentation, and the drift test (`tests/test_patching.py`) checks them against the
installed transformers so that a renamed or re-signed target fails loudly in CI instead of silently unpatching.

Releases read for this table: 4.57.6 and the newest patch of every 5.x minor from 5.0 to 5.24 (presence and
parameters of every target, and the source digests of every shortcut, were recorded for each of them; CI runs the
drift test on all of them, see noxfile.py).

Two tables: `patches.TARGETS` (what `apply()` replaces) and `shortcuts.SHORTCUTS` (stock code a flag-on call
computes itself, taken only where the installed source has a digest listed there, `verified.py`).
"""

from .attention_rows import ATTENTION_SHORTCUTS
from .draft_prefill_rows import DRAFT_PREFILL_SHORTCUTS
from .encoder_decoder_rows import ENCODER_DECODER_SHORTCUTS
from .patches import TARGETS, Target, present_in
from .piecewise_rows import PIECEWISE_SHORTCUTS
from .shortcuts import SHORTCUTS as _SHORTCUTS
from .shortcuts import Shortcut

# the piecewise forward's rows, the additive masks', the draft prefill port's, and the encoder-decoder families' of
# the dynamic-cache loop, live in their own files
SHORTCUTS = (_SHORTCUTS + PIECEWISE_SHORTCUTS + ATTENTION_SHORTCUTS + DRAFT_PREFILL_SHORTCUTS
             + ENCODER_DECODER_SHORTCUTS)

__all__ = ["SHORTCUTS", "TARGETS", "Shortcut", "Target", "present_in"]
