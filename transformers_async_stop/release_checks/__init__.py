"""The release checks: which transformers code the package was read against, and what it does on any other.

- `targets/`: the patch targets and the per-call shortcuts, each with the releases and source digests it was read in;
- `verified.py`: whether the installed sources are ones a shortcut was checked against (else stock code runs);
- `release_notice.py`: the one warning on a release newer than, or differing from, the ones checked;
- `cache_kwarg.py`: the name the loop keeps its cache under (`past_key_values` up to 5.23, `cache` from 5.24);
- `input_drops.py`: models whose own input preparation drops the cache mid-call.
"""
