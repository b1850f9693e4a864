"""The hints wire protocol: round trips, and every way a frame can be refused."""

from __future__ import annotations

import io
import struct

import pytest

from bucketfs.hints import protocol
from bucketfs.hints.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_BODY_BYTES,
    MAX_PATH_BYTES,
    VERSION,
    End,
    Kind,
    Order,
    ProtocolError,
    Reply,
    decode,
    decode_body,
    encode,
    error_reply,
    parse_header,
)

ORDER_FIXED = struct.Struct(">IIIIH")


def order_body(*, rank=0, world=1, epoch=0, count=None, job=b"job", paths=b"a/b.jpg",
               job_len=None) -> bytes:
    if count is None:
        count = paths.count(b"\0") + 1 if paths else 0
    fixed = ORDER_FIXED.pack(rank, world, epoch, count, len(job) if job_len is None else job_len)
    return fixed + job + paths


def frame(kind: int, body: bytes, *, magic=MAGIC, version=VERSION, flags=0,
          length=None) -> bytes:
    return HEADER.pack(magic, version, kind, flags, len(body) if length is None else length) + body


# --- Round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("message", [
    Order("host-1-abc", 0, 1, 0, ["a.jpg"]),
    Order("j", 3, 8, 41, ["train/cat/1.jpg", "train/dog/2 with space.jpg", "ünï/cødé.png"]),
    Order("empty shard", 7, 8, 2, []),
    Order("j", 0, 1, protocol.MAX_EPOCH, ["x" * MAX_PATH_BYTES]),
    Order("j", 0, 1, 0, ["a/b\n c%+/d.jpg", "...", "..a", ".hidden/..x"]),
    Order("host-1-abc", 2, 4, 8, ["train/b.jpg", "train/a.jpg"], next_epoch=True),
    Order("empty next shard", 0, 1, 1, [], next_epoch=True),
    Order("host-1-abc", 2, 4, 7, ["train/a.jpg"], next_follows=True),
    End("host-1-abc"),
    Reply(True),
    Reply(False, "permission denied: uid 65534 is not the mount owner"),
])
def test_round_trip(message):
    data = encode(message)
    assert data[:4] == MAGIC and len(data) == HEADER_SIZE + parse_header(data[:HEADER_SIZE])[1]
    decoded = decode(data)
    assert type(decoded) is type(message)
    if isinstance(message, Order):
        assert (decoded.job, decoded.rank, decoded.world_size, decoded.epoch,
                decoded.next_epoch, decoded.next_follows) == (
            message.job, message.rank, message.world_size, message.epoch,
            message.next_epoch, message.next_follows)
        assert list(decoded.paths) == list(message.paths)
    else:
        assert decoded == message


def test_a_million_paths_round_trip():
    paths = [f"train/class{i % 1000:04d}/img_{i:08d}_{'x' * 70}.JPEG" for i in range(1_000_000)]
    data = encode(Order("big", 1, 2, 5, paths))
    assert 100_000_000 < len(data) <= MAX_BODY_BYTES
    decoded = decode(data)
    assert decoded.paths == paths


def test_error_reply_is_one_bounded_line():
    reply = error_reply("first line\nsecond\tline " + "é" * 5000)
    assert "\n" not in reply.reason and not reply.ok
    assert len(reply.reason.encode()) <= protocol.MAX_REASON_BYTES
    assert decode(encode(reply)) == reply


# --- Headers ---------------------------------------------------------------------------


