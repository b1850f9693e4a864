"""The daemon's hints socket, served for real on a Unix socket in a temporary directory.

Clients are plain blocking sockets run in worker threads (or, for other users, child
processes that drop to another uid), while the server runs under trio.run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from bucketfs import hints_server
from bucketfs.hints.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    End,
    Kind,
    Order,
    Reply,
    decode,
    encode,
    parse_header,
)
from bucketfs.hints_server import HintsServerError, serve_hints

# Root may always send hints, so as root the owner is someone else, to test the check.
OWNER = 4242 if os.geteuid() == 0 else os.geteuid()
NOBODY = 65534
GROUP = 4343
GOOD = encode(Order("job-1", 0, 1, 3, ["train/a.jpg", "train/b.jpg"]))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # Short, so it fits in sun_path (108 bytes); pytest's tmp_path can be too long.
    top = Path(tempfile.mkdtemp(prefix="bfh-"))
    top.chmod(0o711)  # other users may pass through to the state directory
    yield top / "state" / "hints.sock"
    shutil.rmtree(top, ignore_errors=True)


#: What the test daemons report on STATUS, and the id of every warm job they start.
STATUS = {"schema": 1, "mount": {"mountpoint": "/test"}, "cache": {}, "prefetch": {},
          "origin": {}}
WARM_ID = 7


class Daemon:
    """What the callbacks received."""

    def __init__(self) -> None:
        self.orders: list[Order] = []
        self.ends: list[str] = []
        self.warms: list[list[str]] = []
        self.cancels: list[int] = []

    def status(self) -> dict[str, Any]:
        return STATUS

    def warm(self, paths: Any) -> int:
        self.warms.append(list(paths))
        return WARM_ID


def serve(path: Path, client: Callable[[], Any], *, after_start: Callable[[], None] = lambda: None,
          on_order: Callable[[Order], object] | None = None, **options: Any,
          ) -> tuple[Any, Daemon]:
    """Run the server, then `client()` in a worker thread; stop the server after it."""
    daemon = Daemon()
    options.setdefault("owner_uid", OWNER)

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(
                serve_hints, path, on_order=on_order or daemon.orders.append,
                on_end=daemon.ends.append, **options))
            after_start()
            result = await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main), daemon


@contextlib.contextmanager
def daemon_thread(path: Path, **options: Any) -> Iterator[Daemon]:
    """The server in a background thread, for clients that run in the test's thread
    (the sampler and client tests use it too)."""
    daemon = Daemon()
    options.setdefault("owner_uid", os.getuid())
    options.setdefault("on_order", daemon.orders.append)
    options.setdefault("on_end", daemon.ends.append)
    options.setdefault("on_status", daemon.status)
    options.setdefault("on_warm", daemon.warm)
    options.setdefault("on_cancel", daemon.cancels.append)
    started = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            state["scope"] = nursery.cancel_scope
            state["token"] = trio.lowlevel.current_trio_token()
            await nursery.start(partial(serve_hints, path, **options))
            started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            state["error"] = exc
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    if "error" in state:
        raise state["error"]
    try:
        yield daemon
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(10)


def receive_reply(sock: socket.socket) -> Reply:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            assert chunk, "connection closed without a reply"
            data += chunk
        return data

    header = exactly(HEADER_SIZE)
    kind, length, _ = parse_header(header)
    reply = decode(header + exactly(length))
    assert kind is Kind.REPLY and isinstance(reply, Reply)
    return reply


def exchange(path: Path, data: bytes, *, timeout: float = 10.0) -> Reply:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        return receive_reply(sock)


def header(kind: int = Kind.ORDER, length: int = 0, *, magic: bytes = MAGIC,
           version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, kind, 0, length)


# --- Requests --------------------------------------------------------------------------


def test_orders_and_ends_reach_the_callbacks(sock_path):
    def client() -> list[Reply]:
        mode = stat.S_IMODE(os.stat(sock_path).st_mode)
        assert mode == 0o600 and stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o700
        return [exchange(sock_path, GOOD), exchange(sock_path, encode(End("job-1")))]

    replies, daemon = serve(sock_path, client)
    assert replies == [Reply(True), Reply(True)]
    [order] = daemon.orders
    assert (order.job, order.rank, order.world_size, order.epoch) == ("job-1", 0, 1, 3)
    assert order.paths == ["train/a.jpg", "train/b.jpg"]
    assert daemon.ends == ["job-1"]
    assert not sock_path.exists(), "the socket is removed on exit"


def test_a_next_epoch_order_reaches_on_order_marked_as_such(sock_path):
    ahead = encode(Order("job-1", 0, 1, 4, ["train/b.jpg", "train/a.jpg"], next_epoch=True))
    # Over BIG_BODY: read apart and decoded in a worker thread, the flag with it.
    many = [f"train/{i:08d}_{'x' * 80}.jpg" for i in range(20_000)]
    big = encode(Order("job-1", 0, 1, 5, many, next_epoch=True))
    assert len(big) > hints_server.BIG_BODY
    replies, daemon = serve(sock_path, lambda: [exchange(sock_path, GOOD),
                                                exchange(sock_path, ahead),
                                                exchange(sock_path, big)])
    assert replies == [Reply(True)] * 3
    assert [(o.epoch, o.next_epoch, o.paths) for o in daemon.orders] == [
        (3, False, ["train/a.jpg", "train/b.jpg"]), (4, True, ["train/b.jpg", "train/a.jpg"]),
        (5, True, many)]


def test_a_million_paths_arrive(sock_path):
    paths = [f"train/c{i % 1000}/{i:08d}_{'x' * 80}.jpg" for i in range(1_000_000)]
    frame = encode(Order("big", 0, 1, 0, paths))
    reply, daemon = serve(sock_path, lambda: exchange(sock_path, frame, timeout=60))
    assert reply.ok and daemon.orders[0].paths == paths


@pytest.mark.parametrize("data, reason", [
    (os.urandom(1000).replace(b"B", b"x"), "bad magic"),
    (header(magic=b"GET "), "bad magic"),
    (header(version=VERSION + 1), "unsupported protocol version"),
    (header(kind=9), "unknown message kind 9"),
    (header(length=0xFFFF_FFFF), "over the limit"),
    (header(length=100) + b"x" * 50, "truncated body: 50 of 100 bytes"),
    (GOOD[:7], "truncated header: 7 of 12 bytes"),
    (encode(Reply(True)), "a client may not send a REPLY"),
    (header(Kind.ORDER, 3) + b"abc", "too short"),
    (HEADER.pack(MAGIC, VERSION, Kind.ORDER, 0x10, 0), "unknown flags 0x10 for ORDER"),
    (HEADER.pack(MAGIC, VERSION, Kind.END, 1, 0), "unknown flags 0x1 for END"),
])
def test_bad_requests_get_an_error_reply_and_the_server_goes_on(sock_path, data, reason, caplog):
    def client() -> tuple[Reply, Reply, Reply]:
        return (exchange(sock_path, data), exchange(sock_path, data),
                exchange(sock_path, GOOD))

    with caplog.at_level(logging.WARNING, logger="bucketfs.hints_server"):
        (bad, again, good), daemon = serve(sock_path, client)
    assert not bad.ok and reason in bad.reason and again == bad
    assert good.ok and len(daemon.orders) == 1
    logged = [r for r in caplog.records if reason in r.getMessage()]
    assert len(logged) == 1, "each distinct reason is logged once"


def test_a_huge_declared_length_is_refused_without_reading_the_body(sock_path):
    def client() -> tuple[Reply, float]:
        start = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(sock_path))
            sock.sendall(header(length=1 << 30))  # and no body at all
            return receive_reply(sock), time.monotonic() - start

    (reply, elapsed), _ = serve(sock_path, client)
    assert not reply.ok and "over the limit" in reply.reason and elapsed < 2


def test_a_stream_of_garbage_is_cut_off_after_the_header(sock_path):
    garbage = b"\xab" * (64 << 20)
    reply, daemon = serve(sock_path, lambda: exchange(sock_path, garbage))
    assert not reply.ok and "bad magic" in reply.reason and not daemon.orders


@pytest.mark.parametrize("send", ["nothing", "part of a header", "a body, slowly"])
def test_a_slow_client_times_out(sock_path, send):
    def client() -> tuple[Reply, float]:
        start = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(sock_path))
            if send == "part of a header":
                sock.sendall(GOOD[:5])
            elif send == "a body, slowly":
                sock.sendall(GOOD[:HEADER_SIZE])
                # One byte every 50 ms: each arrives in time, the whole body does not.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    for byte in GOOD[HEADER_SIZE:]:
                        sock.send(bytes([byte]))
                        time.sleep(0.05)
            return receive_reply(sock), time.monotonic() - start

    (reply, elapsed), daemon = serve(sock_path, client, read_timeout=0.5)
    assert not reply.ok and "timed out" in reply.reason
    assert 0.4 < elapsed < 3 and not daemon.orders


def test_connections_are_bounded_and_an_idle_one_frees_its_slot(sock_path):
    def client() -> float:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.connect(str(sock_path))  # holds the only slot until it times out
            time.sleep(0.1)
            start = time.monotonic()
            assert exchange(sock_path, GOOD).ok
            return time.monotonic() - start

    waited, daemon = serve(sock_path, client, read_timeout=0.5, max_connections=1)
    assert waited >= 0.3 and len(daemon.orders) == 1


def test_callback_errors_become_error_replies(sock_path, caplog):
    calls = []

    def on_order(order: Order) -> None:
        calls.append(order)
        if len(calls) == 1:
            raise ValueError("world size changed mid-job")
        if len(calls) == 2:
            raise RuntimeError("a bug")

    def client() -> list[Reply]:
        return [exchange(sock_path, GOOD) for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="bucketfs.hints_server"):
        replies, _ = serve(sock_path, client, on_order=on_order)
    assert replies == [Reply(False, "world size changed mid-job"),
                       Reply(False, "internal error in the daemon"), Reply(True)]
    assert any(r.exc_info for r in caplog.records), "a handler's bug is logged with its trace"


# --- The socket file -------------------------------------------------------------------


def test_a_stale_socket_is_replaced(sock_path):
    sock_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock_path))  # bound, never listening: its daemon is gone
    reply, _ = serve(sock_path, lambda: exchange(sock_path, GOOD))
    assert reply.ok


def test_a_live_daemon_is_not_taken_over(sock_path):
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_hints, sock_path, owner_uid=OWNER,
                                        on_order=print, on_end=print))
            with pytest.raises(HintsServerError, match="another daemon already serves"):
                await serve_hints(sock_path, owner_uid=OWNER, on_order=print, on_end=print)
            assert sock_path.exists(), "the first daemon keeps its socket"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_not_a_socket_or_an_open_directory_is_refused(sock_path):
    sock_path.parent.mkdir(mode=0o700)
    sock_path.write_text("not a socket")
    with pytest.raises(HintsServerError, match="exists and is not a socket"):
        trio.run(partial(serve_hints, sock_path, owner_uid=OWNER, on_order=print,
                         on_end=print))
    sock_path.unlink()
    sock_path.parent.chmod(0o777)
    with pytest.raises(HintsServerError, match="can be written by other users"):
        trio.run(partial(serve_hints, sock_path, owner_uid=OWNER, on_order=print,
                         on_end=print))


# --- Who may connect -------------------------------------------------------------------

PEER = """
import os, socket, sys
path, uid, gid, groups, frame = sys.argv[1:]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(int(gid))
os.setuid(int(uid))
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect(path)
except PermissionError:
    sys.exit("EACCES")
