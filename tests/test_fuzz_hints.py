"""Hostile hints: garbage frames raise only ProtocolError with one line, every frame that
decodes is exactly what its message encodes to, valid messages round-trip, and the
daemon's socket answers garbage with the one error reply the protocol predicts (or just
closes, for a client that sent nothing) and goes on serving the next client. The control
kinds (STATUS, WARM, CANCEL and their replies) are fuzzed alongside hints."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from bucketfs.hints.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_EPOCH,
    MAX_JOB_BYTES,
    MAX_PATH_BYTES,
    MAX_PATHS,
    MAX_REASON_BYTES,
    MAX_STATUS_BYTES,
    MAX_WARM_ID,
    MAX_WORLD_SIZE,
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
    error_reply,
    parse_header,
)
from tests.fuzzing import fuzz, one_line
from tests.test_hints_server import STATUS, WARM_ID, Daemon, daemon_thread

ORDER_FIXED = struct.Struct(">IIIIH")
U32 = (1 << 32) - 1

# --- Strategies --------------------------------------------------------------------------

# Path segments that are fine, and ones that make a path invalid.
good_segment = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=12)
    .filter(lambda s: s not in (".", "..")),
    st.sampled_from(["a", "train", "é", "中文", "x y", "a\nb", "\t", "\x7f", "...", ".hidden",
                     "..a", "\u2028", "%2F", "\\", "😀"]),
)
good_path = st.one_of(
    st.lists(good_segment, min_size=1, max_size=6).map("/".join),
    st.integers(1, MAX_PATH_BYTES // 2).map(lambda n: "a/" * (n - 1) + "b"),  # deep
    st.integers(1, MAX_PATH_BYTES).map(lambda n: "x" * n),  # long
    st.integers(1, MAX_PATH_BYTES // 4).map(lambda n: "😀" * n),  # 4 bytes a character
)
bad_path = st.one_of(
    st.sampled_from(["", "/", "/a", "a/", "a//b", ".", "..", "a/./b", "a/..", "./a", "../a",
                     "x" * (MAX_PATH_BYTES + 1), "😀" * (MAX_PATH_BYTES // 4 + 1)]),
    st.lists(good_segment | st.sampled_from(["", ".", ".."]), min_size=1, max_size=5)
    .map("/".join),
)
# Printable: letters, digits, punctuation, symbols and the ASCII space (other spaces are not).
good_job = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S"),
                                 include_characters=" "), min_size=1, max_size=MAX_JOB_BYTES // 4)
orders = st.builds(
    lambda world, rank, epoch, job, paths, flag: Order(
        job, rank % world, world, epoch, paths, next_epoch=flag == 1, next_follows=flag == 2),
    st.integers(1, MAX_WORLD_SIZE), st.integers(0, MAX_WORLD_SIZE), st.integers(0, MAX_EPOCH),
    good_job, st.lists(good_path, max_size=8), st.sampled_from([0, 1, 2]))
replies = st.builds(Reply, st.booleans(), st.text(st.characters(
    codec="utf-8", exclude_characters="\n"), max_size=MAX_REASON_BYTES // 4))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=12)
reports = st.dictionaries(st.text(max_size=8), json_values, max_size=5).map(StatusReport)
warm_ids = st.integers(1, MAX_WARM_ID)
controls = st.one_of(st.just(StatusQuery()), reports,
                     st.lists(good_path, min_size=1, max_size=6).map(Warm),
                     warm_ids.map(WarmStarted), warm_ids.map(CancelWarm))
messages = st.one_of(orders, good_job.map(End), replies, controls)


@st.composite
def order_bodies(draw: st.DrawFn) -> bytes:
    """An ORDER body from fields each of which may lie: counts, lengths, UTF-8, NUL."""
    paths = draw(st.lists(good_path | bad_path, max_size=6))
    blob = b"\0".join(p.encode("utf-8", "surrogatepass") for p in paths)
    if draw(st.booleans()):
        blob = draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\0", b"\0\0"])) + blob
    job = draw(st.one_of(good_job.map(str.encode), st.binary(max_size=300),
                         st.sampled_from([b"", b"a\0b", b"a\tb", b"\xff", b"x" * 257])))
    count = draw(st.one_of(st.just(len(paths)), st.just(blob.count(b"\0") + 1),
                           st.integers(0, 4), st.sampled_from([MAX_PATHS, MAX_PATHS + 1, U32])))
    job_len = draw(st.one_of(st.just(len(job)), st.integers(0, 0xFFFF)))
    world = draw(st.one_of(st.integers(1, 8), st.sampled_from([0, MAX_WORLD_SIZE,
                                                               MAX_WORLD_SIZE + 1, U32])))
    rank = draw(st.one_of(st.integers(0, 8), st.just(U32)))
    epoch = draw(st.one_of(st.integers(0, 5), st.just(U32)))
    return ORDER_FIXED.pack(rank, world, epoch, count, job_len) + job + blob


def frame(kind: int, body: bytes, flags: int = 0, length: int | None = None) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, len(body) if length is None else length) \
        + body


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid frame with bytes flipped, cut or added."""
    data = bytearray(encode(draw(messages)))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["flip", "cut", "add"]))
        if action == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[draw(st.integers(0, len(data))):]
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@st.composite
def warm_bodies(draw: st.DrawFn) -> bytes:
    """A WARM body whose count and paths may lie."""
    paths = draw(st.lists(good_path | bad_path, max_size=5))
    blob = b"\0".join(p.encode("utf-8", "surrogatepass") for p in paths)
    count = draw(st.one_of(st.just(len(paths)), st.integers(0, 4),
                           st.sampled_from([MAX_PATHS + 1, U32])))
    return struct.pack(">I", count) + blob


