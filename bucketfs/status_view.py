"""`bucketfs status MOUNT [--json]`: ask the mount's daemon for its status report
(bucketfs/status.py builds it) and show it, as compact aligned text for a person or as
the report itself, JSON, for a script. Standard library only: this runs in the user's
shell, not in the daemon.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from typing import Any

from bucketfs.hints.client import DEFAULT_TIMEOUT, HintError
from bucketfs.hints.control import status, target_of

PROG = "bucketfs status"
_LABEL = 10  # width of the left column


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mount", metavar="MOUNT", help="the bucketfs mount (or a path in it)")
    parser.add_argument("--json", action="store_true",
                        help="print the daemon's report as JSON (keys: docs/HINTS.md)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds to wait for the daemon (default {DEFAULT_TIMEOUT:g})")


def run(args: argparse.Namespace) -> int:
    try:
        report = status(target_of(args.mount), args.timeout)
    except HintError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(render(report))
    return 0


# --- the text view ---------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """The report as a few aligned lines per section."""
    sections = [("mount", _mount(report["mount"])), ("load", _load(report.get("load"))),
                ("cache", _cache(report["cache"])),
                ("reads", _reads(report.get("reads"))),
                ("prefetch", _prefetch(report["prefetch"])),
                ("shared", _shared(report.get("shared"))),
                ("origin", _origin(report["origin"])), ("errors", _errors(report["errors"]))]
    if report.get("warm"):
        sections.append(("warm", (_warm(job) for job in report["warm"])))
    lines = []
    for label, body in sections:
        for number, line in enumerate(body):
            lines.append(f"{label if number == 0 else '':<{_LABEL}}{line}".rstrip())
    return "\n".join(lines)


def _mount(mount: dict[str, Any]) -> Iterator[str]:
    yield f"{mount['url']} on {mount['mountpoint']}"
    where = f"endpoint {mount['endpoint']} · " if mount.get("endpoint") else ""
    yield (f"{where}pid {mount['pid']} · bucketfs {mount['version']} · "
           f"up {duration(mount['uptime_s'])}")
    extras = [f"hints {'on' if mount['hints'] else 'off'}",
              f"block {size(mount['block_size'])}",
              f"opens by the {'kernel' if mount.get('kernel_opens') else 'daemon'}"]
    if mount.get("data_processes"):
        restarts = mount.get("data_process_restarts", 0)
        extras.append(f"{mount['data_processes']} data processes"
                      + (f" ({restarts} restarted)" if restarts else ""))
    if mount.get("metrics"):
        extras.append(f"metrics http://{mount['metrics']}/metrics")
    yield " · ".join(extras)


def _cache(cache: dict[str, Any]) -> Iterator[str]:
    rows = [("tier", "used", "budget", "full", "evictions", "hits", "served")]
    for tier in cache["tiers"]:
        full = f"{tier['used'] / tier['capacity']:.0%}" if tier["capacity"] else "-"
        rows.append((tier["name"], size(tier["used"]), size(tier["capacity"]), full,
                     count(tier["evictions"]), count(tier["hits"]), size(tier["served_bytes"])))
    right = {3, 4, 5}  # numbers line up on the right
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    notes = [""] + [_tier_note(tier) for tier in cache["tiers"]]
    for row, note in zip(rows, notes, strict=True):
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        yield "  ".join(cells) + (f"  {note}" if note else "")
    ratio, lookups = cache["hit_ratio"], cache["lookups"]
    if not lookups:
        yield "no lookups yet"
        return
    parts = [f"ram {percent(ratio['ram'])}"]
    if ratio.get("ssd") is not None:
        parts.append(f"ssd {percent(ratio['ssd'])}")
    if ratio.get("shared") is not None:
        parts.append(f"shared {percent(ratio['shared'])}")
    yield (f"hit ratio {percent(ratio['total'])} of {count(lookups)} lookups "
           f"({', '.join(parts)}; {count(cache['misses'])} from the bucket)")


def _tier_note(tier: dict[str, Any]) -> str:
    if "writable" not in tier:
        return ""
    note = "writable" if tier["writable"] else "NOT WRITABLE (stepped aside)"
    if tier.get("chunks"):
        note += f", {count(tier['chunks'])} chunks ({size(tier['packed_bytes'])} packed)"
    if tier.get("write_queue_bytes"):
        note += f", {size(tier['write_queue_bytes'])} queued"
    return note


def _prefetch(prefetch: dict[str, Any]) -> Iterator[str]:
    if prefetch["enabled"]:
        yield (f"window {size(prefetch['window_bytes'])} of "
               f"{size(prefetch['window_limit'])} · in flight "
               f"{count(prefetch['in_flight'])} files ({size(prefetch['inflight_bytes'])}) "
               f"on {prefetch['connections']} of {prefetch['max_connections']} "
               f"connections · held {size(prefetch['held_bytes'])}")
        yield (f"orders {count(prefetch['orders'])} · files ahead "
               f"{count(prefetch['hinted_files'])} · started {count(prefetch['started'])} "
               f"· hits {count(prefetch['hits'])} · late {count(prefetch['late'])} · "
               f"wasted {count(prefetch['wasted'])} · failed {count(prefetch['failed'])}")
    else:
        yield "hints off (prefetch_window 0): read-ahead only"
    ahead = prefetch["readahead"]
    yield (f"read-ahead {count(ahead['prefetches'])} blocks · "
           f"{size(ahead['inflight_bytes'])} in flight of {size(ahead['budget_bytes'])}")


def _reads(reads: dict[str, Any] | None) -> Iterator[str]:
    if reads is None:  # a daemon from before this section
        return
    yield (f"{count(reads['opens'])} opens · {count(reads['requests'])} read requests · "
           f"{size(reads['bytes'])} served (page cache hits not seen)")


def _shared(shared: dict[str, Any] | None) -> Iterator[str]:
    if shared is None:  # no shared tier (or a daemon from before it)
        return
    state = "up" if shared["up"] else "RESTING after a failure (the origin serves)"
    yield (f"{shared['url']} via {shared['endpoint']} · {state} · objects up to "
           f"{size(shared['max_object'])}")
    yield (f"lookups {count(shared['lookups'])} · hits {count(shared['hits'])} "
           f"({size(shared['bytes_read'])}) · misses {count(shared['misses'])} · invalid "
           f"{count(shared['invalid'])} · errors {count(shared['errors'])} · skipped "
           f"{count(shared['skipped'])}")
    queued = f" · {size(shared['write_queue_bytes'])} queued" \
        if shared["write_queue_bytes"] else ""
    requests = shared["requests"]
    yield (f"written {count(shared['writes'])} blocks ({size(shared['bytes_written'])})"
           f" · dropped {count(shared['dropped'])}{queued} · requests GET "
           f"{count(requests['get'])}, PUT {count(requests['put'])}")


def _load(load: dict[str, Any] | None) -> Iterator[str]:
    if load is None:  # a daemon from before this key
        return
    busy = load["serving_thread_busy"]
    per_file = ""
    if load.get("serving_ms_per_file") is not None:
        per_file = (f" · {load['serving_ms_per_file']:.2f} ms per file: at most "
                    f"~{load['files_per_s_ceiling']:,} files/s")
    note = " · at its ceiling: more readers will not read faster" if busy >= 0.9 else ""
    yield (f"serving thread {busy:.0%} busy{per_file} · daemon {load['daemon_cores']:.2f} "
           f"cores (last {load['interval_s']:g} s){note}")


def _origin(origin: dict[str, Any]) -> Iterator[str]:
    requests = origin["requests"]
    yield (f"GET {count(requests['get'])} · HEAD {count(requests['head'])} · "
           f"LIST {count(requests['list'])} · {size(origin['bytes'])} fetched")
    rate = origin["throughput"]
    yield (f"now {size(rate['bytes_per_s'])}/s, {rate['requests_per_s']:g} requests/s "
           f"(last {rate['interval_s']:g} s)")
    cost = origin.get("cost")
    if cost is None:
        yield "cost: none (a local directory)"
    else:
        prices = ", ".join(f"{kind.upper()} {usd(price)}"
                           for kind, price in cost["usd_per_1000"].items())
        yield (f"cost ~{usd(cost['usd']['total'])} estimated, requests only "
               f"({prices} per 1,000: {cost['prices']})")


def _errors(errors: dict[str, Any]) -> Iterator[str]:
    yield (f"retries {count(errors['retries'])} · failed orders "
           f"{count(errors['failed_orders'])} · failed prefetches "
           f"{count(errors['failed_prefetches'])} · warm errors "
           f"{count(errors['warm_errors'])} · background failures "
           f"{count(errors['background_failures'])} · failed requests "
           f"{count(errors.get('failed_requests', 0))}")


def _warm(job: dict[str, Any]) -> str:
    text = (f"#{job['id']} {job['state']}: {count(job['files_done'])} of "
            f"{count(job['files_total'])} files, {size(job['bytes_done'])} of "
            f"{size(job['bytes_total'])} in {duration(job['elapsed_s'])}")
    if job["files_cached"]:
        text += f" ({count(job['files_cached'])} cached already)"
    if job["errors"]:
        text += f" · {count(job['errors'])} errors"
    if job["skipped_files"]:
        text += f" · {count(job['skipped_files'])} over the budget"
    if job["reason"]:
        text += f" · {job['reason']}"
    return text


# --- units -------------------------------------------------------------------------------


def size(value: float) -> str:
    """Bytes in IEC units, as the options are given (4MiB, 16GiB)."""
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(amount) < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def count(value: int) -> str:
    return f"{value:,}"


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


def usd(value: float) -> str:
    """Dollars to three significant digits below $1 (request prices are fractions of a
    cent), to the cent above."""
    if value == 0:
        return "$0"
    if value >= 1:
        return f"${value:,.2f}"
    decimals = min(6, max(2, 2 - math.floor(math.log10(value))))
    text = f"{value:.{decimals}f}".rstrip("0").rstrip(".")
    return f"${text}" if text != "0" else "<$0.000001"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"
