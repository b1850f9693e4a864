"""Files and directories that only the mount's user (and a group the user configured)
may read, and that no other user can have planted.

The daemon often runs as root. A path under /tmp, or any directory another user can
write to, may already hold a symlink or a directory of theirs; writing through it would
let them choose what root overwrites. So:
- a directory we use is created with its final mode, and one found there must be ours
  (not a link, not writable by others); one of ours that is more open than it should be
  is closed down;
- a file is created exclusively with O_NOFOLLOW, or, for a log we append to, opened with
  O_NOFOLLOW and checked to be our own regular file.
Every refusal is an `UnsafePath` whose message is the one line the user sees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

#: What others may never do to a directory we use.
_OPEN_TO_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UnsafePath(Exception):
    """A path another user could control; the message is one line."""


def private_directory(path: str | os.PathLike[str], mode: int = 0o700, *,
                      group: int | None = None, parents: bool = False) -> Path:
    """`path` as a directory of ours with `mode` (and `group`, if given), created if
    missing. Refuses a link, a non-directory, one owned by another user, or one others
    can write to; tightens one of ours that is more open than `mode`. With `parents`,
    missing parents are made with the usual permissions (they hold nothing of ours)."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{path} is not a directory (a link or a file is in its place); "
                         "remove it")
    if info.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {info.st_uid}, not to uid {os.geteuid()}; "
                         "remove it")
    if info.st_mode & _OPEN_TO_OTHERS & ~mode:
        raise UnsafePath(f"{path} can be written by other users "
                         f"(mode {stat.S_IMODE(info.st_mode):04o}); remove it")
    if group is not None and info.st_gid != group:
        os.chown(path, -1, group)
    if stat.S_IMODE(info.st_mode) != mode:
        os.chmod(path, mode)  # after chown, which may clear the setgid bit
    return path


def create_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a new file of ours (mode 0600) at `path` in a directory of ours: an old one
    is replaced, a link is never followed."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        path.unlink()  # a dead daemon's; in a directory of ours, so nobody else's
        fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def open_private_log(path: str | os.PathLike[str]) -> int:
    """A descriptor appending to the log file `path` (mode 0600), created if missing.
    Refuses a link, a file that is not ours or not a regular file, and a directory
    that is a link; a missing directory is made, private to us."""
    path = Path(path)
    try:
        parent = os.lstat(path.parent)
    except FileNotFoundError:
        private_directory(path.parent, parents=True)
    else:
        if stat.S_ISLNK(parent.st_mode):
            raise UnsafePath(f"the log's directory {path.parent} is a link; name its "
                             "real path")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"the log file {path} is a link; remove it") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePath(f"the log file {path} is not a regular file of uid "
                         f"{os.geteuid()}; remove it or choose another --log-file")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def openness(path: str | os.PathLike[str], allowed: int) -> int | None:
    """The mode of an existing directory if it grants more than `allowed`, else None."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    return mode if mode & ~allowed & 0o777 else None
