"""The workload runs' own table: each variant's cold and warm pass, the cold share, the wall / floor of each pass."""

from __future__ import annotations

from ..tables import _aligned, _fmt, _md_table

TITLES = ("run", "variant", "cold ms/tok", "warm ms/tok", "cold share", "first meetings ms", "cold/floor",
          "warm/floor", "exact", "paths")
LEGEND = ("workloads (whole passes, each variant in a fresh thread: bench/workloads/passes.py): cold = the pass in a "
          "thread that had met none of its KV lengths, warm = the same pass again there; ms/tok = the pass's wall "
          "time over its generated positions (prefill included; a step of a batch counts once); cold share = (cold - "
          "warm) / cold; first meetings = cold - warm, in ms per pass; x/floor = that pass's ms/tok over the floor "
          "(GPU kernel time of a flag pass, CUDA); paths = the distinct paths its calls took")


def rows(result: dict) -> list[tuple[str, ...]]:
    out = []
    for r in result["runs"]:
        if r.get("error") or not r.get("workload"):
            continue
        floor = r["floor_ms_per_token"]
        for v, m in r["variants"].items():
            out.append((r["label"], v, _fmt(m["ms_per_token"], ".3f"), _fmt(m["warm_ms_per_token"], ".3f"),
                        _fmt(m["cold_share"] * 100 if m["cold_share"] is not None else None, ".0f", "%"),
                        _fmt(m["first_meeting_ms"], ".1f"),
                        _fmt(m["ms_per_token"] / floor if floor else None, ".2f", "x"),
                        _fmt(m["warm_ms_per_token"] / floor if floor else None, ".2f", "x"),
                        "" if m["exact"] is None else ("yes" if m["exact"] else "NO"),
                        str(len(m["paths"]))))
    return out


def about(result: dict) -> list[str]:
    """One line per workload run: what it played."""
    return [f"{r['label']}: {r['workload']['about']}, KV lengths {r['workload']['kv_lengths'][0]}-"
            f"{r['workload']['kv_lengths'][1]}" for r in result["runs"] if r.get("workload") and not r.get("error")]


def paths(result: dict) -> list[str]:
    """The flag's distinct paths over a workload's calls, where there is more than one (a batch size recorded, a
    padded step eager...)."""
    out = []
    for r in result["runs"]:
        m = (r.get("variants") or {}).get("async")
        if r.get("workload") and m and len(m["paths"]) > 1:
            out.append(f"{r['label']} async paths: " + " | ".join(m["paths"]))
    return out


def text_report(result: dict) -> str:
    found = rows(result)
    if not found:
        return ""
    return "\n".join(["", "", LEGEND, *about(result), _aligned([TITLES] + found), *paths(result)])


def markdown(result: dict) -> str:
    found = rows(result)
    if not found:
        return ""
    return "\n".join(["", LEGEND + ".", "", *[f"- {line}" for line in about(result)], "", _md_table(TITLES, found),
                      "", *[f"- {line}" for line in paths(result)], ""])