@pytest.mark.parametrize("header, message", [
    (frame(1, b"", magic=b"HTTP"), "bad magic"),
    (frame(1, b"", version=VERSION + 1), "unsupported protocol version 2"),
    (frame(9, b""), "unknown message kind 9"),
    (frame(1, b"", flags=4), "unknown flags 0x4 for ORDER"),
    (frame(1, b"", flags=0x8001), "unknown flags 0x8001 for ORDER"),
    (frame(1, b"", flags=3), "an order of the next epoch announces no other"),
    (frame(2, b"", flags=1), "unknown flags 0x1 for END"),
    (frame(3, b"", flags=1), "unknown flags 0x1 for REPLY"),
    (frame(1, b"", length=MAX_BODY_BYTES + 1), "over the limit"),
    (frame(2, b"", length=10_000), "END body of 10000 bytes is over the limit"),
    (frame(3, b"", length=1 << 20), "REPLY body"),
    (frame(1, b"")[:7], "truncated header"),
])
def test_bad_headers(header, message):
    with pytest.raises(ProtocolError, match=message):
        parse_header(header[:HEADER_SIZE])


def test_an_oversize_frame_is_refused_before_its_body_is_read():
    class NoBody(io.BytesIO):
        def read(self, size=-1):
            assert self.tell() == 0, "the body must not be read"
            return super().read(size)

    stream = NoBody(frame(1, b"", length=0xFFFF_FFFF))
    with pytest.raises(ProtocolError, match="over the limit"):
        parse_header(stream.read(HEADER_SIZE))
    assert stream.tell() == HEADER_SIZE


def test_whole_frame_length_must_match():
    data = encode(End("j"))
    with pytest.raises(ProtocolError, match="header says"):
        decode(data[:-1])
    with pytest.raises(ProtocolError, match="header says"):
        decode(data + b"x")


# --- Bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize("body, message", [
    (b"\0" * 10, "too short"),
    (order_body(world=0), "world size 0 out of range"),
    (order_body(world=protocol.MAX_WORLD_SIZE + 1), "world size .* out of range"),
    (order_body(rank=2, world=2), "rank 2 out of range"),
    (order_body(count=protocol.MAX_PATHS + 1), "paths in one order"),
    (order_body(count=3, paths=b"a\0b"), "says 3 paths but holds 2"),
    (order_body(count=0, paths=b"a"), "0 paths carries path bytes"),
    (order_body(job=b""), "job id must be"),
    (order_body(job=b"a\tb"), "job id must be"),
    (order_body(job=b"x" * 300), "job id must be"),
    (order_body(job=b"\xff\xfe"), "job id is not valid UTF-8"),
    (order_body(job=b"ab", job_len=40), "truncated job id"),
    (order_body(paths=b"ok\0\xc3("), "a path is not valid UTF-8"),
    (order_body(paths=b"ok\0\0c"), "path 1 is empty"),
    (order_body(count=1, paths=b""), "path 0 is empty"),
    (order_body(paths=b"a\0/etc/passwd"), "path 1 is absolute"),
    (order_body(paths=b"/etc/passwd"), "path 0 is absolute"),
    (order_body(paths=b"a\0b\0../../etc/passwd"), "path 2 has '..' segment"),
    (order_body(paths=b"a/../b"), "path 0 has '..' segment"),
    (order_body(paths=b"a\0b/.."), "path 1 has '..' segment"),
    (order_body(paths=b"..\0a"), "path 0 has '..' segment"),
    (order_body(paths=b"a\0./b\0c"), "path 1 has '.' segment"),
    (order_body(paths=b"a\0b//c"), "path 1 has an empty segment"),
    (order_body(paths=b"a\0dir/"), "path 1 ends with '/'"),
    (order_body(paths=b"a\0dir/\0b"), "path 1 ends with '/'"),
    (order_body(paths=b"a\0" + b"x" * (MAX_PATH_BYTES + 1)), "path 1 is longer than 4096"),
    (order_body(paths=b"a\0" + "é".encode() * 2049), "path 1 is longer than 4096"),
])
def test_bad_orders(body, message):
    with pytest.raises(ProtocolError, match=message):
        decode_body(Kind.ORDER, body)


