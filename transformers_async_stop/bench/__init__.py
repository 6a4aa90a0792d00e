"""Side-by-side decode benchmark: transformers as shipped vs this package, flag off and on, vs upstream's
DeferredStopCheck, vs the GPU floor.

    python -m transformers_async_stop.bench                       # every case that fits the device
    python -m transformers_async_stop.bench --quick               # tiny cases only (CPU CI)
    python -m transformers_async_stop.bench --cases llama-1b --modes static --json out.json --markdown out.md

Every case builds one model (random weights from a config, no hub download) and runs every variant on it, in one
process:

- stock:    transformers as shipped: the package unpatched (re-applied afterwards), no flag keyword;
- imported: the package applied, async_stopping_criteria=False;
- async:    the package applied, async_stopping_criteria=True;
- upstream: the package unpatched, transformers' own DeferredStopCheck (5.17+) forced on for CUDA;
- floor:    GPU kernel time per decode step of the async run (torch.profiler), CUDA only.

ms/token: per rep, (t_N - t_1) / (N - 1) from an N-token and a 1-token call made back to back; the median over reps,
with the interquartile range as the spread. The variants run interleaved rep by rep, the order rotated each rep.
Every call generates exactly its budget (min_new_tokens == max_new_tokens), so the variants do the same work.
Speedups are against stock; async is also compared with upstream, and imported with stock (must stay within 2%).
On CPU no ratio is printed: nothing about GPU idle time is measured there.

Modules: cases (what runs), variants (how transformers is set up for each), measure (timing, exactness, ratios),
gpu (syncs, floor, traces), report (table, Markdown, JSON, PNG), cli (options and main).
"""

from .cli import main
from .variants import upstream_available, variant  # scripts/repeatability.py uses these

__all__ = ["main", "upstream_available", "variant"]
