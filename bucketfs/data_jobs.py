"""What a mount's dispatcher and its data processes send each other over a
SOCK_SEQPACKET socket pair, one message per datagram (docs/DATA_PROCESSES.md).

Dispatcher to data process: first a setup (JSON: the bucket's URL, the mount's options,
the process's index and count, its SSD shard), then one job per READ: the request's
`unique`, which version of which object, and the span to read. The data process writes
the reply to /dev/fuse itself; nothing comes back per job.

Data process to dispatcher: notices only, each a kind byte and its text: that it is
ready, its counters, an object that changed in the bucket (the dispatcher looks it up
again), or a log record (the dispatcher logs it, so that a mount keeps one private log).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, TypeVar

#: unique, offset, the object's size, the read's size, the key's and the version's
#: lengths in bytes; the key and the version follow.
_JOB = struct.Struct("<QQQIHH")
#: Where in a job its key's length is (after unique, offset, object size, read size).
_KEY_LENGTH, _KEY_LENGTH_AT = struct.Struct("<H"), struct.calcsize("<QQQI")
#: The largest job: S3 and GCS keys are at most 1,024 bytes, versions (ETags,
#: generations) far shorter.
JOB_MAX = _JOB.size + 2 * 65535
SETUP_MAX = 1 << 20
NOTICE_MAX = 8192

#: Notice kinds.
CHANGED = b"C"  # + the key of an object whose version changed in the bucket
LOG = b"L"  # + "LEVELNO\tmessage"
READY = b"R"  # its data path is built: it serves jobs from now on
COUNTS = b"N"  # + JSON: its counters since it started (`Counts`), sent every second

#: Keys are the bucket's strings; lone surrogates (a key the listing could not decode)
#: go through unchanged.
_ENCODING = ("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Job:
    """One READ for a data process to answer."""

    unique: int
    key: str
    version: str
    object_size: int
    offset: int
    size: int


def pack_job(job: Job) -> bytes:
    key, version = job.key.encode(*_ENCODING), job.version.encode(*_ENCODING)
    return _JOB.pack(job.unique, job.offset, job.object_size, job.size, len(key),
                     len(version)) + key + version


def unpack_job(message: bytes) -> Job:
    unique, offset, object_size, size, key_length, version_length = _JOB.unpack_from(message)
    key_end = _JOB.size + key_length
    if key_end + version_length != len(message):
        raise ValueError(f"a job of {len(message)} bytes, not {key_end + version_length}")
    return Job(unique, message[_JOB.size:key_end].decode(*_ENCODING),
               message[key_end:].decode(*_ENCODING), object_size, offset, size)


def owner_of(key: str, count: int) -> int:
    """The data process that serves `key`: the same for a key whatever the order of
    reads, and again after a remount with as many processes (their SSD shards)."""
    return zlib.crc32(key.encode(*_ENCODING)) % count


def owner_of_job(message: bytes, count: int) -> int:
    """`owner_of` the key in a packed job, from its bytes there (the dispatcher's one
    encoding of the key per read)."""
    key_length = _KEY_LENGTH.unpack_from(message, _KEY_LENGTH_AT)[0]
    return zlib.crc32(memoryview(message)[_JOB.size:_JOB.size + key_length]) % count


@dataclass(frozen=True, slots=True)
class Setup:
    """What a data process needs to build its part of the data path."""

    url: str
    options: dict[str, Any]
    index: int
    count: int
    #: Its own SSD tier's directory, or None (RAM only).
    shard_dir: str | None
    #: The origin's identity, as the mount's SSD tier records it (mount.origin_identity).
    source: str
    #: Bytes its SSD shard may hold (None: its share of the `disk_cache` option).
    disk_budget: int | None = None

    def pack(self) -> bytes:
        message = json.dumps({"url": self.url, "options": self.options, "index": self.index,
                              "count": self.count, "shard_dir": self.shard_dir,
                              "source": self.source,
                              "disk_budget": self.disk_budget}).encode()
        if len(message) > SETUP_MAX:
            raise ValueError(f"a data process's setup of {len(message)} bytes")
        return message

    @classmethod
    def unpack(cls, message: bytes) -> Setup:
        values = json.loads(message)
        return cls(values["url"], values["options"], values["index"], values["count"],
                   values["shard_dir"], values["source"], values.get("disk_budget"))


def notice(kind: bytes, text: str) -> bytes:
    return kind + text.encode(*_ENCODING)[:NOTICE_MAX - 1]


def read_notice(message: bytes) -> tuple[bytes, str]:
    try:
        text = message[1:].decode(*_ENCODING)
    except UnicodeDecodeError:  # a log line cut inside a character
        text = message[1:].decode("utf-8", "replace")
    return message[:1], text


#: A data process's counters: flat names to numbers, each only ever growing while the
#: process lives, so that the dispatcher's sums over processes (and over those that
#: died: `add_counts`) are counters too; but for levels, named from LEVEL (what it
#: holds now: a dead process holds nothing).
Counts = dict[str, int]
LEVEL = "level_"


def add_counts(total: Counts, more: Counts) -> None:
    for name, value in more.items():
        total[name] = total.get(name, 0) + value


T = TypeVar("T")


def merged(own: T, counts: Counts, prefix: str) -> T:
    """`own`, a dataclass of counters (CacheStats, RequestCounts), plus the data
    processes' counters of the same names after `prefix`."""
    return dataclasses.replace(own, **{  # type: ignore[type-var]
        field.name: getattr(own, field.name) + counts.get(prefix + field.name, 0)
        for field in dataclasses.fields(own)})  # type: ignore[arg-type]
