"""Medians and ranges over repeats (these machines are noisy: one figure is not a result)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str, str]  # contender, workload, item
DASH = "\u2013"  # an en dash, for ranges in the Markdown


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int


def summarize(values: list[float]) -> Summary | None:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not finite:
        return None
    return Summary(statistics.median(finite), min(finite), max(finite), len(finite))


def medians(rows: list[dict[str, float]], measures: Iterable[str],
            ) -> dict[str, dict[str, Any]]:
    """Each measure's median over rounds (one row each), with every round's figure:
    {measure: {"median": m, "rounds": [...]}}, as the one-command benchmarks save them."""
    return {measure: {"median": statistics.median(row[measure] for row in rows),
                      "rounds": [row[measure] for row in rows]}
            for measure in measures}


def aggregate(records: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Per (contender, workload, item): each numeric metric summarized over the repeats
    that succeeded, under "metrics"; and the statuses that were not "ok", under
    "problems" (an "n/a: ..." reason, or errors)."""
    grouped: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        grouped[(record["contender"], record["workload"], record.get("item", ""))].append(
            record)
    out: dict[Key, dict[str, Any]] = {}
    for key, group in grouped.items():
        ok = [r for r in group if r.get("status") == "ok"]
        names = {name for r in ok for name, value in r.items()
                 if isinstance(value, int | float) and not isinstance(value, bool)
                 and name != "repeat"}
        metrics = {}
        for name in sorted(names):
            summary = summarize([r[name] for r in ok if name in r])
            if summary is not None:
                metrics[name] = summary
        problems = sorted({r["status"] for r in group if r.get("status") != "ok"})
        out[key] = {"metrics": metrics, "problems": problems, "repeats": len(group),
                    "ok": len(ok)}
    return out


def format_summary(summary: Summary | None, digits: int = 1, scale: float = 1.0) -> str:
    """"12.3 (11.9-13.0)"; just the median when there was one repeat or no spread."""
    if summary is None:
        return "—"

    def one(value: float) -> str:
        return f"{value * scale:,.{digits}f}"

    if summary.n == 1 or one(summary.low) == one(summary.high):
        return one(summary.median)
    return f"{one(summary.median)} ({one(summary.low)}{DASH}{one(summary.high)})"
