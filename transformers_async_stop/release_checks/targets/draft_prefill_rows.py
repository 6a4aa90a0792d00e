"""The sources behind the draft's prefill port (`loops/dynamic_loop/prefill.py`), one row per form of `_prefill`.

`GenerationMixin._prefill`'s unchunked branch has three forms over 5.17.0-5.24.0 (the port has one per row, picked
by the row whose digest the installed source has):
- 5.17: the cache is `past_key_values`; the ids are sliced to the new tokens where a mask as long as them is passed;
- 5.18-5.23: also where no mask is passed and the generation config's `_mask_length` is the ids' length (5.19 and 5.21
  change only the chunked branch, 5.23 writes the walrus as an assignment);
- 5.24: the cache is `cache`, and a cache of linear layers only is not sliced.
Read in 5.17.0, 5.23.0 and 5.24.0, and in the CI's release installs of 5.18.0, 5.19.0, 5.20.2, 5.21.1 and 5.22.2
(noxfile.py `releases`); digested there and in every other minor's newest patch from 5.0 to 5.16 (5.9.0-5.16.1 have
5.17.0's source, 5.0-5.8 others).
"""

from .shortcuts import Shortcut

_PREFILL = "transformers.generation.utils:GenerationMixin._prefill"

_ROWS = (
    # the source is 5.9.0's (the dynamic loop that takes the port runs from 5.17)
    ("5.17", {"40156750619a": "5.9.0-5.17.0"}, "5.9-5.17"),
    ("5.18-5.23", {"9ca8f10a2bae": "5.18.0", "35aa5caf5aa5": "5.19.0-5.20.2", "5dcab3c01863": "5.21.1-5.22.2",
                   "a81b872bfc72": "5.23.0"}, "5.18-5.23"),
    ("5.24", {"9d1f55808811": "5.24.0"}, "5.24+"),
)

DRAFT_PREFILL_SHORTCUTS = tuple(
    Shortcut(
        f"dynamic loop draft prefill ({name})", (_PREFILL,), {_PREFILL: digests},
        "dynamic_loop.prefill.run", present=present,
        why="an assistant's two-token prefill of each assisted round after the first goes through the forward its "
            "decode steps take (replayed from CUDA graphs where `piecewise` proves it exact), not the eager one",
    )
    for name, digests, present in _ROWS
)
