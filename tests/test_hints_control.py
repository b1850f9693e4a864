"""The control kinds of the hints protocol (STATUS, WARM, CANCEL and their replies): round
trips, refusals, the old kinds' encoding left as it was, the server handing them to
their handlers (and refusing them when a handler is missing or the peer is someone
else), and the client functions `bucketfs status` and `bucketfs warm` use."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketfs.hints import control
from bucketfs.hints.client import HintError, Target
from bucketfs.hints.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_STATUS_BYTES,
    VERSION,
    CancelWarm,
    End,
    Kind,
    Message,
    Order,
    ProtocolError,
    Reply,
    StatusQuery,
    StatusReport,
    Warm,
    WarmStarted,
    decode,
    decode_body,
    encode,
    parse_header,
)
from bucketfs.hints_server import HINTS_OFF
from tests.test_hints_client import mounts  # noqa: F401 (a fixture)
from tests.test_hints_server import (
    NOBODY,
    OWNER,
    STATUS,
    WARM_ID,
    daemon_thread,
    root_only,
    serve,
    widen,
)


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # Short, so it fits in sun_path (108 bytes); pytest's tmp_path can be too long.
    top = Path(tempfile.mkdtemp(prefix="bfc-"))
    top.chmod(0o711)  # other users may pass through to the state directory
    yield top / "state" / "hints.sock"
    shutil.rmtree(top, ignore_errors=True)


def frame(kind: int, body: bytes, flags: int = 0, length: int | None = None) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, len(body) if length is None else length) \
        + body


# --- The protocol ------------------------------------------------------------------------


@pytest.mark.parametrize("message", [
    StatusQuery(),
    StatusReport({}),
    StatusReport({"mount": {"url": "s3://b/p", "pid": 7}, "ratio": 0.25, "none": None,
                  "unicode": "ünï ✓", "list": [1, -2.5, True, "x"]}),
    Warm(["a.jpg"]),
    Warm(["train/cat/1.jpg", "train/dog/2 with space.jpg", "ünï/cødé.png"]),
    WarmStarted(1),
    WarmStarted((1 << 32) - 1),
    CancelWarm(42),
])
def test_control_messages_round_trip(message):
    data = encode(message)
    _, length, flags = parse_header(data[:HEADER_SIZE])
    assert flags == 0 and len(data) == HEADER_SIZE + length
    decoded = decode(data)
    if isinstance(message, Warm):
        assert list(decoded.paths) == list(message.paths)
    else:
        assert decoded == message
    assert encode(decoded) == data


def test_a_status_report_is_canonical_json():
    body = encode(StatusReport({"b": 1, "a": {"z": "é", "y": [1.5]}}))[HEADER_SIZE:]
    assert body == b'{"a":{"y":[1.5],"z":"\\u00e9"},"b":1}'
    assert encode(StatusQuery()) == frame(Kind.STATUS, b"")
    assert encode(WarmStarted(5)) == frame(Kind.WARM_REPLY, b"\0\0\0\x05")
    assert encode(Warm(["a", "b/c"])) == frame(Kind.WARM, b"\0\0\0\x02a\0b/c")


def test_the_old_kinds_keep_their_numbers_and_encoding():
    """A client of ORDER, END and REPLY only (an older bucketfs) is unaffected."""
    assert (Kind.ORDER, Kind.END, Kind.REPLY) == (1, 2, 3)
    order = struct.pack(">IIIIH", 1, 2, 3, 2, 3) + b"job" + b"a/b.jpg\0c.jpg"
    assert encode(Order("job", 1, 2, 3, ["a/b.jpg", "c.jpg"])) == frame(1, order)
    assert encode(Order("job", 1, 2, 3, ["a/b.jpg", "c.jpg"], next_epoch=True)) \
        == frame(1, order, flags=1)
    assert encode(End("job")) == frame(2, b"\0\x03job")
    assert encode(Reply(True)) == frame(3, b"\0")
    assert encode(Reply(False, "no")) == frame(3, b"\x01no")


@pytest.mark.parametrize("data, problem", [
    (frame(Kind.STATUS, b"x"), "STATUS body of 1 bytes is over the limit"),
    (frame(Kind.STATUS, b"", flags=1), "unknown flags 0x1 for STATUS"),
    (frame(Kind.WARM, b"", flags=2), "unknown flags 0x2 for WARM"),
    (frame(Kind.STATUS_REPLY, b"", length=MAX_STATUS_BYTES + 1), "over the limit"),
    (frame(Kind.WARM_REPLY, b"", length=5), "WARM_REPLY body of 5 bytes is over the limit"),
    (frame(Kind.CANCEL, b"", length=1 << 20), "CANCEL body"),
    (frame(9, b""), "unknown message kind 9"),
])
def test_bad_control_headers_are_refused_before_the_body(data, problem):
    with pytest.raises(ProtocolError, match=problem):
        parse_header(data[:HEADER_SIZE])


@pytest.mark.parametrize("kind, body, problem", [
    (Kind.STATUS_REPLY, b"[]", "must be a JSON object"),
    (Kind.STATUS_REPLY, b"1", "must be a JSON object"),
    (Kind.STATUS_REPLY, b"", "not JSON"),
    (Kind.STATUS_REPLY, b'{"a":1}x', "not JSON"),
    (Kind.STATUS_REPLY, b'{"a":NaN}', "NaN is not JSON"),
    (Kind.STATUS_REPLY, b'{"a":Infinity}', "Infinity is not JSON"),
    (Kind.STATUS_REPLY, b'{"a":1e400}', "canonical"),
    (Kind.STATUS_REPLY, b'{"b":1,"a":2}', "canonical"),
    (Kind.STATUS_REPLY, b'{ "a":1}', "canonical"),
    (Kind.STATUS_REPLY, '{"a":"é"}'.encode(), "canonical"),
    (Kind.STATUS_REPLY, b'{"a":1.0e0}', "canonical"),
    (Kind.STATUS_REPLY, b"[" * 100_000, "nested too deeply"),
    (Kind.STATUS_REPLY, b'{"a":' + b"9" * 5000 + b"}", "not JSON"),
    (Kind.STATUS_REPLY, b'{"a":"\xff"}', "not valid UTF-8"),
    (Kind.WARM, b"\0\0", "too short"),
    (Kind.WARM, b"\0\0\0\0", "names no path"),
    (Kind.WARM, b"\0\0\0\x03a\0b", "says 3 paths but holds 2"),
    (Kind.WARM, b"\x00\x40\x00\x01a", "paths in one WARM"),
    (Kind.WARM, b"\0\0\0\x02a\0../etc/passwd", "path 1 has '..' segment"),
    (Kind.WARM, b"\0\0\0\x01/etc/passwd", "path 0 is absolute"),
    (Kind.WARM, b"\0\0\0\x01dir/", "path 0 ends with '/'"),
    (Kind.WARM, b"\0\0\0\x01", "path 0 is empty"),
    (Kind.WARM, b"\0\0\0\x01\xc3(", "a path is not valid UTF-8"),
    (Kind.WARM_REPLY, b"\0\0\0\0", "warm job id 0 out of range"),
    (Kind.WARM_REPLY, b"\0\0\x01", "4 bytes, not 3"),
    (Kind.CANCEL, b"\0\0\0\0", "warm job id 0 out of range"),
])
def test_bad_control_bodies(kind, body, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_body(kind, body)


@pytest.mark.parametrize("message, problem", [
    (StatusReport({"x": float("nan")}), "not JSON"),
    (StatusReport({"x": {1, 2}}), "not JSON"),
    (StatusReport({"x": "y" * MAX_STATUS_BYTES}), "over the limit"),
    (StatusReport([1]), "is a JSON object"),  # type: ignore[arg-type]
    (Warm([]), "names no path"),
    (Warm(["a", "../b"]), "path 1 has '..' segment"),
    (Warm(["a\0b"]), "contains NUL"),
    (WarmStarted(0), "out of range"),
    (CancelWarm(1 << 32), "out of range"),
])
def test_encode_refuses_control_messages_that_would_not_decode(message, problem):
    with pytest.raises(ProtocolError, match=problem):
        encode(message)


# --- The server --------------------------------------------------------------------------


def exchange(path, message: Message | bytes, timeout: float = 10.0) -> Message:
    """Send one frame and return the daemon's answer, whatever its kind."""
    data = message if isinstance(message, bytes) else encode(message)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while len(received) < HEADER_SIZE or \
                len(received) < HEADER_SIZE + int.from_bytes(received[8:12], "big"):
            chunk = sock.recv(65536)
            assert chunk, "closed without an answer"
            received += chunk
    return decode(received)


