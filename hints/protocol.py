"""The hints wire protocol, shared by the client and the daemon (docs/HINTS.md).

A frame is a 12-byte header, then the body:

    magic b"BFSH" | version u8 | kind u8 | flags u16 | body length u32   (big-endian)

A reader learns the body length from the header and can refuse an oversize frame
before reading its body (`parse_header`). Flags are 0 but for an ORDER's
FLAG_NEXT_EPOCH or FLAG_NEXT_FOLLOWS (not both); any other bit is refused. Bodies:

    ORDER  rank u32 | world_size u32 | epoch u32 | count u32 | job_len u16 | job | paths
           paths: `count` mount-relative UTF-8 paths joined by NUL (NUL cannot occur in
           a path), in the order they will be read; with FLAG_NEXT_EPOCH, the order of
           the job's next epoch, announced ahead (advice for laying out the cache);
           with FLAG_NEXT_FOLLOWS, an epoch's order whose next epoch's will follow
    END    job_len u16 | job
    REPLY  status u8 (0 ok, 1 error) | reason (UTF-8, one line)
    STATUS        (empty): what is the mount doing? Answered by a STATUS_REPLY
    STATUS_REPLY  a JSON object, UTF-8, in its one canonical form (sorted keys, no
                  spaces, ASCII escapes, no NaN or infinities)
    WARM          count u32 | paths (as in ORDER, at least one): fetch these files
                  into the cache. Answered by a WARM_REPLY
    WARM_REPLY    id u32 (1 or more): the warm job started for that WARM
    CANCEL        id u32: stop that warm job (what it cached stays). Answered by a REPLY

Any request may be answered by an error REPLY instead (a refusal). Kinds 4-8 came
after 1-3 without changing them, so a client of 1-3 speaks to any daemon; a daemon
older than a kind refuses it as "unknown message kind N".

Decoding validates everything and raises ProtocolError with a one-line message.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

MAGIC = b"BFSH"
VERSION = 1
HEADER = struct.Struct(">4sBBHI")
HEADER_SIZE = HEADER.size

#: A million paths of ~100 bytes fit with room to spare.
MAX_BODY_BYTES = 256 << 20
MAX_PATHS = 1 << 22
MAX_PATH_BYTES = 4096
MAX_JOB_BYTES = 256
MAX_REASON_BYTES = 1024
MAX_WORLD_SIZE = 1 << 20
MAX_EPOCH = (1 << 32) - 1
#: A status report: a few KiB in practice (the last warm jobs are capped daemon-side).
MAX_STATUS_BYTES = 1 << 20
MAX_WARM_ID = (1 << 32) - 1

_ORDER = struct.Struct(">IIIIH")
_COUNT = struct.Struct(">I")
_ID = struct.Struct(">I")

#: ORDER flag: these paths are the job's next epoch, sent while it reads the current
#: one, so the daemon can lay out what it reads now in the order it will read next.
FLAG_NEXT_EPOCH = 0x0001
#: ORDER flag: the next epoch's order will follow this one shortly, so the daemon waits
#: for it rather than laying out the first reads in read order.
FLAG_NEXT_FOLLOWS = 0x0002
_JOB_LEN = struct.Struct(">H")


class ProtocolError(ValueError):
    """A frame that breaks the protocol; the message is one line, safe to log or reply."""


class Kind(enum.IntEnum):
    ORDER = 1
    END = 2
    REPLY = 3
    STATUS = 4
    STATUS_REPLY = 5
    WARM = 6
    WARM_REPLY = 7
    CANCEL = 8


#: Per-kind body limits, so a tiny END or REPLY cannot announce 256 MiB.
MAX_BODY = {
    Kind.ORDER: MAX_BODY_BYTES,
    Kind.END: _JOB_LEN.size + MAX_JOB_BYTES,
    Kind.REPLY: 1 + MAX_REASON_BYTES,
    Kind.STATUS: 0,
    Kind.STATUS_REPLY: MAX_STATUS_BYTES,
    Kind.WARM: MAX_BODY_BYTES,
    Kind.WARM_REPLY: _ID.size,
    Kind.CANCEL: _ID.size,
}
#: The flag bits each kind may carry: only an ORDER has any.
FLAGS = {kind: 0 for kind in Kind} | {Kind.ORDER: FLAG_NEXT_EPOCH | FLAG_NEXT_FOLLOWS}


class Header(NamedTuple):
    kind: Kind
    length: int
    flags: int


@dataclass(frozen=True, slots=True)
class Order:
    """This rank of `job` will read `paths` (relative to the mount root) in this order
    during `epoch`. With `next_epoch`, `epoch` is the one after the job's current order:
    advice for laying out the cache, not a plan to prefetch now. With `next_follows`
    (an epoch's own order), the job will announce its next epoch's order shortly."""

    job: str
    rank: int
    world_size: int
    epoch: int
    paths: Sequence[str]
    next_epoch: bool = False
    next_follows: bool = False


@dataclass(frozen=True, slots=True)
class End:
    """`job` is done with this mount: the daemon may forget its plan."""

    job: str


@dataclass(frozen=True, slots=True)
class Reply:
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """What is the mount doing? (`bucketfs status`; the daemon answers a StatusReport)."""


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The daemon's live view of its mount: a JSON object (docs/HINTS.md)."""

    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Warm:
    """Fetch these files (relative to the mount root) into the cache, in this order."""

    paths: Sequence[str]


@dataclass(frozen=True, slots=True)
class WarmStarted:
    """The id of the warm job a Warm started (STATUS reports its progress)."""

    id: int


@dataclass(frozen=True, slots=True)
class CancelWarm:
    """Stop warm job `id`; what it cached stays cached."""

    id: int


Message = Order | End | Reply | StatusQuery | StatusReport | Warm | WarmStarted | CancelWarm

_KINDS: dict[type, Kind] = {
    Order: Kind.ORDER, End: Kind.END, Reply: Kind.REPLY, StatusQuery: Kind.STATUS,
    StatusReport: Kind.STATUS_REPLY, Warm: Kind.WARM, WarmStarted: Kind.WARM_REPLY,
    CancelWarm: Kind.CANCEL,
}
#: What only the daemon sends.
REPLIES = (Reply, StatusReport, WarmStarted)


def kind_of(message: Message) -> Kind:
    return _KINDS[type(message)]


def error_reply(reason: str) -> Reply:
    """An error reply with `reason` made into one line of bounded size."""
    line = " ".join(reason.split())
    while len(line.encode("utf-8", "replace")) > MAX_REASON_BYTES:
        line = line[: len(line) * 3 // 4]
    return Reply(False, line)


# --- Encoding --------------------------------------------------------------------


def encode(message: Message) -> bytes:
    """The frame for `message`; raises ProtocolError if it would not decode."""
    if isinstance(message, Order):
        _check_order_fields(message.rank, message.world_size, message.epoch)
        if len(message.paths) > MAX_PATHS:
            raise ProtocolError(f"{len(message.paths)} paths in one order (limit {MAX_PATHS})")
        job = _encode_job(message.job)
        fixed = _ORDER.pack(message.rank, message.world_size, message.epoch,
                            len(message.paths), len(job))
        flags = (FLAG_NEXT_EPOCH if message.next_epoch else 0) \
            | (FLAG_NEXT_FOLLOWS if message.next_follows else 0)
        _check_flags(Kind.ORDER, flags)
        return _frame(Kind.ORDER, fixed + job + _encode_paths(message.paths), flags)
    if isinstance(message, End):
        job = _encode_job(message.job)
        return _frame(Kind.END, _JOB_LEN.pack(len(job)) + job)
    if isinstance(message, StatusQuery):
        return _frame(Kind.STATUS, b"")
    if isinstance(message, StatusReport):
        if not isinstance(message.data, dict):
            raise ProtocolError("a status report is a JSON object")
        try:
            text = _canonical_json(message.data)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"a status report is not JSON: {exc}") from None
        return _frame(Kind.STATUS_REPLY, text.encode("ascii"))
    if isinstance(message, Warm):
        if not message.paths:
            raise ProtocolError("a WARM names no path")
        if len(message.paths) > MAX_PATHS:
            raise ProtocolError(f"{len(message.paths)} paths in one WARM (limit {MAX_PATHS})")
        return _frame(Kind.WARM, _COUNT.pack(len(message.paths))
                      + _encode_paths(message.paths))
    if isinstance(message, WarmStarted | CancelWarm):
        _check_warm_id(message.id)
        return _frame(kind_of(message), _ID.pack(message.id))
    if "\n" in message.reason:
        raise ProtocolError("a reply's reason must be one line")
    reason = message.reason.encode("utf-8", "replace")
    return _frame(Kind.REPLY, bytes([0 if message.ok else 1]) + reason)


def _frame(kind: Kind, body: bytes, flags: int = 0) -> bytes:
    if len(body) > MAX_BODY[kind]:
        raise ProtocolError(f"{kind.name} body of {len(body)} bytes is over the limit "
                            f"({MAX_BODY[kind]})")
    return HEADER.pack(MAGIC, VERSION, kind, flags, len(body)) + body


def _encode_job(job: str) -> bytes:
    _check_job(job)
    return job.encode("utf-8")


def _canonical_json(data: object) -> str:
    # One text per value, so a report decodes and encodes back to the same bytes.
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def _encode_paths(paths: Sequence[str]) -> bytes:
    if not paths:
        return b""
    text = "\0".join(paths)
    if text.count("\0") != len(paths) - 1:
        raise ProtocolError("a path contains NUL")
    try:
        blob = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        index = text.count("\0", 0, exc.start)
        raise ProtocolError(f"path {index} is not valid UTF-8") from None
    _check_paths(text, paths)
    return blob


# --- Decoding --------------------------------------------------------------------


def parse_header(header: bytes) -> Header:
    """(kind, body length, flags) from a frame's first HEADER_SIZE bytes. Refuses a
    frame whose body would exceed the limit for its kind, or that carries a flag its
    kind does not know, before anyone reads its body."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"truncated header ({len(header)} of {HEADER_SIZE} bytes)")
    magic, version, number, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not a bucketfs hints frame")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this end speaks "
                            f"{VERSION})")
    try:
        kind = Kind(number)
    except ValueError:
        raise ProtocolError(f"unknown message kind {number}") from None
    _check_flags(kind, flags)
    if length > MAX_BODY[kind]:
        raise ProtocolError(f"{kind.name} body of {length} bytes is over the limit "
                            f"({MAX_BODY[kind]})")
    return Header(kind, length, flags)


def decode_body(kind: Kind, body: bytes | bytearray, flags: int = 0) -> Message:
    """The message in `body`; `flags` from its header (`parse_header`)."""
    _check_flags(kind, flags)
    # A memoryview, so that slicing a 100 MB body does not copy it.
    view = memoryview(body)
    if kind is Kind.ORDER:
        return _decode_order(view, flags)
    if kind is Kind.END:
        job, rest = _decode_job(view)
        if rest:
            raise ProtocolError(f"{len(rest)} trailing bytes after an END")
        return End(job)
    if kind is Kind.STATUS:
        if view:
            raise ProtocolError(f"{len(view)} bytes in a STATUS body (it has none)")
        return StatusQuery()
    if kind is Kind.STATUS_REPLY:
        return StatusReport(_decode_status(view))
    if kind is Kind.WARM:
        return _decode_warm(view)
    if kind in (Kind.WARM_REPLY, Kind.CANCEL):
        if len(view) != _ID.size:
            raise ProtocolError(f"a {kind.name} body is {_ID.size} bytes, not {len(view)}")
        (number,) = _ID.unpack(view)
        _check_warm_id(number)
        return WarmStarted(number) if kind is Kind.WARM_REPLY else CancelWarm(number)
    if not view or view[0] not in (0, 1):
        raise ProtocolError("a reply's status must be 0 or 1")
    reason = _utf8(view[1:], "a reply's reason")
    if "\n" in reason:
        raise ProtocolError("a reply's reason must be one line")
    return Reply(view[0] == 0, reason)


def decode(frame: bytes) -> Message:
    """One whole frame (header and body) to its message."""
    kind, length, flags = parse_header(frame[:HEADER_SIZE])
    body = frame[HEADER_SIZE:]
    if len(body) != length:
        raise ProtocolError(f"body of {len(body)} bytes, header says {length}")
    return decode_body(kind, body, flags)


def _decode_order(view: memoryview, flags: int) -> Order:
    next_epoch, next_follows = bool(flags & FLAG_NEXT_EPOCH), bool(flags & FLAG_NEXT_FOLLOWS)
    if len(view) < _ORDER.size:
        raise ProtocolError(f"ORDER body of {len(view)} bytes is too short")
    rank, world_size, epoch, count, _ = _ORDER.unpack_from(view)
    _check_order_fields(rank, world_size, epoch)
    if count > MAX_PATHS:
        raise ProtocolError(f"{count} paths in one order (limit {MAX_PATHS})")
    job, blob = _decode_job(view[_ORDER.size - _JOB_LEN.size:])
    if count == 0:
        if blob:
            raise ProtocolError("an ORDER of 0 paths carries path bytes")
        return Order(job, rank, world_size, epoch, [], next_epoch, next_follows)
    text = _utf8(blob, "a path")
    found = text.count("\0") + 1
    if found != count:
        raise ProtocolError(f"ORDER says {count} paths but holds {found}")
    paths = text.split("\0")
    _check_paths(text, paths)
    return Order(job, rank, world_size, epoch, paths, next_epoch, next_follows)


def _decode_status(view: memoryview) -> dict[str, Any]:
    text = _utf8(view, "a status report")

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise ProtocolError("a status report is nested too deeply") from None
    except ValueError as exc:  # also an integer of more digits than Python converts
        raise ProtocolError(f"a status report is not JSON: {str(exc).splitlines()[0]}") \
            from None
    if not isinstance(data, dict):
        raise ProtocolError("a status report must be a JSON object")
    try:
        canonical = _canonical_json(data) == text
    except (ValueError, RecursionError):  # 1e400 reads as inf, which JSON cannot hold
        canonical = False
    if not canonical:
        raise ProtocolError("a status report is not in canonical JSON form")
    return data


def _decode_warm(view: memoryview) -> Warm:
    if len(view) < _COUNT.size:
        raise ProtocolError(f"WARM body of {len(view)} bytes is too short")
    (count,) = _COUNT.unpack_from(view)
    if count == 0:
        raise ProtocolError("a WARM names no path")
    if count > MAX_PATHS:
        raise ProtocolError(f"{count} paths in one WARM (limit {MAX_PATHS})")
    text = _utf8(view[_COUNT.size:], "a path")
    found = text.count("\0") + 1
    if found != count:
        raise ProtocolError(f"WARM says {count} paths but holds {found}")
    paths = text.split("\0")
    _check_paths(text, paths)
    return Warm(paths)


def _decode_job(view: memoryview) -> tuple[str, memoryview]:
    if len(view) < _JOB_LEN.size:
        raise ProtocolError("missing job id")
    (length,) = _JOB_LEN.unpack_from(view)
    raw = view[_JOB_LEN.size:_JOB_LEN.size + length]
    if len(raw) != length:
        raise ProtocolError("truncated job id")
    job = _utf8(raw, "the job id")
    _check_job(job)
    return job, view[_JOB_LEN.size + length:]


def _utf8(raw: memoryview, what: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not valid UTF-8") from None


# --- Validation (shared by both directions) ---------------------------------------


def _check_flags(kind: Kind, flags: int) -> None:
    if flags & ~FLAGS[kind]:
        raise ProtocolError(f"unknown flags {flags:#x} for {kind.name}")
    if flags & FLAG_NEXT_EPOCH and flags & FLAG_NEXT_FOLLOWS:
        raise ProtocolError("an order of the next epoch announces no other (flags "
                            f"{flags:#x})")


def _check_warm_id(number: int) -> None:
    if not 0 < number <= MAX_WARM_ID:
        raise ProtocolError(f"warm job id {number} out of range 1..{MAX_WARM_ID}")


def _check_job(job: str) -> None:
    # isprintable() is False for surrogates, so a printable job always encodes.
    if not job.isprintable() or not 0 < len(job.encode("utf-8")) <= MAX_JOB_BYTES:
        raise ProtocolError(f"a job id must be 1 to {MAX_JOB_BYTES} bytes of printable "
                            "UTF-8")


def _check_order_fields(rank: int, world_size: int, epoch: int) -> None:
    if not 0 < world_size <= MAX_WORLD_SIZE:
        raise ProtocolError(f"world size {world_size} out of range 1..{MAX_WORLD_SIZE}")
    if not 0 <= rank < world_size:
        raise ProtocolError(f"rank {rank} out of range for world size {world_size}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ProtocolError(f"epoch {epoch} out of range 0..{MAX_EPOCH}")


def _path_problem(path: str) -> str | None:
    """What makes `path` unusable as a mount-relative file path, if anything."""
    if not path:
        return "is empty"
    if path.startswith("/"):
        return "is absolute"
    segments = path.split("/")
    if segments[-1] == "":
        return "ends with '/'"
    for segment in ("", "..", "."):
        if segment in segments:
            return f"has {'an empty' if not segment else repr(segment)} segment"
    return None


# Inside the NUL-joined text, a bad path shows as one of these substrings, so a million
# paths are checked by a few C-speed searches, not a Python loop; the first and last
# paths, whose outer edge has no NUL, are checked one by one.
_BAD = ["\0\0", "\0/", "//", "/\0"] + [
    f"{left}{segment}{right}" for segment in ("..", ".") for left in "\0/" for right in "\0/"
]


def _check_paths(text: str, paths: Sequence[str]) -> None:
    """`text` is `paths` joined by NUL."""
    for index in (0, len(paths) - 1):
        if problem := _path_problem(paths[index]):
            raise ProtocolError(f"path {index} {problem}")
    # Most datasets have no segment starting with '.': then 4 searches instead of 12.
    dotted = "/." in text or "\0." in text
    for pattern in _BAD if dotted else _BAD[:4]:
        at = text.find(pattern)
        if at >= 0:
            index = text.count("\0", 0, at + 1)
            raise ProtocolError(f"path {index} {_path_problem(paths[index])}")
    # UTF-8 takes at most 4 bytes a character: only long paths need encoding to measure.
    if max(map(len, paths)) > MAX_PATH_BYTES // 4:
        for index, path in enumerate(paths):
            if len(path) > MAX_PATH_BYTES // 4 and len(path.encode("utf-8")) > MAX_PATH_BYTES:
                raise ProtocolError(f"path {index} is longer than {MAX_PATH_BYTES} bytes")
