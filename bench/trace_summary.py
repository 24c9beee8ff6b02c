"""The top kernels and the GPU's idle time of one profiled step, from a torch.profiler Chrome trace, as markdown.

    python bench/trace_summary.py NAME=TRACE.json[.gz] [NAME=TRACE ...] [--top 10]

For each trace: the step's span (its ProfilerStep#N event, else first kernel start to last kernel end), the time the
GPU ran kernels (the union of their intervals), the time it sat idle between them (the host gaps: the host had not
launched the next kernel yet, or waited on a sync), the ten longest gaps, and the kernels with the most device time,
named as the trace names them. Traces side by side make a table per question, one column per loop.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summary(events: list[dict], top: int) -> dict:
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not kernels:
        return {"error": "no kernel events (a CPU trace?)"}
    start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    host_span = (max(s["ts"] + s["dur"] for s in steps) - min(s["ts"] for s in steps)) if steps else None
    busy, gaps, reach = 0.0, [], start
    for k in kernels:  # the union of kernel intervals (streams overlap), and the holes in it
        k_end = k["ts"] + k["dur"]
        if k["ts"] > reach:
            gaps.append(k["ts"] - reach)
        busy += max(0.0, k_end - max(k["ts"], reach))
        reach = max(reach, k_end)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for k in kernels:
        by_name[k["name"]][0] += k["dur"]
        by_name[k["name"]][1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": (end - start) / 1e3, "host_span_ms": host_span / 1e3 if host_span else None,
            "busy_ms": busy / 1e3, "idle_ms": sum(gaps) / 1e3, "gaps": len(gaps), "kernels": len(kernels),
            "longest_gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:top]],
            "top": [(name, t / 1e3, n) for name, (t, n) in ranked]}


def markdown(results: dict[str, dict], top: int) -> str:
    lines = ["| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for label, key in (("GPU span of the step (ms)", "span_ms"), ("host span, ProfilerStep (ms)", "host_span_ms"),
                       ("kernels running (ms)", "busy_ms"), ("GPU idle between kernels (ms)", "idle_ms"),
                       ("kernel launches", "kernels"), ("gaps", "gaps")):
        cells = [r.get(key) for r in results.values()]
        lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:,.1f}" if isinstance(c, float)
                                                   else f"{c:,}" for c in cells) + " |")
    lines.append("| longest gaps (ms) | " + " | ".join(", ".join(f"{g:.2f}" for g in r.get("longest_gaps_ms", [])[:5])
                                                      for r in results.values()) + " |")
    out = ["\n".join(lines), ""]
    for name, r in results.items():
        if "error" in r:
            out.append(f"{name}: {r['error']}\n")
            continue
        out += [f"**{name}: top {top} kernels by device time**", "", "| kernel | ms | calls | share of busy |",
                "|---|---|---|---|"]
        out += [f"| `{k[:90]}` | {t:.2f} | {n} | {100 * t / r['busy_ms']:.0f}% |" for k, t, n in r["top"]]
        out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="NAME=PATH: a Chrome trace (.json or .json.gz) of one step")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()
    results = {}
    for spec in args.traces:
        name, _, path = spec.partition("=")
        try:
            results[name] = summary(load(Path(path)), args.top)
        except (OSError, ValueError, KeyError) as exc:
            results[name] = {"error": f"{path}: {exc!r}"}
    print(markdown(results, args.top))


if __name__ == "__main__":
    main()