def test_status_warm_and_cancel_reach_their_handlers(sock_path):
    with daemon_thread(sock_path) as daemon:
        assert exchange(sock_path, StatusQuery()) == StatusReport(STATUS)
        assert exchange(sock_path, Warm(["a/1.jpg", "b/2.jpg"])) == WarmStarted(WARM_ID)
        assert exchange(sock_path, CancelWarm(WARM_ID)) == Reply(True)
        # Hints still work beside them.
        assert exchange(sock_path, Order("j", 0, 1, 0, ["a/1.jpg"])) == Reply(True)
    assert daemon.warms == [["a/1.jpg", "b/2.jpg"]] and daemon.cancels == [WARM_ID]
    assert len(daemon.orders) == 1


def test_with_hints_off_orders_are_refused_and_status_answers(sock_path):
    with daemon_thread(sock_path, on_order=None, on_end=None):
        assert exchange(sock_path, Order("j", 0, 1, 0, ["a"])) == Reply(False, HINTS_OFF)
        assert exchange(sock_path, End("j")) == Reply(False, HINTS_OFF)
        assert exchange(sock_path, StatusQuery()) == StatusReport(STATUS)


def test_missing_handlers_and_handler_refusals_are_error_replies(sock_path):
    def refuse(number: int) -> None:
        raise ValueError(f"no warm job {number}")

    with daemon_thread(sock_path, on_status=None, on_warm=None, on_cancel=refuse):
        assert exchange(sock_path, StatusQuery()) == Reply(False, "this daemon serves no status")
        assert exchange(sock_path, Warm(["a"])) == Reply(False, "this daemon does not warm")
        assert exchange(sock_path, CancelWarm(3)) == Reply(False, "no warm job 3")


