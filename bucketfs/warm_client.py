"""`bucketfs warm MOUNT [PATH...] [--list FILE]`: have the mount's daemon fetch a dataset,
or part of it, into its cache before training (the daemon's side: bucketfs/warm.py).

The command walks the directories it is given through the mount (the daemon lists
them once, as for any reader), sends the files' paths in one WARM request, and polls
STATUS for the job's progress: a bar on stderr, redrawn in place on a terminal, a line
every few seconds otherwise; a summary line on stdout at the end. When the files do
not fit the cache's budget the daemon warms the first ones that do, and this says so
in one line. Ctrl-C asks the daemon to stop the job (CANCEL) and waits for it: what
was fetched stays cached. Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from bucketfs.hints.cli import read_paths
from bucketfs.hints.client import DEFAULT_TIMEOUT, HintError, Target
from bucketfs.hints.control import cancel_warm, start_warm, status, target_of
from bucketfs.hints.location import is_under
from bucketfs.status_view import count, size

PROG = "bucketfs warm"
#: Seconds between two polls of the daemon, and between two progress lines when stderr
#: is not a terminal.
POLL_S = 0.25
LINE_EVERY_S = 5.0
#: The rate (and ETA) is over the last this many seconds.
RATE_WINDOW_S = 5.0
#: How long Ctrl-C waits for the daemon to stop the job.
STOP_WAIT_S = 30.0


class Interrupted(Exception):
    """Ctrl-C while the job runs."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mount", metavar="MOUNT", help="the bucketfs mount")
    parser.add_argument("paths", metavar="PATH", nargs="*",
                        help="files or directories to warm, relative to MOUNT or absolute "
                             "(default: all of MOUNT)")
    parser.add_argument("--list", metavar="FILE", dest="list_file",
                        help="a file of paths (files or directories), one a line, relative "
                             "to MOUNT or absolute; - for stdin")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds to wait for each answer of the daemon (default "
                             f"{DEFAULT_TIMEOUT:g})")


def run(args: argparse.Namespace) -> int:
    try:
        target = target_of(args.mount)
        named = list(args.paths)
        if args.list_file is not None:
            named += read_paths(args.list_file)
        files = collect(target, args.mount, named or ["."])
        if not files:
            raise HintError("no files to warm there")
        with _deferred_interrupts():  # the job must not start without us knowing its id
            number = start_warm(target, files, args.timeout)
        return Watch(target, number, args.timeout, sys.stderr).run()
    except HintError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the daemon started warming", file=sys.stderr)
        return 130


# --- what to warm ------------------------------------------------------------------------


def collect(target: Target, mount: str, named: Sequence[str]) -> list[str]:
    """The files under the named paths, relative to the mountpoint, each once: files as
    named, directories walked in name order."""
    root = os.path.realpath(mount)
    out: dict[str, None] = {}
    for name in named:
        path = os.path.realpath(os.path.join(root, name))
        if not is_under(path, target.mountpoint):
            raise HintError(f"{name} is not under the mount {target.mountpoint}")
        try:
            if os.path.isdir(path):
                out.update(dict.fromkeys(_walk(path, target.mountpoint)))
            elif os.path.exists(path):
                out[os.path.relpath(path, target.mountpoint)] = None
            else:
                raise HintError(f"{os.path.normpath(os.path.join(mount, name))}: no such "
                                "file or directory")
        except OSError as exc:
            raise HintError(f"{name}: {exc.strerror or exc}") from None
    return list(out)


def _walk(top: str, mountpoint: str) -> Iterator[str]:
    """Every file under `top`, in name order of their paths (a directory's files come
    where its name sorts). The kind comes from readdir (no stat of each file), so a
    million files cost only the directories' listings."""
    pending = [iter(_entries(top))]
    while pending:
        entry = next(pending[-1], None)
        if entry is None:
            pending.pop()
        elif entry.is_dir(follow_symlinks=False):
            pending.append(iter(_entries(entry.path)))
        elif entry.is_file(follow_symlinks=False):
            yield os.path.relpath(entry.path, mountpoint)


def _entries(directory: str) -> list[os.DirEntry[str]]:
    with os.scandir(directory) as scan:
        return sorted(scan, key=lambda entry: entry.name)


