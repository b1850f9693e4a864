"""A mount's data processes, seen from its dispatcher (docs/DATA_PROCESSES.md): starting
them, handing each READ to the one that owns the object, and what happens when one dies.

Each data process (data_process.py) shares the mount's /dev/fuse descriptor and writes
its replies there itself, so the dispatcher's thread pays only a job's send per read
(pyfuse3's `read` then returns `REPLIED_ELSEWHERE`, a hunk of bucketfs's patch).

A read handed to a data process must be answered even if the process dies, or its
reader waits forever. Data processes send nothing back per read (an acknowledgement
would cost the dispatcher a wakeup each); instead the dispatcher keeps the `unique` of
the last RECENT reads it handed each one, and when one's socket end closes answers them
all EIO on the connection. The kernel never reuses a `unique` on a connection and
refuses a reply to one already answered (ENOENT), so only the reads still waiting get
the error. Reads of that process's objects fail at once until it is started again,
after a pause that doubles while restarts keep failing; everything else goes on.

Concurrency: everything here runs on the dispatcher's trio thread but the children's
start (`subprocess.Popen`, quick) and their reaping (a worker thread).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import trio

from bucketfs.data_jobs import (
    CHANGED,
    COUNTS,
    LEVEL,
    LOG,
    NOTICE_MAX,
    READY,
    Counts,
    Job,
    Setup,
    add_counts,
    owner_of_job,
    pack_job,
    read_notice,
)
from bucketfs.fuse_replies import fail_all

log = logging.getLogger(__name__)

#: Reads per data process answered EIO should it die: far more than can be in flight
#: (the kernel's background reads plus one per reading thread).
RECENT = 65536
#: The first pause before a data process is started again, and the longest.
RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 30.0
#: A data process that served this long before it died is restarted after the first
#: pause again.
HEALTHY_S = 60.0
#: How long a data process may take to flush and exit at unmount before it is killed.
EXIT_S = 30.0
#: A serving data process that sent nothing for this long is taken for hung and killed
#: (then started again, its reads answered EIO): it reports its counters every second
#: from its trio thread, which does no blocking work.
SILENT_S = 30.0


class _Process:
    """One data process slot: the running child, if any, and its socket end."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.socket: socket.socket | None = None
        self.recent = collections.deque[int](maxlen=RECENT)
        self.started_at = 0.0
        #: When the running child last sent a notice.
        self.heard = 0.0
        #: Set when the running child has built its data path.
        self.ready = trio.Event()
        #: The running child's latest counters.
        self.counts: Counts = {}


