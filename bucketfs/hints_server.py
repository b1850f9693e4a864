"""The daemon's end of the hints socket (docs/HINTS.md).

One request per connection: the peer's credentials are checked, one frame is read
within a deadline (a slow client cannot hold a slot), validated, handed to its handler
in the trio thread, and answered: `on_order` (an epoch's order, or with `next_epoch`
the next epoch's, announced ahead) and `on_end` for hints; `on_status` (`bucketfs
status`), `on_warm` and `on_cancel` (`bucketfs warm`) for the mount's control. A
handler that is not given (hints off, no status) is an error reply saying so. Nothing
a client sends can crash the daemon: every bad request gets an error reply and is
logged once per distinct reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from bucketfs.hints.protocol import (
    HEADER_SIZE,
    REPLIES,
    CancelWarm,
    End,
    Message,
    Order,
    ProtocolError,
    Reply,
    StatusQuery,
    StatusReport,
    Warm,
    WarmStarted,
    decode_body,
    encode,
    error_reply,
    kind_of,
    parse_header,
)
from bucketfs.private import UnsafePath, private_directory
from bucketfs.workers import in_worker

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
#: Seconds a client has to send its header; its body gets this plus length / MIN_RATE.
READ_TIMEOUT = 10.0
MIN_RATE = 8 << 20
#: Bodies larger than this are read and decoded one at a time, in a worker thread, so
#: sixteen clients cannot make the daemon hold 16 x 256 MiB, and a million paths do not
#: stall the FUSE handlers in the trio thread while they are checked.
BIG_BODY = 1 << 20
_MAX_LOGGED = 256
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: The answer to hints when the mount has hinted prefetch off (the socket still serves
#: status and warm).
HINTS_OFF = "hints are off on this mount (its prefetch_window is 0)"
T = TypeVar("T")


class HintsServerError(Exception):
    """The hints socket cannot be served; the message is one line."""


class _Server:
    def __init__(self, owner_uid: int, allowed_gid: int | None,
                 on_order: Callable[[Order], object] | None,
                 on_end: Callable[[str], object] | None, read_timeout: float, *,
                 on_status: Callable[[], dict[str, Any]] | None = None,
                 on_warm: Callable[[Sequence[str]], int] | None = None,
                 on_cancel: Callable[[int], object] | None = None) -> None:
        self.owner_uid = owner_uid
        self.allowed_gid = allowed_gid
        self.on_order = on_order
        self.on_end = on_end
        self.on_status = on_status
        self.on_warm = on_warm
        self.on_cancel = on_cancel
        self.read_timeout = read_timeout
        self.big_bodies = trio.CapacityLimiter(1)
        self.logged: set[str] = set()

    def log_once(self, reason: str) -> None:
        # Bounded, so that distinct garbage cannot grow the set without end.
        if reason not in self.logged and len(self.logged) < _MAX_LOGGED:
            self.logged.add(reason)
            log.warning("hints: %s", reason)

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            refusal = self.refusal(stream.socket)
            if refusal is not None:
                self.log_once(refusal)
                await self.reply(stream, error_reply(refusal))
                return
            try:
                message = await self.receive(stream)
            except ProtocolError as exc:
                self.log_once(f"bad request: {exc}")
                await self.reply(stream, error_reply(str(exc)))
                return
            except trio.TooSlowError:
                self.log_once("a client was too slow to send its request")
                await self.reply(stream, error_reply("timed out reading the request"))
                return
            except (trio.BrokenResourceError, ConnectionError):
                return
            if message is not None:
                await self.reply(stream, self.dispatch(message))

    def refusal(self, sock: trio.socket.SocketType) -> str | None:
        """Why this peer may not use the socket (hints, status, warm), or None if it
        may."""
        pid, uid, gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid in (0, self.owner_uid):
            return None
        if self.allowed_gid is not None and (
            gid == self.allowed_gid or self.allowed_gid in _peer_groups(sock, pid)
        ):
            return None
        group = f" nor in group {self.allowed_gid}" if self.allowed_gid is not None else ""
        return f"permission denied: uid {uid} is not the mount owner{group}"

    async def receive(self, stream: trio.SocketStream) -> Message | None:
        """One request, or None if the peer left without sending a byte (a probe)."""
        with trio.fail_after(self.read_timeout):
            header = await _receive(stream, HEADER_SIZE, "header", eof_ok=True)
        if not header:
            return None
        # Refuses an oversize body, or a flag its kind does not know, before reading it.
        kind, length, flags = parse_header(header)
        if length <= BIG_BODY:
            return decode_body(kind, await self.body(stream, length), flags)
        async with self.big_bodies:
            body = await self.body(stream, length)
            return await in_worker(decode_body, kind, body, flags)

    async def body(self, stream: trio.SocketStream, length: int) -> bytearray:
        with trio.fail_after(self.read_timeout + length / MIN_RATE):
            return await _receive(stream, length, "body")

    def dispatch(self, message: Message) -> Message:
        try:
            return self.answer(message)
        except ValueError as exc:
            self.log_once(f"request refused: {exc}")
            return error_reply(str(exc))
        except Exception:
            # A bug in a handler must not take the mount down with it.
            log.exception("hints: handling a %s failed", type(message).__name__)
            return error_reply("internal error in the daemon")

    def answer(self, message: Message) -> Message:
        """The handler's answer; a ValueError it raises is the client's error reply."""
        if isinstance(message, REPLIES):
            raise ValueError(f"a client may not send a {kind_of(message).name}")
        if isinstance(message, Order):  # also a next epoch's (`Order.next_epoch`)
            _given(self.on_order, HINTS_OFF)(message)
        elif isinstance(message, End):
            _given(self.on_end, HINTS_OFF)(message.job)
        elif isinstance(message, StatusQuery):
            return StatusReport(_given(self.on_status, "this daemon serves no status")())
        elif isinstance(message, Warm):
            return WarmStarted(_given(self.on_warm, "this daemon does not warm")(
                message.paths))
        elif isinstance(message, CancelWarm):
            _given(self.on_cancel, "this daemon does not warm")(message.id)
        return Reply(True)

    async def reply(self, stream: trio.SocketStream, reply: Message) -> None:
        try:
            frame = encode(reply)
        except ProtocolError as exc:  # a status report over its bound: a bug here
            log.error("hints: cannot send a %s: %s", kind_of(reply).name, exc)
            frame = encode(error_reply(f"internal error in the daemon: {exc}"))
        with trio.move_on_after(self.read_timeout), contextlib.suppress(
            trio.BrokenResourceError, ConnectionError
        ):
            await stream.send_all(frame)


def _given(handler: T | None, missing: str) -> T:
    if handler is None:
        raise ValueError(missing)
    return handler


async def _receive(stream: trio.SocketStream, size: int, what: str, *,
                   eof_ok: bool = False) -> bytearray:
    """Exactly `size` bytes; with `eof_ok`, empty if the stream ends before the first."""
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(min(size - len(data), 1 << 20))
        if not chunk:
            if eof_ok and not data:
                return data
            raise ProtocolError(f"truncated {what}: {len(data)} of {size} bytes")
        data += chunk
    return data


def _peer_groups(sock: trio.socket.SocketType, pid: int) -> set[int]:
    """The peer's supplementary groups: from the socket (SO_PEERGROUPS, as they were at
    connect time), else from /proc/PID/status."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 4096)
        return set(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


# --- The socket file -----------------------------------------------------------------


def _prepare_directory(directory: Path, allowed_gid: int | None) -> None:
    """The socket's directory is the mount's private state directory: ours, closed to
    others, and open to the allowed group for traversal only."""
    try:
        private_directory(directory, 0o700 if allowed_gid is None else 0o750,
                          group=allowed_gid, parents=True)
    except UnsafePath as exc:
        raise HintsServerError(f"{exc}; the hints socket needs a private directory") from None


def _remove_stale(path: Path) -> None:
    """Remove a socket a dead daemon left; refuse to take over a live one's."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise HintsServerError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise HintsServerError(f"cannot check the existing socket {path}: "
                                   f"{exc.strerror or exc}") from None
    raise HintsServerError(f"another daemon already serves hints at {path}")


async def _listen(path: Path, allowed_gid: int | None) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        # Nobody can connect before listen(), so the mode is right before anyone can.
        if allowed_gid is not None:
            os.chown(path, -1, allowed_gid)
        os.chmod(path, 0o660 if allowed_gid is not None else 0o600)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise HintsServerError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    return sock


async def serve_hints(
    socket_path: str | os.PathLike[str],
    *,
    owner_uid: int,
    allowed_gid: int | None = None,
    on_order: Callable[[Order], object] | None,
    on_end: Callable[[str], object] | None,
    on_status: Callable[[], dict[str, Any]] | None = None,
    on_warm: Callable[[Sequence[str]], int] | None = None,
    on_cancel: Callable[[int], object] | None = None,
    read_timeout: float = READ_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve hints on `socket_path` until cancelled, then remove the socket file.

    Connections are accepted from root, `owner_uid`, and members of `allowed_gid`.
    `on_order(order)` (an epoch's order, or with `order.next_epoch` the next epoch's)
    and `on_end(job)` run in the trio thread, as do `on_status()` (a JSON-able dict,
    the STATUS reply), `on_warm(paths)` (the id of the warm job it started) and
    `on_cancel(id)`; a ValueError they raise becomes the client's error reply, and
    one not given (None) is refused with a reply saying so (hints off: HINTS_OFF).
    Raises HintsServerError if the socket cannot be served (for example, another
    live daemon listens there)."""
    path = Path(socket_path)
    try:
        _prepare_directory(path.parent, allowed_gid)
        _remove_stale(path)
    except OSError as exc:
        raise HintsServerError(f"cannot serve hints at {path}: {exc.strerror or exc}") from None
    sock = await _listen(path, allowed_gid)
    ours = os.stat(path).st_ino
    server = _Server(owner_uid, allowed_gid, on_order, on_end, read_timeout,
                     on_status=on_status, on_warm=on_warm, on_cancel=on_cancel)
    slots = trio.Semaphore(max_connections)
    try:
        listener = trio.SocketListener(sock)
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                # Waiting for a slot before accepting leaves excess clients in the
                # kernel's backlog instead of in our memory.
                await slots.acquire()
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    # Out of file descriptors or memory: wait, never take the mount down.
                    slots.release()
                    server.log_once(f"cannot accept a connection: {exc.strerror or exc}")
                    await trio.sleep(0.1)
                    continue
                except BaseException:
                    slots.release()
                    raise
                nursery.start_soon(_serve_one, server, stream, slots)
    finally:
        sock.close()
        # Only our own socket: a newer daemon may have replaced it.
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ours:
                path.unlink()


async def _serve_one(server: _Server, stream: trio.SocketStream,
                     slots: trio.Semaphore) -> None:
    try:
        await server.handle(stream)
    except Exception:
        # A bug in one connection's handling must not take the mount down with it.
        log.exception("hints: serving a connection failed")
    finally:
        slots.release()
