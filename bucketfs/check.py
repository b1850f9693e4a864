"""`bucketfs check MOUNTPOINT`: is a live bucketfs mount there? Exit 0 or 1, one line.

Made for readiness probes (packaging/kubernetes/) and scripts. It fails when nothing is
mounted there, when another filesystem is, when the mount is stale (its daemon died:
ENOTCONN), and when the daemon does not answer within the timeout (stopped, or stuck).
statvfs is the question asked because it always reaches the daemon; stat may be
answered from the kernel's attribute cache long after the daemon is gone.
"""

from __future__ import annotations

import errno
import os
import sys
import threading

from bucketfs.runtime import FSTYPE, mounted

PROG = "bucketfs check"


def check(path: str, timeout: float) -> tuple[bool, str]:
    """(healthy, the line that says so or says why not)."""
    # The exact path first: resolving links stats the mountpoint, which a stopped
    # daemon would never answer.
    entry = mounted(os.path.abspath(path)) or mounted(os.path.realpath(path))
    if entry is None:
        return False, f"{path} is not mounted"
    if entry.fstype != FSTYPE:
        return False, f"{path} is a {entry.fstype} mount, not bucketfs"
    answered = threading.Event()
    failure: list[OSError] = []

    def ask() -> None:
        try:
            os.statvfs(entry.mountpoint)
        except OSError as exc:
            failure.append(exc)
        answered.set()

    # A daemon thread: one blocked on a daemon that never answers must not keep the
    # probe from exiting.
    threading.Thread(target=ask, daemon=True).start()
    if not answered.wait(timeout):
        return False, f"{path}: the bucketfs daemon did not answer within {timeout:g}s"
    if failure:
        exc = failure[0]
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return False, (f"{path} is stale: its daemon is gone (bucketfs umount {path}, "
                           "or mount again)")
        return False, f"{path}: {exc.strerror}"
    return True, f"{path}: bucketfs mount of {entry.source} answers"


def run_check(path: str, timeout: float) -> int:
    healthy, line = check(path, timeout)
    print(f"{PROG}: {line}", file=sys.stdout if healthy else sys.stderr, flush=True)
    return 0 if healthy else 1