try:
    sock.sendall(bytes.fromhex(frame))
except BrokenPipeError:
    pass  # refused at once: the reply is already waiting
data = b""
# Exactly one frame: a refused peer's unread request makes the next recv() a reset.
while len(data) < 12 or len(data) < 12 + int.from_bytes(data[8:12], "big"):
    chunk = sock.recv(65536)
    if not chunk:
        break
    data += chunk
print(data.hex())
"""


def as_user(path: Path, uid: int, gid: int, groups: tuple[int, ...] = ()) -> Reply | str:
    """Send GOOD from a child process running as uid/gid: its reply, or "EACCES" if
    the file modes kept it from connecting at all."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PEER, str(path), str(uid), str(gid),
         ",".join(map(str, groups)), GOOD.hex()],
        capture_output=True, text=True, timeout=30, cwd="/",
    )
    if result.stderr.strip() == "EACCES":
        return "EACCES"
    assert result.returncode == 0, result.stderr
    reply = decode(bytes.fromhex(result.stdout.strip()))
    assert isinstance(reply, Reply)
    return reply


def widen(path: Path) -> Callable[[], None]:
    """Open the file modes to everyone, so only the credential check stands between
    a peer and the daemon."""
    def open_up() -> None:
        path.parent.chmod(0o755)
        path.chmod(0o666)
    return open_up