# JSON texts a status reply may carry, canonical or not, and some that are not JSON.
status_bodies = st.one_of(
    reports.map(lambda r: encode(r)[HEADER_SIZE:]),
    st.sampled_from([b"{}", b"{ }", b'{"b":1,"a":2}', b"[]", b"1", b'"x"', b"{\"a\":NaN}",
                     b'{"a":1e400}', b'{"a":1.0e0}', b'{"a":"\xc3\xa9"}', b"[" * 5000,
                     b'{"a":' + b"9" * 5000 + b"}", b"\xff", b"", b'{"a":1}x']),
    st.binary(max_size=40))

# Kinds and flags near the valid ones, and anything else.
kinds = st.sampled_from(list(Kind)) | st.integers(0, 255)
flags = st.sampled_from([0, 1, 2, 3, 4, 0x8000]) | st.integers(0, 0xFFFF)
frames = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=64).map(lambda b: MAGIC + b),
    st.binary(max_size=64).map(lambda b: MAGIC + bytes([VERSION]) + b),
    st.builds(frame, kinds, st.binary(max_size=64), flags),
    st.builds(frame, kinds, st.binary(max_size=64), flags, st.integers(0, U32)),
    st.builds(frame, st.just(Kind.ORDER), order_bodies(), flags),
    st.builds(frame, st.just(Kind.END), st.binary(max_size=40).map(
        lambda j: struct.pack(">H", len(j)) + j)),
    st.builds(frame, st.just(Kind.REPLY), st.binary(max_size=40)),
    st.builds(frame, st.just(Kind.WARM), warm_bodies()),
    st.builds(frame, st.just(Kind.STATUS_REPLY), status_bodies),
    st.builds(frame, st.sampled_from([Kind.WARM_REPLY, Kind.CANCEL]),
              st.binary(min_size=0, max_size=6)),
    mutated(),
)

# --- Independent checks of what a decoded message may hold -------------------------------


def valid_path(path: str) -> bool:
    return (bool(path) and not path.startswith("/") and "\0" not in path
            and all(s not in ("", ".", "..") for s in path.split("/"))
            and len(path.encode()) <= MAX_PATH_BYTES)


def assert_valid(message: Message) -> None:
    if isinstance(message, Order | End):
        assert message.job.isprintable() and 0 < len(message.job.encode()) <= MAX_JOB_BYTES
    if isinstance(message, Order):
        assert 0 <= message.rank < message.world_size <= MAX_WORLD_SIZE
        assert 0 <= message.epoch <= MAX_EPOCH and len(message.paths) <= MAX_PATHS
        assert not (message.next_epoch and message.next_follows)
        bad = [p for p in message.paths if not valid_path(p)]
        assert not bad, bad[:3]
    if isinstance(message, Reply):
        assert "\n" not in message.reason
    if isinstance(message, Warm):
        assert 0 < len(message.paths) <= MAX_PATHS
        bad = [p for p in message.paths if not valid_path(p)]
        assert not bad, bad[:3]
    if isinstance(message, WarmStarted | CancelWarm):
        assert 0 < message.id <= MAX_WARM_ID
    if isinstance(message, StatusReport):
        assert isinstance(message.data, dict)


