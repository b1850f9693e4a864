"""Where a mount's runtime files and hints socket live, and which mount a path is under.

The one definition of these names: the daemon (`bucketfs/runtime.py`) and the training
process (`bucketfs.hints.client`) both compute them here, so they cannot drift apart.
Standard library only.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.bucketfs"
SOCKET_NAME = "hints.sock"
#: Explicit socket path for every mount, for clients that cannot find it on their own.
SOCKET_ENV = "BUCKETFS_HINTS_SOCKET"
MOUNTINFO = "/proc/self/mountinfo"


def mount_digest(mountpoint: str) -> str:
    """The name of a mount's state directory: a digest of its absolute, real mountpoint."""
    return hashlib.sha256(mountpoint.encode("utf-8", "surrogateescape")).hexdigest()[:16]


#: Root's state directories, when it has no XDG_RUNTIME_DIR (a systemd service).
ROOT_RUNTIME = Path("/run/bucketfs")


def tmp_root(uid: int) -> Path:
    return Path(f"/tmp/bucketfs-{uid}")


def runtime_root() -> Path:
    """Where this process (the daemon) keeps the state directories of its mounts: the
    user's runtime directory, else /run/bucketfs for root, else a directory under /tmp
    that the daemon refuses to use unless it is its own (bucketfs/runtime.py)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        return Path(base) / "bucketfs"
    if os.geteuid() == 0:
        return ROOT_RUNTIME
    return tmp_root(os.geteuid())


def state_dir(mountpoint: str) -> Path:
    """The daemon's runtime directory for the mount at `mountpoint` (absolute, real)."""
    return runtime_root() / mount_digest(mountpoint)


def socket_path(mountpoint: str) -> Path:
    """Where the daemon of the mount at `mountpoint` listens for hints."""
    return state_dir(mountpoint) / SOCKET_NAME


def socket_candidates(mountpoint: str, owner_uid: int | None) -> list[Path]:
    """Where a client looks for that socket, in order. A client running as another user
    cannot know the daemon's XDG_RUNTIME_DIR, so it tries the usual places for the
    mount owner's uid (from mountinfo) before its own."""
    override = os.environ.get(SOCKET_ENV)
    if override:
        return [Path(override)]
    digest = mount_digest(mountpoint)
    roots = []
    if owner_uid is not None:
        roots.append(Path(f"/run/user/{owner_uid}/bucketfs"))
    if base := os.environ.get("XDG_RUNTIME_DIR"):
        roots.append(Path(base) / "bucketfs")
    owner = os.geteuid() if owner_uid is None else owner_uid
    roots.append(ROOT_RUNTIME if owner == 0 else tmp_root(owner))
    unique = dict.fromkeys(root / digest / SOCKET_NAME for root in roots)
    return list(unique)


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    mountpoint: str
    fstype: str
    source: str = ""
    #: "MAJOR:MINOR" of the mounted filesystem's st_dev (also its /sys/class/bdi name).
    device: str = ""
    #: The superblock options, e.g. "rw,user_id=1000,group_id=1000" for FUSE.
    options: str = ""

    @property
    def owner_uid(self) -> int | None:
        """The uid that mounted a FUSE filesystem (its daemon's user)."""
        for option in self.options.split(","):
            key, _, value = option.partition("=")
            if key == "user_id" and value.isdigit():
                return int(value)
        return None


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return (
        field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def read_mounts(path: str = MOUNTINFO) -> list[Mount]:
    """Every mount this process sees, in mount order (tests replace this function)."""
    mounts = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rest = right.split()
            if len(fields) >= 5 and len(rest) >= 2:
                options = rest[2] if len(rest) >= 3 else ""
                mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]),
                                    fields[2], options))
    return mounts


def is_under(path: str, directory: str) -> bool:
    """Component-wise prefix test of two absolute, normalised paths."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def mount_of(real_path: str, mounts: list[Mount]) -> Mount | None:
    """The mount `real_path` lives on: the longest mountpoint above it (the last one
    stacked there wins). Returns None unless that mount is a bucketfs mount."""
    best: Mount | None = None
    for mount in mounts:
        if is_under(real_path, mount.mountpoint) and (
            best is None or len(mount.mountpoint) >= len(best.mountpoint)
        ):
            best = mount
    return best if best is not None and best.fstype == FSTYPE else None