@contextlib.contextmanager
def _deferred_interrupts() -> Iterator[None]:
    """Ctrl-C waits until the block is done, then raises KeyboardInterrupt."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


# --- following the job -------------------------------------------------------------------


class Watch:
    """Polls the job's status and draws its progress until it is done."""

    def __init__(self, target: Target, number: int, timeout: float, out: TextIO) -> None:
        self.target = target
        self.number = number
        self.timeout = timeout
        self.bar = ProgressBar(out)
        self.warned = False

    def run(self) -> int:
        try:
            job = self._follow()
        except KeyboardInterrupt:
            return self._stop()
        self.bar.finish(job)
        return _summary(job, self.target.mountpoint)

    def _job(self) -> dict[str, Any]:
        for job in status(self.target, self.timeout).get("warm", []):
            if job["id"] == self.number:
                return job
        raise HintError(f"the daemon no longer reports warm job {self.number}")

    def _follow(self) -> dict[str, Any]:
        while True:
            job = self._job()
            if job["state"] != "resolving" and not self.warned:
                self.warned = True
                for line in _warnings(job):
                    self.bar.note(f"{PROG}: warning: {line}")
            if job["done"]:
                return job
            self.bar.show(job)
            time.sleep(POLL_S)

    def _stop(self) -> int:
        self.bar.note(f"{PROG}: interrupted: stopping warm job {self.number}")
        try:
            cancel_warm(self.target, self.number, self.timeout)
            deadline = time.monotonic() + STOP_WAIT_S
            job = self._job()
            while not job["done"] and time.monotonic() < deadline:
                time.sleep(POLL_S)
                job = self._job()
        except HintError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 130
        except KeyboardInterrupt:
            return 130  # a second Ctrl-C: leave now, the daemon stops it anyway
        done = "stopped" if job["done"] else "is stopping"
        print(f"{PROG}: warm job {self.number} {done}: {count(job['files_done'])} of "
              f"{count(job['files_total'])} files ({size(job['bytes_done'])}) are cached; "
              f"warm again to fetch the rest", file=sys.stderr)
        return 130


def _warnings(job: dict[str, Any]) -> list[str]:
    lines = []
    if job["skipped_files"]:
        wanted = job["bytes_total"] + job["skipped_bytes"]
        files = job["files_total"] + job["skipped_files"]
        lines.append(f"{size(wanted)} in {count(files)} files will not fit the "
                     f"{job['tier'].upper()} cache's budget of {size(job['budget'])}: "
                     f"warming the first {count(job['files_total'])} files "
                     f"({size(job['bytes_total'])})")
    if job["missing"]:
        lines.append(f"{count(job['missing'])} paths named no file in the bucket")
    return lines


def _summary(job: dict[str, Any], mountpoint: str) -> int:
    fetched = job["files_done"] - job["files_cached"]
    print(f"warmed {count(job['files_done'])} files ({size(job['bytes_done'])}) into the "
          f"cache of {mountpoint} in {job['elapsed_s']:.1f} s: {count(fetched)} fetched, "
          f"{count(job['files_cached'])} cached already; {count(job['errors'])} errors")
    if job["state"] == "failed":
        print(f"{PROG}: error: the warm job failed: {job['reason']}", file=sys.stderr)
        return 1
    if job["state"] == "cancelled":
        print(f"{PROG}: error: the warm job was cancelled", file=sys.stderr)
        return 1
    if job["errors"]:
        print(f"{PROG}: error: {count(job['errors'])} files could not be fetched "
              f"(first: {job['first_error']})", file=sys.stderr)
        return 1
    return 0


class ProgressBar:
    """Bytes, files, rate and ETA: redrawn in place on a terminal, else a line every
    LINE_EVERY_S seconds."""

    WIDTH = 24

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.drawn = False  # a bar is on the terminal's current line
        self.last_line = -LINE_EVERY_S
        #: (time, bytes done), for the rate over the last RATE_WINDOW_S.
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def show(self, job: dict[str, Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, job["bytes_done"]))
        while self.samples[0][0] < now - RATE_WINDOW_S:
            self.samples.popleft()
        text = self.text(job)
        if self.tty:
            self.out.write(f"\r\x1b[K{text}")
            self.drawn = True
        elif now - self.last_line >= LINE_EVERY_S:
            self.last_line = now
            self.out.write(f"{PROG}: {text}\n")
        self.out.flush()

    def note(self, line: str) -> None:
        """A line of its own, above the bar."""
        self._clear()
        self.out.write(line + "\n")
        self.out.flush()

    def finish(self, job: dict[str, Any]) -> None:
        self.show(job)
        if self.tty:
            self.out.write("\n")
            self.drawn = False
        self.out.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[K")
            self.drawn = False

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (first, start), (last, end) = self.samples[0], self.samples[-1]
        return (end - start) / (last - first) if last > first else 0.0

    def text(self, job: dict[str, Any]) -> str:
        if job["state"] == "resolving":
            return f"finding {count(job['paths'])} files in the bucket..."
        total, done = job["bytes_total"], job["bytes_done"]
        fraction = done / total if total else 1.0
        filled = round(fraction * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        rate = self.rate()
        eta = _clock((total - done) / rate) if rate > 0 and not job["done"] else "--:--"
        if job["done"]:
            eta = "done"
        return (f"[{bar}] {fraction:4.0%}  {size(done)} of {size(total)}  "
                f"{count(job['files_done'])}/{count(job['files_total'])} files  "
                f"{size(rate)}/s  ETA {eta}")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
