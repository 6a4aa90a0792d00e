"""The sources behind the replay's additive attention masks (`graphs/piecewise/additive_mask.py`): transformers' SDPA
attention and the helpers it calls, read for what they do with a mask's dtype."""

from __future__ import annotations

from .shortcuts import Shortcut

# transformers' SDPA attention, read for what it does with a mask's dtype (`graphs/piecewise/additive_mask.py`): on
# every release below the mask is read for `is None` and its shape only, but under a `position_bias` and on an NPU
_SDPA = "transformers.integrations.sdpa_attention"
_SDPA_ADDITIVE = Shortcut(
    "sdpa additive mask",
    (f"{_SDPA}:sdpa_attention_forward", f"{_SDPA}:use_gqa_in_sdpa", f"{_SDPA}:repeat_kv",
     f"{_SDPA}:create_position_bias_mask"),
    {f"{_SDPA}:sdpa_attention_forward": {"2519bd4da7bc": "5.16.1-5.18.0", "6a965ca3df2d": "5.19.0-5.20.2",
                                         "b3604d235f01": "5.21.1-5.22.2", "e3d016070b6a": "5.23.0",
                                         "9be3d6b1f79a": "5.24.0"},
     f"{_SDPA}:use_gqa_in_sdpa": {"f066a12b1b63": "5.16.1-5.17.0", "f516785dc450": "5.18.0-5.22.2",
                                  "25bcff32ef32": "5.23.0-5.24.0"},
     f"{_SDPA}:repeat_kv": {"e9b1ad4a8df3": "5.16.1-5.24.0"},
     f"{_SDPA}:create_position_bias_mask": {"8f3c1a2fb4df": "5.16.1-5.19.0", "c19168e7f2eb": "5.20.2-5.24.0"}},
    # 5.16.1's sources are 5.17.0's, so the digests hold there too (the loop that takes it starts at 5.17)
    "graphs.piecewise.additive_mask", present="5.16+",
    why="torch converts a bool attention mask to its additive form inside every SDPA call (14 host ops a layer on "
        "CUDA): a replay converts each mask once per step and hands every layer the result",
)
# the one-token query's reshape 5.23 added to the same path (`pack_gqa`): read where the module has it (a source that
# does not resolve on a release would leave the shortcut without its identity links there)
_SDPA_ADDITIVE_PACK = Shortcut(
    "sdpa additive mask (pack_gqa)", (f"{_SDPA}:pack_gqa",), {f"{_SDPA}:pack_gqa": {"95273b46b163": "5.23.0-5.24.0"}},
    "graphs.piecewise.additive_mask", present="5.23+",
    why="the reshape of a one-token query that 5.23's SDPA attention makes before the call; the mask is returned as "
        "it is",
)

ATTENTION_SHORTCUTS = (_SDPA_ADDITIVE, _SDPA_ADDITIVE_PACK)