@pytest.mark.parametrize("message", [StatusReport({"a": 1}), WarmStarted(2)])
def test_a_client_may_not_send_what_only_the_daemon_sends(sock_path, message):
    with daemon_thread(sock_path) as daemon:
        name = "STATUS_REPLY" if isinstance(message, StatusReport) else "WARM_REPLY"
        assert exchange(sock_path, message) == Reply(False, f"a client may not send a {name}")
    assert not daemon.warms


def test_a_report_over_the_bound_is_an_error_reply_not_a_crash(sock_path, caplog):
    with caplog.at_level(logging.ERROR, logger="bucketfs.hints_server"), \
            daemon_thread(sock_path, on_status=lambda: {"x": "y" * MAX_STATUS_BYTES}):
        reply = exchange(sock_path, StatusQuery())
        assert not reply.ok and "internal error in the daemon" in reply.reason
        assert exchange(sock_path, Warm(["a"])) == WarmStarted(WARM_ID)  # still serving
    assert any("cannot send a STATUS_REPLY" in r.getMessage() for r in caplog.records)


PEER = """
import os, socket, sys
path, uid, frame = sys.argv[1:]
os.setgroups([]); os.setgid(int(uid)); os.setuid(int(uid))
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(10)
try:
    sock.connect(path)
except PermissionError:
    sys.exit("EACCES")
try:
    sock.sendall(bytes.fromhex(frame))
except BrokenPipeError:
    pass
data = b""
while len(data) < 12 or len(data) < 12 + int.from_bytes(data[8:12], "big"):
    chunk = sock.recv(65536)
    if not chunk:
        break
    data += chunk
print(data.hex())
"""


def as_nobody(path, message: Message) -> Message | str:
    result = subprocess.run([sys.executable, "-I", "-S", "-c", PEER, str(path), str(NOBODY),
                             encode(message).hex()], capture_output=True, text=True,
                            timeout=30, cwd="/")
    if result.stderr.strip() == "EACCES":
        return "EACCES"
    assert result.returncode == 0, result.stderr
    return decode(bytes.fromhex(result.stdout.strip()))


@root_only
def test_another_user_gets_no_status_and_starts_no_warm(sock_path):
    refused = Reply(False, "permission denied: uid 65534 is not the mount owner")

    def client() -> dict[str, Message | str]:
        return {"status": as_nobody(sock_path, StatusQuery()),
                "warm": as_nobody(sock_path, Warm(["a"])),
                "cancel": as_nobody(sock_path, CancelWarm(1))}

    # The file modes keep it out first; with them opened, its credentials do.
    closed, _ = serve(sock_path, client, on_status=lambda: STATUS,
                           on_warm=lambda paths: 1, on_cancel=print)
    assert set(closed.values()) == {"EACCES"}
    warms: list[object] = []
    opened, _ = serve(sock_path, client, after_start=widen(sock_path),
                      on_status=lambda: STATUS, on_warm=warms.append, on_cancel=warms.append)
    assert opened == {"status": refused, "warm": refused, "cancel": refused}
    assert not warms and OWNER != NOBODY


# --- The client functions ----------------------------------------------------------------


def test_control_functions_talk_to_the_mounts_daemon(mounts):  # noqa: F811
    one, _ = mounts
    target = control.target_of(one / "sub" / "x.jpg")
    assert target == Target(str(one), os.getuid())
    with daemon_thread(control.location.socket_path(str(one))) as daemon:
        assert control.status(target) == STATUS
        assert control.start_warm(target, ["a", "b/c"]) == WARM_ID
        control.cancel_warm(target, WARM_ID)
    assert daemon.warms == [["a", "b/c"]] and daemon.cancels == [WARM_ID]
    with pytest.raises(HintError, match="is not in a bucketfs mount"):
        control.target_of("/")
    with pytest.raises(HintError, match="no hints socket"):
        control.status(target)


def test_control_errors_are_one_line_hint_errors(mounts):  # noqa: F811
    one, _ = mounts
    target = control.target_of(one)

    def older() -> None:
        raise ValueError("unknown message kind 4")  # what a daemon before STATUS says

    def busy(paths: object) -> int:
        raise ValueError("busy")

    with daemon_thread(control.location.socket_path(str(one)), on_status=older,
                       on_warm=busy):
        with pytest.raises(HintError, match="is older than this command and has no status"):
            control.status(target)
        with pytest.raises(HintError, match="refused: busy"):
            control.start_warm(target, ["a"])
        with pytest.raises(HintError, match=re.escape("path 0 has '..' segment")):
            control.start_warm(target, ["../a"])


def test_status_json_keys_are_documented():
    """docs/HINTS.md lists the report's top-level keys."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "HINTS.md").read_text()
    for key in ("schema", "mount", "origin", "cache", "prefetch", "errors", "warm"):
        assert f"`{key}`" in doc, key
