"""Where a mount's runtime files live, and what /proc says is mounted.

Each mount has a state directory under `$XDG_RUNTIME_DIR/bucketfs` (or
`/tmp/bucketfs-UID`) named after its mountpoint; the daemon writes its pid there, so
`bucketfs umount` can wait for it to finish, and listens for hints on `hints.sock`
there (docs/HINTS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# The names are defined once, with the hints client (standard library only), so the
# daemon and a training process running as another user agree on them.
from bucketfs.hints.location import FSTYPE, read_mounts, runtime_root, state_dir

__all__ = ["FSTYPE", "MountEntry", "default_log_file", "mounted", "runtime_root",
           "state_dir"]


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


def mounted(mountpoint: str) -> MountEntry | None:
    """The mount at exactly `mountpoint`, if any (the last one stacked there)."""
    found = None
    for mount in read_mounts():
        if mount.mountpoint == mountpoint:
            found = MountEntry(mount.mountpoint, mount.fstype, mount.source, mount.device)
    return found