def decoded(data: bytes) -> Message | ProtocolError:
    try:
        message = decode(data)
    except ProtocolError as exc:
        assert one_line(str(exc)), str(exc)
        return exc
    assert_valid(message)
    assert encode(message) == data  # one encoding per message: nothing was lost or added
    return message


def same(a: Message, b: Message) -> bool:
    if isinstance(a, Order) and isinstance(b, Order):
        return a == Order(b.job, b.rank, b.world_size, b.epoch, list(b.paths),
                          b.next_epoch, b.next_follows)
    if isinstance(a, Warm) and isinstance(b, Warm):
        return list(a.paths) == list(b.paths)
    return a == b


# --- The protocol ------------------------------------------------------------------------


@fuzz(2000)
@given(data=frames)
def test_garbage_frames_raise_one_line_protocol_errors(data):
    result = decoded(data)
    event(type(result).__name__)


@fuzz(400)
@given(header=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE)
       | st.builds(lambda k, f, n: HEADER.pack(MAGIC, VERSION, k, f, n), kinds, flags,
                   st.integers(0, U32)))
def test_a_header_is_refused_or_within_its_kinds_limits(header):
    try:
        kind, length, flag_bits = parse_header(header)
    except ProtocolError as exc:
        assert one_line(str(exc))
        return
    assert header[:5] == MAGIC + bytes([VERSION]) and kind in Kind
    assert length <= {Kind.ORDER: 256 << 20, Kind.END: 2 + MAX_JOB_BYTES,
                      Kind.REPLY: 1 + MAX_REASON_BYTES, Kind.STATUS: 0,
                      Kind.STATUS_REPLY: MAX_STATUS_BYTES, Kind.WARM: 256 << 20,
                      Kind.WARM_REPLY: 4, Kind.CANCEL: 4}[kind]
    assert flag_bits in ((0, 1, 2) if kind is Kind.ORDER else (0,))
    for cut in range(HEADER_SIZE):
        with pytest.raises(ProtocolError, match="truncated header"):
            parse_header(header[:cut])


@fuzz(300)
@given(message=messages)
def test_valid_messages_round_trip_exactly(message):
    data = encode(message)
    assert same(decode(data), message)
    kind, length, flag_bits = parse_header(data[:HEADER_SIZE])
    assert len(data) == HEADER_SIZE + length
    assert same(decode_body(kind, data[HEADER_SIZE:], flag_bits), message)
    # Any frame cut short, or carrying more, is refused.
    for cut in sorted({0, 1, HEADER_SIZE - 1, HEADER_SIZE, len(data) - 1} - {len(data)}):
        with pytest.raises(ProtocolError):
            decode(data[:max(0, cut)])
    with pytest.raises(ProtocolError, match="header says"):
        decode(data + b"\0")


maybe = st.none().map(lambda _: KEEP)
KEEP = object()


@fuzz(500)
@given(base=orders,
       job=maybe | st.text(max_size=300) | st.sampled_from(["", "a\0b", "a\nb", "\udcff",
                                                            "x" * 257]),
       rank=maybe | st.integers(-1, 3) | st.integers(-(2**40), 2**40),
       world=maybe | st.integers(-1, 4) | st.sampled_from([MAX_WORLD_SIZE + 1, 2**40]),
       epoch=maybe | st.sampled_from([-1, MAX_EPOCH + 1, -(2**40)]),
       path=maybe | bad_path | st.text(max_size=10) | st.sampled_from(["a\0b", "\udcff"]),
       flag=st.sampled_from([0, 1, 2, 3]))
def test_encoding_refuses_bad_fields_with_one_line(base, job, rank, world, epoch, path, flag):
    """A valid order with some fields made hostile: refused in one line, or (when what
    was drawn happens to be valid) encoded into a frame that decodes to it."""
    changes = {"job": job, "rank": rank, "world_size": world, "epoch": epoch,
               "next_epoch": bool(flag & 1), "next_follows": bool(flag & 2)}
    if path is not KEEP:
        changes["paths"] = [*base.paths, path]
    message = dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not KEEP})
    try:
        data = encode(message)
    except ProtocolError as exc:
        assert one_line(str(exc)), str(exc)
        event("refused")
        return
    event("encoded")
    assert same(decode(data), message)  # what encodes is valid: it decodes to itself


