"""Where a mount's runtime files live, and what /proc says is mounted.

Each mount has a state directory under `$XDG_RUNTIME_DIR/bucketfs` (or
`/tmp/bucketfs-UID`) named after its mountpoint; the daemon writes its pid there, so
`bucketfs umount` can wait for it to finish.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.bucketfs"


def runtime_root() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        return Path(base) / "bucketfs"
    return Path(f"/tmp/bucketfs-{os.getuid()}")


def state_dir(mountpoint: str) -> Path:
    """The runtime directory of the mount at `mountpoint` (an absolute, real path)."""
    digest = hashlib.sha256(mountpoint.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return runtime_root() / digest


def default_log_file(mountpoint: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    name = mountpoint.strip("/").replace("/", "_") or "root"
    return os.path.join(base, "bucketfs", f"{name}.log")


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    #: "MAJOR:MINOR" of the mounted filesystem's st_dev (also its /sys/class/bdi name).
    device: str


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
    return (
        field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def mounted(mountpoint: str) -> MountEntry | None:
    """The mount at exactly `mountpoint`, if any (the last one stacked there)."""
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rest = right.split()
            if len(fields) >= 5 and len(rest) >= 2 and _unescape(fields[4]) == mountpoint:
                found = MountEntry(mountpoint, rest[0], _unescape(rest[1]), fields[2])
    return found