@pytest.mark.parametrize("kind, body, message", [
    (Kind.END, b"", "missing job id"),
    (Kind.END, b"\0\x03jo", "truncated job id"),
    (Kind.END, b"\0\x02jobs", "2 trailing bytes"),
    (Kind.REPLY, b"", "status must be 0 or 1"),
    (Kind.REPLY, b"\x07", "status must be 0 or 1"),
    (Kind.REPLY, b"\x01bad\xffutf8", "reason is not valid UTF-8"),
    (Kind.REPLY, b"\x01two\nlines", "one line"),
])
def test_bad_ends_and_replies(kind, body, message):
    with pytest.raises(ProtocolError, match=message):
        decode_body(kind, body)


@pytest.mark.parametrize("message, problem", [
    (Order("j", 0, 1, 0, ["a\0b"]), "contains NUL"),
    (Order("j", 0, 1, 0, ["ok", "bad\udcff"]), "path 1 is not valid UTF-8"),
    (Order("j", 0, 1, 0, ["../x"]), "path 0 has '..' segment"),
    (Order("j", 1, 1, 0, ["x"]), "rank 1 out of range"),
    (Order("j", 0, 1, -1, ["x"]), "epoch -1 out of range"),
    (Order("j", 0, 1, 1 << 32, ["x"]), "out of range"),
    (Order("", 0, 1, 0, ["x"]), "job id"),
    (Order("j\udcff", 0, 1, 0, ["x"]), "job id"),
    (End("x" * 300), "job id"),
    (Reply(False, "two\nlines"), "one line"),
    (Reply(False, "x" * 2000), "over the limit"),
])
def test_encode_refuses_what_would_not_decode(message, problem):
    with pytest.raises(ProtocolError, match=problem):
        encode(message)


# --- Next-epoch orders ---------------------------------------------------------------


def test_next_epoch_and_next_follows_are_order_flags_0_and_1():
    plain = encode(Order("j", 0, 1, 4, ["a.jpg", "b.jpg"]))
    ahead = encode(Order("j", 0, 1, 4, ["a.jpg", "b.jpg"], next_epoch=True))
    follows = encode(Order("j", 0, 1, 4, ["a.jpg", "b.jpg"], next_follows=True))
    assert ahead[HEADER_SIZE:] == follows[HEADER_SIZE:] == plain[HEADER_SIZE:], "one body"
    assert [parse_header(frame[:HEADER_SIZE]) for frame in (plain, ahead, follows)] == [
        (Kind.ORDER, len(plain) - HEADER_SIZE, flags) for flags in (0, 1, 2)]
    assert [(decode(f).next_epoch, decode(f).next_follows) for f in (plain, ahead, follows)] \
        == [(False, False), (True, False), (False, True)]
    kind, _, flags = parse_header(ahead[:HEADER_SIZE])
    assert decode_body(kind, ahead[HEADER_SIZE:], flags).next_epoch
    with pytest.raises(ProtocolError, match="announces no other"):
        encode(Order("j", 0, 1, 4, ["a.jpg"], next_epoch=True, next_follows=True))


def test_a_next_epoch_order_is_validated_and_bounded_like_an_order():
    body = order_body(paths=b"a\0../etc/passwd")
    with pytest.raises(ProtocolError, match=r"path 1 has '\.\.' segment"):
        decode(frame(Kind.ORDER, body, flags=protocol.FLAG_NEXT_EPOCH))
    with pytest.raises(ProtocolError, match="over the limit"):
        parse_header(frame(Kind.ORDER, b"", flags=protocol.FLAG_NEXT_EPOCH,
                           length=MAX_BODY_BYTES + 1))
    with pytest.raises(ProtocolError, match="rank 1 out of range"):
        encode(Order("j", 1, 1, 0, ["x"], next_epoch=True))
    # decode_body refuses flags the header would have: it is the daemon's other door.
    with pytest.raises(ProtocolError, match="unknown flags 0x1 for END"):
        decode_body(Kind.END, b"\0\x01j", protocol.FLAG_NEXT_EPOCH)
    with pytest.raises(ProtocolError, match="unknown flags 0x4 for ORDER"):
        decode_body(Kind.ORDER, order_body(), 4)