@fuzz(300)
@given(reason=st.text(st.characters(codec=None, categories=None), max_size=3000))
def test_an_error_reply_is_one_bounded_line(reason):
    reply = error_reply(reason)
    assert not reply.ok and (reply.reason == "" or one_line(reply.reason))
    assert len(reply.reason.encode("utf-8", "replace")) <= MAX_REASON_BYTES
    back = decode(encode(reply))
    assert back == Reply(False, reply.reason.encode("utf-8", "replace").decode())


def test_huge_counts_are_refused_without_a_huge_allocation():
    body = ORDER_FIXED.pack(0, 1, 0, U32, 1) + b"j" + b"\0" * 1000
    with pytest.raises(ProtocolError, match=f"{U32} paths in one order"):
        decode(frame(Kind.ORDER, body))
    body = ORDER_FIXED.pack(0, 1, 0, MAX_PATHS, 1) + b"j" + b"\0" * 1000
    with pytest.raises(ProtocolError, match=f"says {MAX_PATHS} paths but holds 1001"):
        decode(frame(Kind.ORDER, body))


# --- The daemon's socket ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hints_daemon() -> Iterator[tuple[Path, Daemon]]:
    top = Path(tempfile.mkdtemp(prefix="bfz-"))  # short: sun_path holds 108 bytes
    path = top / "state" / "hints.sock"
    try:
        with daemon_thread(path, read_timeout=5.0) as daemon:
            yield path, daemon
    finally:
        shutil.rmtree(top, ignore_errors=True)


def expected(data: bytes) -> tuple[Reply | None, Message | None]:
    """What the server must answer, from the protocol alone (None: it just closes), and
    the message it hands the daemon, if any."""
    if not data:
        return None, None
    if len(data) < HEADER_SIZE:
        return error_reply(f"truncated header: {len(data)} of {HEADER_SIZE} bytes"), None
    try:
        kind, length, flag_bits = parse_header(data[:HEADER_SIZE])
        body = data[HEADER_SIZE:HEADER_SIZE + length]
        if len(body) < length:
            return error_reply(f"truncated body: {len(body)} of {length} bytes"), None
        message = decode_body(kind, body, flag_bits)
    except ProtocolError as exc:
        return error_reply(str(exc)), None
    if isinstance(message, Reply | StatusReport | WarmStarted):
        return error_reply(f"a client may not send a {kind.name}"), None
    if isinstance(message, StatusQuery):
        return StatusReport(STATUS), message
    if isinstance(message, Warm):
        return WarmStarted(WARM_ID), message
    return Reply(True), message


def send(path: Path, data: bytes) -> bytes:
    """Send `data`, then read one frame back (b"" if the server just closed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(15)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        received = b""
        # Exactly one frame: reading past it can meet a reset for the unread request.
        while len(received) < HEADER_SIZE or len(received) < HEADER_SIZE + int.from_bytes(
                received[8:12], "big"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


GOOD = Order("fuzz-good", 0, 1, 0, ["train/a.jpg"])


@fuzz(300)
@given(data=frames)
def test_the_server_answers_garbage_as_predicted_and_serves_the_next_client(hints_daemon, data):
    path, daemon = hints_daemon
    orders, ends = len(daemon.orders), len(daemon.ends)
    warms, cancels = len(daemon.warms), len(daemon.cancels)
    reply, message = expected(data)
    received = send(path, data)
    if reply is None:
        assert received == b"", "a client that sent nothing gets no reply"
        event("closed")
    else:
        got = decode(received)
        assert got == reply
        if isinstance(got, Reply):
            assert got.ok or one_line(got.reason)
            event("ok" if got.ok else "error reply")
        else:
            event(type(got).__name__)
    # The daemon heard of exactly the message the frame holds, and of nothing else.
    assert daemon.orders[orders:] == ([message] if isinstance(message, Order) else [])
    assert daemon.ends[ends:] == ([message.job] if isinstance(message, End) else [])
    assert daemon.warms[warms:] == ([list(message.paths)] if isinstance(message, Warm)
                                    else [])
    assert daemon.cancels[cancels:] == ([message.id] if isinstance(message, CancelWarm)
                                        else [])
    # And the next client is served as if nothing happened.
    assert decode(send(path, encode(GOOD))) == Reply(True)
    assert daemon.orders[-1] == GOOD