@root_only
def test_root_and_the_owner_are_served_and_others_refused(sock_path, caplog):
    def client() -> dict[str, Reply | str]:
        return {
            "root": exchange(sock_path, GOOD),
            "owner": as_user(sock_path, OWNER, OWNER),
            "nobody": as_user(sock_path, NOBODY, NOBODY),
            "nobody again": as_user(sock_path, NOBODY, NOBODY),
        }

    with caplog.at_level(logging.WARNING, logger="bucketfs.hints_server"):
        replies, daemon = serve(sock_path, client, after_start=widen(sock_path))
    assert replies["root"].ok and replies["owner"].ok
    assert replies["nobody"] == Reply(False, "permission denied: uid 65534 is not the "
                                      "mount owner")
    assert len(daemon.orders) == 2
    assert sum("uid 65534" in r.getMessage() for r in caplog.records) == 1


@root_only
def test_the_file_modes_keep_other_users_out_first(sock_path):
    reply, daemon = serve(sock_path, lambda: as_user(sock_path, NOBODY, NOBODY))
    assert reply == "EACCES" and not daemon.orders


@root_only
@pytest.mark.parametrize("groups_from", ["SO_PEERGROUPS", "/proc/PID/status"])
def test_members_of_the_allowed_group_are_served(sock_path, monkeypatch, groups_from):
    if groups_from != "SO_PEERGROUPS":
        monkeypatch.setattr(hints_server, "_SO_PEERGROUPS", -1)  # an invalid option

    def client() -> dict[str, Reply | str]:
        info = os.stat(sock_path)
        assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o660, GROUP)
        directory = os.stat(sock_path.parent)
        assert (stat.S_IMODE(directory.st_mode), directory.st_gid) == (0o750, GROUP)
        return {
            "supplementary": as_user(sock_path, NOBODY, NOBODY, (GROUP,)),
            "primary": as_user(sock_path, NOBODY, GROUP),
            "outsider": as_user(sock_path, NOBODY, NOBODY, (1, 2)),
        }

    replies, daemon = serve(sock_path, client, allowed_gid=GROUP)
    assert replies["supplementary"] == Reply(True) and replies["primary"] == Reply(True)
    assert replies["outsider"] == "EACCES"
    assert len(daemon.orders) == 2


@root_only
def test_an_outsider_is_refused_by_credentials_even_with_open_modes(sock_path):
    reply, _ = serve(sock_path, lambda: as_user(sock_path, NOBODY, NOBODY, (1, 2)),
                     allowed_gid=GROUP, after_start=widen(sock_path))
    assert reply == Reply(False, f"permission denied: uid {NOBODY} is not the mount owner "
                          f"nor in group {GROUP}")
