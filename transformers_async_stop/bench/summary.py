"""Two closing tables of the report:

- the summary, one row per run (two per workload run: its cold and its warm pass): stock's, upstream's and the
  flag's ms/token side by side, the flag's speed-up, its wall over the floor, the cold share, exactness. This is the
  shape of docs/benchmarks.md's tables;
- the timed calls of the per-step runs, where they say something: timed calls that took different paths (each path
  with its count; the main table shows the most frequent), a timed call that made or dropped a recording of the
  graphed forward, and the back-to-back figure (`--back-to-back`) beside the rotated one.
"""

from __future__ import annotations

from .tables import _aligned, _fmt, _md_table

TITLES = ("run", "stock ms/tok", "upstream ms/tok", "flag ms/tok", "flag vs stock", "flag vs upstream", "floor ms/tok",
          "flag/floor", "cold share stock", "cold share flag", "exact")
LEGEND = ("summary: ms/tok per step (per-step runs) or per generated position of a whole pass (workloads: the cold "
          "pass, met for the first time in its thread, and the warm pass); cold share: (cold - warm) / cold of a "
          "workload's passes")
GPU_LEGEND = ("; flag vs stock / upstream: their ms over the flag's, paired by rep; flag/floor: the flag's ms/tok over "
              "the GPU kernel time per token")
CHECK_TITLES = ("run", "variant", "ms/tok (rotated)", "ms/tok (back to back)", "timed calls that recorded",
                "timed calls' paths, where they differ")


def _ms(m, key="ms_per_token"):
    return _fmt(m.get(key) if m else None, ".3f")


def _ratio(value):
    return _fmt(value, ".2f", "x")


def _share(m):
    return _fmt(m["cold_share"] * 100 if m and m.get("cold_share") is not None else None, ".0f", "%")


def rows(result: dict) -> list[tuple[str, ...]]:
    out = []
    for r in result["runs"]:
        if r.get("error"):
            continue
        v = r["variants"]
        stock, upstream, flag = v.get("stock"), v.get("upstream"), v.get("async")
        floor = r["floor_ms_per_token"]
        exact = "" if r["exact"] is None else ("yes" if r["exact"] else ("NO" if r.get("stock_repeatable") else "NO*"))
        if not r.get("workload"):
            out.append((r["label"], _ms(stock), _ms(upstream), _ms(flag), _ratio(flag and flag.get("speedup")),
                        _ratio(flag and flag.get("vs_upstream")), _fmt(floor, ".3f"),
                        _ratio(flag["ms_per_token"] / floor if flag and floor else None), "-", "-", exact))
            continue
        warm_ratios = (r["workload"].get("warm_ratios") or {}).get("async_vs_upstream") or {}
        for key, label, speed, vs_upstream in (
                ("ms_per_token", "cold pass", "speedup", flag and flag.get("vs_upstream")),
                ("warm_ms_per_token", "warm pass", "warm_speedup", warm_ratios.get("value"))):
            out.append((f"{r['label']} ({label})", _ms(stock, key), _ms(upstream, key), _ms(flag, key),
                        _ratio(flag and flag.get(speed)), _ratio(vs_upstream), _fmt(floor, ".3f"),
                        _ratio(flag[key] / floor if flag and floor else None),
                        _share(stock) if key == "ms_per_token" else "", _share(flag) if key == "ms_per_token" else "",
                        exact))
    return out


def check_rows(result: dict) -> list[tuple[str, ...]]:
    out = []
    for r in result["runs"]:
        if r.get("error") or r.get("workload"):
            continue
        for v, m in r["variants"].items():
            if m.get("ms_per_token_b2b") is None and not m.get("timed_paths") and not m.get("timed_recordings"):
                continue
            timed = m.get("timed_paths") or {}
            out.append((r["label"], v, _ms(m), _ms(m, "ms_per_token_b2b"), str(m.get("timed_recordings", "")),
                        " | ".join(f"{count}x {path}" for path, count in timed.items()) or "-"))
    return out


CHECK_LEGEND = ("timed calls: where a per-step run's timed N-token calls did not all take one path or made or dropped "
                "a recording, or its back-to-back figure was asked for (--back-to-back)")


# the columns a CPU run leaves out: no ratio and no floor is measured there
_GPU_ONLY = ("flag vs stock", "flag vs upstream", "floor ms/tok", "flag/floor")


def _table(result: dict) -> tuple[str, tuple[str, ...], list[tuple[str, ...]]]:
    """The legend, titles and rows for this run's device."""
    found = rows(result)
    if result["header"]["gpu_figures"] or not found:
        return LEGEND + GPU_LEGEND, TITLES, found
    keep = [i for i, title in enumerate(TITLES) if title not in _GPU_ONLY]
    return LEGEND, tuple(TITLES[i] for i in keep), [tuple(row[i] for i in keep) for row in found]


def text_report(result: dict) -> str:
    lines = []
    found = check_rows(result)
    if found:
        lines += ["", "", CHECK_LEGEND, _aligned([CHECK_TITLES] + found)]
    legend, titles, found = _table(result)
    if found:
        lines += ["", "", legend, _aligned([titles] + found)]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    lines = []
    found = check_rows(result)
    if found:
        lines += ["", CHECK_LEGEND + ".", "", _md_table(CHECK_TITLES, found)]
    legend, titles, found = _table(result)
    if found:
        lines += ["", legend + ".", "", _md_table(titles, found), ""]
    return "\n".join(lines)