class DataProcesses:
    """`count` data processes serving the reads of `fuse_fd`'s mount."""

    def __init__(self, setups: list[Setup], fuse_fd: int, *,
                 on_changed: Callable[[str], None] | None = None) -> None:
        """`fuse_fd`: the mount's /dev/fuse descriptor (may be set until `run`).
        `on_changed(key)`: an object changed in the bucket (may be set until `run`)."""
        self.setups, self.fuse_fd, self.on_changed = setups, fuse_fd, on_changed
        self.slots = [_Process() for _ in setups]
        #: Data processes started again after one died.
        self.restarts = 0
        #: What data processes that died had counted, so that the sums never go back.
        self.retired: Counts = {}
        #: Data processes killed as hung (`SILENT_S`).
        self.hung = 0
        self.silent_s = SILENT_S
        self._closing = False

    @property
    def count(self) -> int:
        return len(self.slots)

    async def wait_ready(self) -> None:
        """Until every data process running now has built its data path."""
        for slot in self.slots:
            if slot.socket is not None:
                await slot.ready.wait()

    def counts(self) -> Counts:
        """Every data process's counters summed (data_process.JobServer.counts), those
        that died included, as of each one's last report (at most a second old)."""
        total = dict(self.retired)
        for slot in self.slots:
            add_counts(total, slot.counts)
        return total

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start every data process, then keep each running until `close`."""
        for index in range(self.count):
            self._start(index)
        task_status.started()
        async with trio.open_nursery() as nursery:
            for index in range(self.count):
                nursery.start_soon(self._keep, index)
                nursery.start_soon(self._watch, index)

    async def send(self, job: Job) -> bool:
        """Hand `job` to its owner; False if the owner is not running (answer EIO)."""
        message = pack_job(job)
        slot = self.slots[owner_of_job(message, self.count)]
        while (sock := slot.socket) is not None:
            try:
                sock.send(message)
            except BlockingIOError:  # the owner is behind: wait for room
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError:  # it died meanwhile
                    return False
                continue
            except OSError:  # it died (EPIPE) before its end was seen to close
                return False
            slot.recent.append(job.unique)
            return True
        return False

    def _start(self, index: int) -> None:
        slot = self.slots[index]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours.send(self.setups[index].pack())
            slot.child = subprocess.Popen(
                [sys.executable, "-m", "bucketfs.data_process", "--fuse-fd",
                 str(self.fuse_fd), "--jobs-fd", str(theirs.fileno()),
                 "--parent", str(os.getpid()), "--index", str(index)],
                pass_fds=(self.fuse_fd, theirs.fileno()), stdin=subprocess.DEVNULL,
                close_fds=True)
        except OSError as exc:
            ours.close()
            log.error("cannot start data process %d: %s", index, exc)
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        slot.socket, slot.recent = ours, collections.deque(maxlen=RECENT)
        slot.ready = trio.Event()
        slot.started_at = slot.heard = trio.current_time()

    async def _keep(self, index: int) -> None:
        slot, delay = self.slots[index], RESTART_DELAY_S
        while not self._closing:
            if slot.socket is not None:
                await self._listen(slot)
                if self._closing:
                    return
                if trio.current_time() - slot.started_at > HEALTHY_S:
                    delay = RESTART_DELAY_S
                code = await self._reap(slot)
                answered = self._gone(slot)
                log.warning("data process %d exited (%s): %d reads waiting on it answered "
                            "EIO; starting it again in %.1f s", index, code, answered, delay)
            await trio.sleep(delay)
            if self._closing:
                return
            delay = min(2 * delay, RESTART_DELAY_MAX_S)
            self._start(index)
            self.restarts += 1

    async def _listen(self, slot: _Process) -> None:
        """Take the notices of `slot`'s process until its end closes."""
        sock = slot.socket
        assert sock is not None
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:  # closed by `close`
                return
            while True:
                try:
                    message = sock.recv(NOTICE_MAX)
                except BlockingIOError:
                    break
                except OSError:
                    message = b""
                if not message:
                    return
                slot.heard = trio.current_time()
                self._notice(slot, message)

    async def _watch(self, index: int) -> None:
        """Kill the data process in `index`'s slot once it serves (it said it was ready)
        and then falls silent for `silent_s`: a hung process would hold its reads, and
        its objects' later ones, for ever. Its death is then handled as any other."""
        slot = self.slots[index]
        while not self._closing:
            await trio.sleep(self.silent_s / 4)
            child = slot.child
            if child is None or slot.socket is None or not slot.ready.is_set():
                continue
            silent = trio.current_time() - slot.heard
            if silent > self.silent_s and not self._closing:
                log.warning("data process %d sent nothing for %.0f s; killing it as hung",
                            index, silent)
                self.hung += 1
                slot.heard = trio.current_time()  # one kill: its death follows
                with contextlib.suppress(OSError):
                    child.kill()

    def _notice(self, slot: _Process, message: bytes) -> None:
        kind, text = read_notice(message)
        if kind == READY:
            slot.ready.set()
        elif kind == COUNTS:
            try:
                slot.counts = {name: int(n) for name, n in json.loads(text).items()}
            except (ValueError, AttributeError, TypeError):
                log.warning("data process sent counters that do not parse; ignored")
        elif kind == CHANGED:
            if self.on_changed is not None:
                self.on_changed(text)
        elif kind == LOG:
            level, _, line = text.partition("\t")
            log.log(int(level) if level.isdigit() else logging.WARNING, "%s", line)

    def _gone(self, slot: _Process) -> int:
        """Answer EIO every read handed to `slot`'s process that still waits."""
        sock, slot.socket = slot.socket, None
        slot.ready.set()  # whoever waits for it to start waits no more
        if sock is not None:
            trio.lowlevel.notify_closing(sock)
            sock.close()
        answered = fail_all(self.fuse_fd, slot.recent)
        slot.recent.clear()
        add_counts(self.retired, {name: n for name, n in slot.counts.items()
                                  if not name.startswith(LEVEL)})
        slot.counts = {}
        return answered

    async def _reap(self, slot: _Process) -> str:
        child, slot.child = slot.child, None
        if child is None:
            return "not started"
        with trio.move_on_after(5):
            code = await trio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
            return f"signal {-code}" if code < 0 else f"code {code}"
        child.kill()  # its socket closed but it lingers: it holds the mount's descriptor
        return "killed"

    async def close(self) -> None:
        """Stop every data process: each flushes what only its RAM holds to its SSD
        shard and exits, or is killed after EXIT_S."""
        self._closing = True
        for slot in self.slots:
            if slot.socket is not None:
                trio.lowlevel.notify_closing(slot.socket)
                slot.socket.close()
                slot.socket = None
        children = [slot.child for slot in self.slots if slot.child is not None]
        for slot in self.slots:
            slot.child = None

        def wait_all() -> None:
            for child in children:
                try:
                    child.wait(EXIT_S)
                except subprocess.TimeoutExpired:
                    log.warning("data process %d did not exit in %.0f s; killed",
                                child.pid, EXIT_S)
                    with contextlib.suppress(OSError):
                        child.kill()
                        child.wait()

        await trio.to_thread.run_sync(wait_all)
