"""What the demo says about each of its phases, from the daemon's own counters: the
status report `bucketfs status --json` shows (bucketfs/status.py), read between phases.

The demo's bucket is a local directory (file://), which no request counter sees; the
daemon counts each request it makes to its origin all the same, so the counts are what
an S3 or GCS bucket would have been asked. Standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bucketfs.hints.client import HintError
from bucketfs.hints.control import status, target_of
from bucketfs.status_view import count

KINDS = ("get", "head", "list")
#: The demo's lines start with a label this wide.
LABEL = 24

EXPLAIN = ("requests: counted by the daemon itself (`bucketfs status --json`, "
           "origin.requests) between phases; file:// reads a local directory, so these are "
           "the requests an S3 or GCS bucket would have been sent (the mount-time access "
           "check aside)")
POINTER = ("see it live: while a mount is up, `bucketfs status MOUNT` shows its cache tiers, "
           "hit ratios, prefetch, requests and their cost; `bucketfs warm MOUNT` fills the "
           "cache before training")


class ReportError(Exception):
    """The daemon did not answer its status; the message is one line."""


def snapshot(mountpoint: Path) -> dict[str, Any]:
    try:
        return status(target_of(mountpoint))
    except HintError as exc:
        raise ReportError(f"cannot read the mount's status: {exc}") from None


def requests(after: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, int]:
    """Requests to the origin between two reports (since the mount without `before`)."""
    now = after["origin"]["requests"]
    then = before["origin"]["requests"] if before is not None else dict.fromkeys(KINDS, 0)
    return {kind: now[kind] - then[kind] for kind in KINDS}


def said(counts: dict[str, int]) -> str:
    asked = [f"{count(counts[kind])} {kind.upper()}" for kind in KINDS if counts[kind]]
    return ", ".join(asked) if asked else "no request"


def epoch_line(label: str, images: int, seconds: float, counts: dict[str, int] | None,
               note: str = "") -> str:
    rate = images / seconds if seconds > 0 else float("inf")
    text = f"{label + ':':<{LABEL}}{images} images in {seconds:5.2f} s, {rate:4.0f} images/s"
    if counts is not None:
        text += f" · bucket: {said(counts)}"
    return text + (f" ({note})" if note else "")


def tier(report: dict[str, Any], name: str) -> dict[str, Any]:
    found = [t for t in report["cache"]["tiers"] if t["name"] == name]
    return found[0] if found else {"hits": 0, "served_bytes": 0}


def ssd_note(report: dict[str, Any]) -> str:
    """Where a remounted epoch's data came from (its RAM tier started empty)."""
    ssd, misses = tier(report, "ssd"), report["cache"]["misses"]
    blocks = ssd["hits"] + ssd.get("read_ahead", 0)
    text = f"{count(blocks)} blocks from the SSD tier"
    if ssd.get("read_ahead"):
        text += (f" in {count(ssd['hits'])} reads: small files in chunks in the order "
                 "they were fetched, a read bringing the ones after it")
    return text + (f"; {count(misses)} from the bucket" if misses else "")


def hints_line(report: dict[str, Any], files: int) -> str:
    """What hinted prefetch did in an epoch (the report taken after it)."""
    prefetch = report["prefetch"]
    if not prefetch["enabled"]:
        return "hints: off on this mount"
    return (f"hints: HintSampler sent the epoch's order of {count(files)} files; the daemon "
            f"fetched {count(prefetch['started'])} of them ahead of the DataLoader, and "
            f"{count(prefetch['hits'])} opens found their file there already "
            f"({count(prefetch['late'])} found it on its way)")
