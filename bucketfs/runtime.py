"""Where a mount's runtime files live, and what /proc says is mounted.

Each mount has a state directory named after its mountpoint under the runtime root:
`$XDG_RUNTIME_DIR/bucketfs`, else `/run/bucketfs` for root, else `/tmp/bucketfs-UID`.
The daemon writes its pid there, so `bucketfs umount` can wait for it to finish, and
listens for hints on `hints.sock` there (docs/HINTS.md). The root is ours and open to
others for traversal only (a hints group reaches its mount's directory through it); a
state directory is ours with mode 0700, or 0750 and the hints group. One found there
that is not ours, or that others can write to, is refused: under /tmp another user
could have made it first.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The names are defined once, with the hints client (standard library only), so the
# daemon and a training process running as another user agree on them.
from bucketfs.hints.location import FSTYPE, read_mounts, runtime_root, state_dir
from bucketfs.private import create_private_file, private_directory

__all__ = ["FSTYPE", "MountEntry", "default_log_file", "mounted", "prepare_state_dir",
           "runtime_root", "state_dir", "write_pid"]

PID_FILE = "pid"


def default_log_file(mountpoint: str) -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    name = mountpoint.strip("/").replace("/", "_") or "root"
    return os.path.join(base, "bucketfs", f"{name}.log")


def scratch_root() -> Path:
    """A private directory on disk for what the daemon keeps outside any cache
    directory (a mount without --cache-dir keeps its directory listings there): the
    user's cache home, not /tmp, which is often RAM outside every budget."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return private_directory(Path(base) / "bucketfs", parents=True)


def prepare_state_dir(mountpoint: str, group: int | None = None) -> Path:
    """The mount's state directory, made ours and private (see the module docstring).
    Raises UnsafePath if another user could have planted it or what is above it."""
    root = runtime_root()
    private_directory(root, 0o711)
    mode = 0o700 if group is None else 0o750
    return private_directory(state_dir(mountpoint), mode, group=group)


def write_pid(mountpoint: str) -> None:
    create_private_file(state_dir(mountpoint) / PID_FILE, f"{os.getpid()}\n".encode())


def clear_pid(mountpoint: str) -> None:
    (state_dir(mountpoint) / PID_FILE).unlink(missing_ok=True)


def daemon_pid(mountpoint: str) -> int | None:
    try:
        return int((state_dir(mountpoint) / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


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


def stale(mountpoint: str) -> bool:
    """Whether the FUSE mount at `mountpoint` lost its daemon ("Transport endpoint is not
    connected"). stat() can be answered from the kernel's cache; statvfs always reaches
    the daemon, and fails with ENOTCONN once it is gone (ECONNABORTED if it was asked
    while the daemon died)."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def unmount(mountpoint: str, *, lazy: bool = False) -> subprocess.CompletedProcess[str]:
    """fusermount3 -u (umount without FUSE's tool). `lazy` (-z) detaches the mount even
    while processes still use it: they get ENOTCONN, as they would from a dead daemon."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        command = [tool, "-u", *(["-z"] if lazy else []), mountpoint]
    else:
        command = ["umount", *(["-l"] if lazy else []), mountpoint]
    return subprocess.run(command, capture_output=True, text=True)
