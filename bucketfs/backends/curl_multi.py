"""HTTP GETs made by libcurl on the trio thread: pycurl's multi interface, its sockets
watched by trio.

Why not a worker thread per GET: handing a GET to a worker and its answer back costs two
wakeups across threads and a wait for the GIL each way, and obstore's runtime adds its
own threads. On the 2-core VM a 100 KB GET through a worker cost 12.2 voluntary context
switches and 0.62 ms of CPU; made here, 0.23 and 0.44 ms (`python -m bench.worker_hops`);
a cold file on a mount went from 12.6 switches to 1.1 and from 1.71 to 1.51 ms
(`python -m bench.compare_trees`; docs/BENCHMARKS.md, step 33). On a node with many
cores each switch is a wakeup on another core, which is where the daemon's worker
threads cost 3-5x what two cores showed. libcurl does the HTTP in C; what is left in
Python is a few calls per GET (the body's pieces and the header lines go to
`list.append`, a C call). The cost: a GET's CPU is spent on the trio thread, whose time
per file bounds one daemon's rate of cold files.

How: the multi handle's sockets go into an epoll set of our own, whose one descriptor
trio waits on; libcurl's timer is the deadline of that wait. One driver task runs while
any GET is in flight (a trio system task, started by the first GET, ending when none is
left); each GET's task waits until the driver hands it the finished transfer. A GET
whose task is cancelled is taken out of the multi handle at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import pycurl
import trio

from bucketfs.spare_buffers import Buffer, spare_buffers

log = logging.getLogger(__name__)

#: A body this large or larger is copied into place as it arrives (Transfer says why).
LARGE_BODY = 1024 * 1024
#: While a large body arrives, its socket wakes the driver only once this much more of
#: it is there (SO_RCVLOWAT), or all that is left of it: the reader waits for the whole
#: block anyway, and over a link that brings ~50 KB per wakeup, each a round through
#: trio and libcurl, the rounds were a third of the daemon's CPU per GiB (step 43).
#: 1 MiB took 14% (near link) and 18% (far link) off what 256 KiB left (step 45); the
#: kernel grows the socket's buffer to hold the mark (and caps the mark at half its
#: largest, tcp_rmem's third value).
WAKE_BYTES = 1024 * 1024
#: A transfer slower than this many bytes a second for the whole read timeout is cut
#: (CURLE_OPERATION_TIMEDOUT: a transient error, retried as a stall is). libcurl's
#: check is of its speed over the last few seconds, so a server or proxy that sends a
#: byte now and then is cut too, where a floor of one byte a second let it hold a
#: reader for hours (a 100 KB file at 2 B/s: 14 h). Far below any live link's share of
#: a connection (a 50 Mbit/s link split 32 ways gives each ~200 KB/s).
MIN_SPEED = 1024
_EPOLL_OF = {pycurl.POLL_IN: select.EPOLLIN, pycurl.POLL_OUT: select.EPOLLOUT,
             pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT}


@dataclass(slots=True)
class Transfer:
    """One GET. Its header lines, and a small body's pieces, are appended to lists by
    libcurl's callbacks: `list.append` itself, a C call, where a Python function per
    piece and per line cost a quarter of a 100 KB GET's CPU. A body from LARGE_BODY on
    goes into a mapping (as long as its size class: spare_buffers.py) as its pieces
    (16 KiB at most: libcurl's CURL_MAX_WRITE_SIZE, whatever the read brought) arrive,
    by the mapping's own `write` (C: no Python frame per piece, where one cost ~0.03
    CPU-s per GiB; step 50): joined at the end, a 4 MiB body held the trio thread, and
    the FUSE replies waiting on it, for ~1 ms, and the near link's sequential read of
    large files ran 8% slower (docs/BENCHMARKS.md, step 34). libcurl stops a body
    longer than `length` (MAXFILESIZE, CURLE_FILESIZE_EXCEEDED) before it reaches the
    callback."""

    url: str
    headers: list[str]
    length: int
    #: Set by the engine:
    pieces: list[bytes] = field(default_factory=list)
    header_lines: list[bytes] = field(default_factory=list)
    status: int = 0
    #: libcurl's error code and message; 0 and "" when the transfer completed.
    error: int = 0
    message: str = ""
    _task: trio.lowlevel.Task | None = None
    #: A large body's mapping, written from its start (its position: the bytes so far).
    _buffer: Buffer | None = None
    #: A large body's socket and its low-water mark (WAKE_BYTES), which the engine
    #: sets after libcurl's callbacks return, where it can name the socket.
    _socket: int = -1
    _wake_at: int = 1
    _is_chunked: bool | None = None

    def take_body(self) -> bytes | Buffer | memoryview:
        """The body, once: the pieces are let go (the handle, kept for the next GET,
        still refers to the list). A large body is its buffer, or a view of its start
        where the buffer (its size class, spare_buffers.py) is longer."""
        if self._buffer is not None:
            body, self._buffer = self._buffer, None
            filled = body.tell()
            return body if filled == len(body) else memoryview(body)[:filled]
        pieces = self.pieces
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        return body

    def wake_wanted(self) -> int:
        """The low-water mark a large body's socket wants now: what the body still
        lacks, at most WAKE_BYTES, as a power of two (it changes seldom); the mark it
        has while nothing came yet (headers first), or the body is complete or
        chunked (the engine resets the mark as the transfer leaves)."""
        filled = self._buffer.tell()  # type: ignore[union-attr]
        left = self.length - filled
        if not filled or not left or self._chunked():
            return self._wake_at
        want = min(left, WAKE_BYTES)
        return 1 << (want.bit_length() - 1)

    def _chunked(self) -> bool:
        """Whether the body comes in chunks (asked once): its last chunk's few bytes
        may come after the body's, and a mark would hold them until libcurl's timer."""
        if self._is_chunked is None:
            encoding = self.header(_TRANSFER_ENCODING)
            self._is_chunked = encoding is not None and "chunked" in encoding.lower()
        return self._is_chunked

    def header(self, pattern: re.Pattern[bytes]) -> str | None:
        """The value of a response header, by a pattern from `header_pattern`; None if
        the response had none. (One search of the joined lines: a Python loop over
        them cost 7% of a GET. A GET without redirects has one response.)"""
        found = pattern.search(b"".join(self.header_lines))
        return None if found is None else found[1].decode("latin-1")


def header_pattern(name: str) -> re.Pattern[bytes]:
    """What `Transfer.header` looks for: the named header (any case), its value trimmed."""
    return re.compile(rb"^" + re.escape(name.encode()) + rb":[ \t]*(.*?)[ \t]*\r?$",
                      re.IGNORECASE | re.MULTILINE)


_TRANSFER_ENCODING = header_pattern("transfer-encoding")


@dataclass(frozen=True, slots=True)
class CurlSettings:
    connections: int = 16
    connect_timeout: float = 10.0
    #: A transfer that receives nothing for this long, or under MIN_SPEED, fails.
    read_timeout: float = 30.0
    #: CA bundle for HTTPS (None: libcurl's default).
    ca_file: str | None = None


def ca_file(named: str | None) -> str | None:
    """The CA bundle for HTTPS: the one named (AWS_CA_BUNDLE, REQUESTS_CA_BUNDLE, as
    the SDKs read it), else certifi's, as the SDKs use; None leaves libcurl's own."""
    if named:
        return named
    try:
        import certifi
    except ImportError:
        return None
    return certifi.where()


class TrioCurl:
    """GETs through one libcurl multi handle, on the trio thread (see the module's doc).
    At most `connections` connections to a host, kept alive between GETs."""

    def __init__(self, settings: CurlSettings) -> None:
        self.settings = settings
        self._multi = pycurl.CurlMulti()
        self._multi.setopt(pycurl.M_SOCKETFUNCTION, self._watch)
        self._multi.setopt(pycurl.M_TIMERFUNCTION, self._set_timer)
        self._multi.setopt(pycurl.M_MAX_HOST_CONNECTIONS, settings.connections)
        self._multi.setopt(pycurl.M_MAXCONNECTS, settings.connections)
        self._epoll = select.epoll()
        self._watched: set[int] = set()
        self._deadline = math.inf
        self._waiting: trio.CancelScope | None = None
        self._waiting_until = math.inf
        self._running: dict[pycurl.Curl, Transfer] = {}
        self._spare: list[pycurl.Curl] = []
        self._driving = False
        self._adding = False  # inside add_handle (see `_set_timer`)
        #: The large transfers running, whose sockets' low-water marks follow their
        #: bodies (`_set_wakes`).
        self._large: dict[pycurl.Curl, Transfer] = {}

    def close(self) -> None:
        for curl in list(self._running):
            self._remove(curl)
        for curl in self._spare:
            curl.close()
        self._spare.clear()
        self._multi.close()
        self._epoll.close()

    async def get(self, transfer: Transfer,
                  prepare: Callable[[pycurl.Curl], None] | None = None) -> Transfer:
        """Run the GET; the transfer comes back with its status, body and error set.
        `prepare` sets per-request options (credentials) on the handle. The request's
        headers are `transfer.headers` as they are now: pycurl copies the list."""
        await trio.lowlevel.checkpoint_if_cancelled()
        curl = self._spare.pop() if self._spare else self._new_handle()
        curl.setopt(pycurl.URL, transfer.url)
        curl.setopt(pycurl.HTTPHEADER, transfer.headers)
        if transfer.length >= LARGE_BODY:
            buffer = transfer._buffer = spare_buffers.take(transfer.length)
            buffer.seek(0)  # a spare one was written to its end before
            curl.setopt(pycurl.WRITEFUNCTION, buffer.write)
            self._large[curl] = transfer
        else:
            curl.setopt(pycurl.WRITEFUNCTION, transfer.pieces.append)
        curl.setopt(pycurl.HEADERFUNCTION, transfer.header_lines.append)
        curl.setopt(pycurl.MAXFILESIZE_LARGE, transfer.length)
        if prepare is not None:
            prepare(curl)
        transfer._task = trio.lowlevel.current_task()
        self._running[curl] = transfer
        # Adding asks libcurl's timer to fire at once; `_act` below is that firing, so
        # the waiting driver's deadline is left alone (`_set_timer`).
        self._adding = True
        try:
            self._multi.add_handle(curl)
        finally:
            self._adding = False
        if not self._driving:
            self._driving = True
            trio.lowlevel.spawn_system_task(self._drive, name="libcurl's GETs")
        # Start it now (send the request) rather than on the driver's next turn.
        try:
            self._act(pycurl.SOCKET_TIMEOUT, 0)
        except pycurl.error as exc:
            if self._running.get(curl) is transfer:
                self._remove(curl)
            transfer.error, transfer.message = -1, f"libcurl refused the GET: {exc}"
            return transfer
        finally:  # libcurl may still want an earlier turn than the driver waits for
            self._move_deadline(self._deadline)

        def abort(_: object) -> trio.lowlevel.Abort:
            if self._running.get(curl) is transfer:
                self._remove(curl)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return transfer

    # --- the driver -------------------------------------------------------------------

    async def _drive(self) -> None:
        descriptor = self._epoll.fileno()
        try:
            while self._running:
                # One cancel scope serves every round until libcurl's timer fires (then
                # the next gets its deadline): one entered and left per round was a
                # tenth of the trio thread's time while large bodies trickled in over a
                # link, ~20 rounds a MiB (docs/BENCHMARKS.md, step 43). `_set_timer`
                # moves its deadline earlier, during a round too.
                with trio.CancelScope(deadline=self._deadline) as scope:
                    self._waiting, self._waiting_until = scope, self._deadline
                    while self._running:
                        await trio.lowlevel.wait_readable(descriptor)
                        self._round()
                self._waiting = None
                if scope.cancelled_caught:  # the timer's deadline came
                    self._round()
        except trio.Cancelled:
            raise
        except BaseException as exc:  # never let a system task take the run down
            log.error("the GET driver failed: %s", exc)
            self._fail_all(f"GET driver failed: {exc}")
        finally:
            self._waiting = None
            self._driving = False
            # Cancelled with GETs in flight: the run is ending.
            self._fail_all("GET driver stopped")

    def _round(self) -> None:
        """Let libcurl act on the sockets that are ready, or on its timer if it is due
        or none is (a wakeup for nothing costs one `socket_action`)."""
        events = self._epoll.poll(0)
        if not events or trio.current_time() >= self._deadline:
            self._act(pycurl.SOCKET_TIMEOUT, 0)
        for fd, mask in events:
            self._act(fd, _curl_mask(mask))

    def _fail_all(self, message: str) -> None:
        """Fail every GET in flight and wake its task (whatever state libcurl is in)."""
        for curl, transfer in list(self._running.items()):
            del self._running[curl]
            self._let_go_of_buffer(curl)
            with contextlib.suppress(pycurl.error):
                self._multi.remove_handle(curl)
            self._spare.append(curl)
            self._stop_waking_late(transfer)
            transfer.error, transfer.message = -1, message
            task, transfer._task = transfer._task, None
            if task is not None:
                trio.lowlevel.reschedule(task)

    def _act(self, fd: int, mask: int) -> None:
        """Let libcurl act on a socket (or its timer), then hand out what finished."""
        self._multi.socket_action(fd, mask)
        while True:
            queued, done, failed = self._multi.info_read()
            for curl in done:
                self._finish(curl)
            for curl, code, message in failed:
                transfer = self._running.get(curl)
                if transfer is not None:
                    transfer.error, transfer.message = code, message
                self._finish(curl)
            if not queued:
                break
        if self._large:
            self._set_wakes()

    def _set_wakes(self) -> None:
        """Give each running large transfer's socket the low-water mark its body wants
        now (after libcurl acted, where it can say which socket a transfer uses; a few
        C calls per transfer, and a system call only when the mark changes). Only
        running transfers are here, and their sockets are their own."""
        for curl, transfer in self._large.items():
            want = transfer.wake_wanted()
            if want == transfer._wake_at:
                continue
            if transfer._socket < 0:
                try:
                    transfer._socket = curl.getinfo(pycurl.ACTIVESOCKET)
                except pycurl.error:  # no socket to name: it wakes at every byte
                    continue
            _set_low_water(transfer._socket, want)
            transfer._wake_at = want

    def _stop_waking_late(self, transfer: Transfer) -> None:
        """A transfer leaving with a raised mark: its socket back to waking at every
        byte (libcurl may keep the connection for another GET). Harmless if libcurl
        closed that socket, or its number is another's now: one byte is the default."""
        if transfer._wake_at > 1:
            _set_low_water(transfer._socket, 1)
            transfer._wake_at = 1

    def _finish(self, curl: pycurl.Curl) -> None:
        transfer = self._running.get(curl)
        if transfer is None:
            return
        try:
            transfer.status = curl.getinfo(pycurl.RESPONSE_CODE)
            self._remove(curl)
        finally:  # whatever failed, the GET's task must not wait forever
            task, transfer._task = transfer._task, None
            if task is not None:
                trio.lowlevel.reschedule(task)

    def _remove(self, curl: pycurl.Curl) -> None:
        transfer = self._running.pop(curl)
        self._let_go_of_buffer(curl)
        self._multi.remove_handle(curl)
        self._spare.append(curl)
        self._stop_waking_late(transfer)

    def _let_go_of_buffer(self, curl: pycurl.Curl) -> None:
        """A large transfer leaving: its handle, kept for the next GET, lets go of the
        mapping's `write` it held, which would keep the mapping alive (its memory past
        the RAM tier's budget) and never idle for the spare buffers to take."""
        if self._large.pop(curl, None) is not None:
            curl.setopt(pycurl.WRITEFUNCTION, _no_body)

    def _new_handle(self) -> pycurl.Curl:
        curl = pycurl.Curl()
        settings = self.settings
        curl.setopt(pycurl.NOSIGNAL, 1)
        curl.setopt(pycurl.FAILONERROR, 1)  # a 4xx or 5xx is an error, its body unread
        curl.setopt(pycurl.CONNECTTIMEOUT_MS, int(settings.connect_timeout * 1000))
        curl.setopt(pycurl.LOW_SPEED_LIMIT, MIN_SPEED)
        curl.setopt(pycurl.LOW_SPEED_TIME, max(1, math.ceil(settings.read_timeout)))
        curl.setopt(pycurl.BUFFERSIZE, 512 * 1024)
        curl.setopt(pycurl.PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS)
        # A connection per GET in flight, as the SDKs and obstore make: HTTP/2 would
        # put a large object's parallel GETs on one TCP connection.
        curl.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        if settings.ca_file is not None:
            curl.setopt(pycurl.CAINFO, settings.ca_file)
        return curl

    # --- libcurl's callbacks ----------------------------------------------------------

    def _watch(self, what: int, fd: int, multi: object, socketp: object) -> None:
        if what == pycurl.POLL_REMOVE:
            if fd in self._watched:
                self._watched.discard(fd)
                with contextlib.suppress(OSError):  # closed already
                    self._epoll.unregister(fd)
            return
        events = _EPOLL_OF.get(what, 0)
        if fd in self._watched:
            try:
                self._epoll.modify(fd, events)
                return
            except FileNotFoundError:  # closed and its number reused: watch it afresh
                pass
        self._epoll.register(fd, events)
        self._watched.add(fd)

    def _set_timer(self, timeout_ms: int) -> None:
        if timeout_ms < 0:
            # No timer: the waiting driver may wake for nothing at its old deadline,
            # which costs less than moving a cancel scope's deadline each time.
            self._deadline = math.inf
            return
        if timeout_ms == 0 and self._adding:
            # A GET being added: `get` acts at once, and then moves the deadline if
            # libcurl still wants one earlier than the driver's. Moving it here made the
            # driver's cancel scope fire and be rebuilt for a third of cold files (step 44).
            self._deadline = -math.inf
            return
        try:
            deadline = trio.current_time() + timeout_ms / 1000
        except RuntimeError:  # outside trio (closing): no GET is waiting
            return
        self._deadline = deadline
        self._move_deadline(deadline)

    def _move_deadline(self, deadline: float) -> None:
        """Bring the waiting driver's wakeup forward to `deadline` (never later)."""
        if self._waiting is not None and deadline < self._waiting_until:
            self._waiting.deadline = self._waiting_until = deadline


def _no_body(data: bytes) -> int:
    """The write callback of a handle between GETs (never called: each GET sets its own);
    refuses any body."""
    return 0


def _set_low_water(fd: int, nbytes: int) -> None:
    """SO_RCVLOWAT of a socket libcurl owns (wrapped, never closed here); a socket gone
    meanwhile is left alone."""
    if fd < 0:
        return
    try:  # closed by libcurl (a failed transfer's connection): the wrapper refuses it
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0, fd)
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
    except OSError:
        pass
    finally:
        sock.detach()


def _curl_mask(events: int) -> int:
    mask = 0
    if events & select.EPOLLIN:
        mask |= pycurl.CSELECT_IN
    if events & select.EPOLLOUT:
        mask |= pycurl.CSELECT_OUT
    if events & (select.EPOLLERR | select.EPOLLHUP):
        mask |= pycurl.CSELECT_ERR
    return mask
