"""What the kernel asks a FUSE daemon, counted by kind: the `fuse:fuse_request_send`
tracepoint, recorded with `perf` while a pass runs.

Why a census next to the CPU figures: a request's cost is mostly fixed (a wakeup of the
daemon, a reply), so requests per file say where a pass's CPU goes before any profile
does. It showed, for one, that Python's `open()` asks the daemon once per file even when
the page cache holds every byte: an IOCTL (TCGETS, from the `isatty()` that `open()`
makes to choose its buffering; Python 3.14 no longer makes it for regular files).

The tracepoint fires in the requesting process, so recording it costs the readers a
little and the daemon nothing. Needs root, `perf`, and a kernel with the FUSE
tracepoints (6.13 and later); `Census.available()` says whether this machine has them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

_TRACEPOINT = "fuse:fuse_request_send"
_FORMAT = Path("/sys/kernel/tracing/events/fuse/fuse_request_send/format")
#: `perf script` prints the tracepoint's own format: "connection N req N opcode N (NAME)".
_LINE = re.compile(r"connection (\d+) req \d+ opcode \d+ \((?:FUSE_)?(\w+)\)")


def connection_of(mountpoint: Path) -> int:
    """The FUSE connection number of a mount: its device's minor number (the name of
    its directory under /sys/fs/fuse/connections)."""
    return os.minor(os.stat(mountpoint).st_dev)


def count_requests(perf_script_output: str, connection: int) -> Counter[str]:
    """Requests per kind (LOOKUP, READ, IOCTL, ...) sent to `connection`."""
    counts: Counter[str] = Counter()
    for match in _LINE.finditer(perf_script_output):
        if int(match.group(1)) == connection:
            counts[match.group(2)] += 1
    return counts


class Census:
    """`with Census(mountpoint) as census: ...` then `census.counts`: the requests the
    kernel sent that mount meanwhile, by kind (empty if this machine cannot record)."""

    def __init__(self, mountpoint: Path) -> None:
        self.connection = connection_of(mountpoint)
        self.counts: Counter[str] = Counter()
        #: Whether the requests were counted (none sent is then an empty `counts`).
        self.recorded = False
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._perf: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("perf") is not None and os.geteuid() == 0 and _FORMAT.exists()

    def __enter__(self) -> Census:
        if not self.available():
            return self
        self._dir = tempfile.TemporaryDirectory(prefix="fuse-census-")
        data = Path(self._dir.name) / "perf.data"
        self._perf = subprocess.Popen(
            ["perf", "record", "-q", "-a", "-e", _TRACEPOINT, "-o", str(data)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # perf opens its buffers before it records anything; a request sent before then
        # would go uncounted.
        deadline = time.monotonic() + 10
        while not data.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._perf is None or self._dir is None:
            return
        try:
            self._perf.send_signal(signal.SIGINT)
            self._perf.wait(timeout=60)
            script = subprocess.run(
                ["perf", "script", "-i", str(Path(self._dir.name) / "perf.data")],
                capture_output=True, text=True, timeout=300)
            if script.returncode == 0:
                self.counts = count_requests(script.stdout, self.connection)
                self.recorded = True
        finally:
            self._dir.cleanup()

    def per_file(self, files: int) -> dict[str, float] | None:
        """Requests per file by kind, most frequent first; None if not counted."""
        if not self.recorded:
            return None
        return {kind: n / files for kind, n in self.counts.most_common()}
