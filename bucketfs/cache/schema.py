"""The cache's RocksDB index: every key, every record and the format version, here only.

One index per cache directory holds the SSD tier's entries and chunks, their eviction
order, the directory listings of every mount that used it, and a few totals. Keys start
with one byte saying what they are:

| key | value | owner |
| --- | --- | --- |
| `C:format` | the format version (`FORMAT`) | disk.py |
| `C:policy` | the eviction policy the ranks were computed by | disk.py |
| `C:state` | `TierState`, saved at a clean close, deleted at open | disk.py |
| `C:chunks` | `ChunkTotals`, saved and deleted with `C:state` | chunks.py |
| `C:counters` | JSON of hit and miss counters summed over mounts | admin.py |
| `E` + entry name | `BlockRecord` (block file) or `Packed` (chunk member) | disk.py, chunks.py |
| `K` + chunk id (8 bytes) | `ChunkRecord`: sizes, cost, eviction state, member table | chunks.py |
| `R` + rank + entry or chunk name | empty: the eviction order, lowest first | ranking.py |
| `T` + miss clock + clock + name | empty: cost-lrfu's recency order | ranking.py |
| `N` + space + parent inode + name | `DirEntry`: one directory entry of a listing | listings.py |
| `I` + space + inode | the inode's entry, with its parent inode and name | listings.py |
| `S` + space + inode | when the directory was listed (wall-clock seconds) | listings.py |
| `M` + space + `next` / `bytes` / `files` / `stamp` | the tree's counters | listings.py |

An entry name says what shaped its bytes: origin (scheme, endpoint, bucket), key,
version, object size and the byte span it holds (`entry_name`); a space names an origin
and a mounted prefix. A chunk's name in the eviction order is `\\0chunk\\0` + its id,
which no entry name (origin first) can be.

Format versions: 2 kept the eviction order as keys, 3 added chunk files, 4 named
entries by origin, size and span (older entries do not say which block size cut them,
so a cache of formats 1 to 3 is started afresh) and listings by origin, 5 keeps a
whole entry in an inode's record (format 4 kept its parent and name: a second read;
listings.upgrade_inode_records rewrites them in place). A build refuses
a cache of a format newer than its own. Decoders raise ValueError or struct.error on
anything this code did not write; callers treat that as a miss.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from bucketfs.cache.blocks import BlockId, block_span

FORMAT_KEY = b"C:format"
FORMAT = b"5"
#: Upgraded in place: only its inode records differ (listings.upgrade_inode_records).
INODE_LOCATIONS_FORMAT = b"4"
#: Formats whose caches are started afresh rather than refused.
OLDER_FORMATS = (b"1", b"2", b"3")
POLICY_KEY = b"C:policy"
STATE_KEY = b"C:state"
CHUNK_TOTALS_KEY = b"C:chunks"
COUNTERS_KEY = b"C:counters"

ENTRY = b"E"
CHUNK = b"K"
RANK = b"R"
RECENCY = b"T"
TREE_ENTRY = b"N"
TREE_INODE = b"I"
TREE_LISTED = b"S"
TREE_META = b"M"

# --- entry names -----------------------------------------------------------------------


def entry_name(source: str, block: BlockId, block_size: int) -> bytes:
    """The name of the cache entry holding `block` (cut with `block_size`) of an object
    of the origin `source`: unique across origins, versions and spans."""
    start, end = block_span(block.size, block_size, block.index)
    text = f"{source}\0{block.key}\0{block.version}\0{block.size}\0{start}\0{end - start}"
    return text.encode("utf-8", "surrogateescape")


def entry_key_prefix(source: str, key: str) -> bytes:
    """What the names of every entry of `key` (any version, any span) start with."""
    return f"{source}\0{key}\0".encode("utf-8", "surrogateescape")


def entry_block(name: bytes, source: str, block_size: int) -> BlockId | None:
    """The block of this origin that the entry `name` holds when objects are cut with
    `block_size`; None if it is another origin's, or its span is not one of this
    block size's blocks (a mount with another block size wrote it)."""
    text = name.decode("utf-8", "surrogateescape")
    prefix = source + "\0"
    if not text.startswith(prefix):
        return None
    try:
        key, version, size, start, length = text[len(prefix):].rsplit("\0", 4)
        size_, start_, length_ = int(size), int(start), int(length)
    except ValueError:
        return None
    index, offset = divmod(start_, block_size)
    if offset or block_span(size_, block_size, index) != (start_, start_ + length_):
        return None
    return BlockId(key, version, index, size=size_)


def entry_length(name: bytes) -> int | None:
    """The number of bytes the entry `name` holds, as its name says."""
    try:
        return int(name.rsplit(b"\0", 1)[1])
    except (IndexError, ValueError):
        return None


# --- an entry's record: a block file, or a member of a chunk ---------------------------

_BLOCK = struct.Struct("<QId")  # data length, crc32, cost; then the eviction state
_PACKED = struct.Struct("<cQQQId8s")  # b"P", chunk, offset, length, crc32, cost, layout
LAYOUT_BYTES = 8
#: The layout tag of a chunk the write-through made of blocks as they were fetched (a
#: packer's tags are 8 bytes of a BLAKE2b digest of an order): no order laid it out.
WRITE_THROUGH = b"\0" * LAYOUT_BYTES
# A block record is 20 + 8k bytes and a packed one 45: the two kinds never clash, and a
# lookup stays one point read.
assert _PACKED.size % 8 != _BLOCK.size % 8


class BlockRecord(NamedTuple):
    """A block file's entry: its length, CRC32, refetch cost and eviction state."""

    length: int
    crc: int
    cost: float
    state: tuple[float, ...]


def encode_block(record: BlockRecord) -> bytes:
    return (_BLOCK.pack(record.length, record.crc, record.cost)
            + struct.pack(f"<{len(record.state)}d", *record.state))


def with_block_state(value: bytes, state: tuple[float, ...]) -> bytes:
    """The block record `value` with its eviction state replaced (the state is its
    tail), without decoding the rest."""
    return value[:_BLOCK.size] + struct.pack(f"<{len(state)}d", *state)


def decode_block(value: bytes) -> BlockRecord:
    length, crc, cost = _BLOCK.unpack_from(value)
    rest = value[_BLOCK.size:]
    if len(rest) % 8:
        raise ValueError("not a block record")
    return BlockRecord(length, crc, cost, struct.unpack(f"<{len(rest) // 8}d", rest))


class Packed(NamedTuple):
    """Where a packed entry's bytes are: its chunk, offset, length, CRC32, refetch cost
    and the layout tag of its chunk."""

    chunk: int
    offset: int
    length: int
    crc: int
    cost: float
    layout: bytes


def is_packed(value: bytes) -> bool:
    return len(value) == _PACKED.size and value[:1] == b"P"


def encode_packed(p: Packed) -> bytes:
    return _PACKED.pack(b"P", p.chunk, p.offset, p.length, p.crc, p.cost, p.layout)


def decode_packed(value: bytes) -> Packed | None:
    """The packed record in `value`, or None if it is a block-file record."""
    if not is_packed(value):
        return None
    return Packed(*_PACKED.unpack(value)[1:])


# --- chunks ------------------------------------------------------------------------------

_CHUNK_RECORD = struct.Struct("<QqdIH")  # data bytes, live bytes, cost, members, state len
_MEMBER = struct.Struct("<QQIdH")  # offset, length, crc32, cost, entry length
_CHUNK_RANK_NAME = b"\0chunk\0"


class Member(NamedTuple):
    entry: bytes
    offset: int
    length: int
    crc: int
    cost: float


@dataclass(slots=True)
class ChunkRecord:
    size: int
    live: int
    cost: float
    state: tuple[float, ...]
    members: list[Member]


def chunk_key(chunk: int) -> bytes:
    return CHUNK + chunk.to_bytes(8, "big")


def chunk_of_key(key: bytes) -> int:
    return int.from_bytes(key[len(CHUNK):], "big")


def chunk_rank_name(chunk: int) -> bytes:
    """The chunk's name in the eviction order."""
    return _CHUNK_RANK_NAME + chunk.to_bytes(8, "big")


def chunk_of_rank_name(name: bytes) -> int | None:
    if not name.startswith(_CHUNK_RANK_NAME):
        return None
    return int.from_bytes(name[len(_CHUNK_RANK_NAME):], "big")


def encode_chunk(record: ChunkRecord) -> bytes:
    parts = [_CHUNK_RECORD.pack(record.size, record.live, record.cost, len(record.members),
                                len(record.state)),
             struct.pack(f"<{len(record.state)}d", *record.state)]
    for m in record.members:
        parts.append(_MEMBER.pack(m.offset, m.length, m.crc, m.cost, len(m.entry)))
        parts.append(m.entry)
    return b"".join(parts)


class ChunkHead(NamedTuple):
    """A chunk record's fixed part: what a hit needs, without its member table."""

    size: int
    cost: float
    state: tuple[float, ...]


def decode_chunk_head(value: bytes) -> ChunkHead:
    """The head of a chunk record (ValueError or struct.error if it is cut short). A hit
    reads only this; the member table is decoded only to read on past the member."""
    size, _, cost, _, state_len = _CHUNK_RECORD.unpack_from(value)
    return ChunkHead(size, cost, struct.unpack_from(f"<{state_len}d", value,
                                                    _CHUNK_RECORD.size))


def with_chunk_state(value: bytes, state: tuple[float, ...]) -> bytes | None:
    """The chunk record `value` with its policy state replaced (the member table copied
    as bytes); None if the new state has another length (a full re-encode is needed)."""
    state_len = _CHUNK_RECORD.unpack_from(value)[4]
    if len(state) != state_len:
        return None
    at = _CHUNK_RECORD.size
    return b"".join((value[:at], struct.pack(f"<{state_len}d", *state),
                     value[at + 8 * state_len:]))


def decode_chunk(value: bytes) -> ChunkRecord:
    size, live, cost, count, state_len = _CHUNK_RECORD.unpack_from(value)
    at = _CHUNK_RECORD.size
    state = struct.unpack_from(f"<{state_len}d", value, at)
    at += 8 * state_len
    members = []
    for _ in range(count):
        offset, length, crc, member_cost, entry_len = _MEMBER.unpack_from(value, at)
        at += _MEMBER.size
        entry = value[at:at + entry_len]
        if len(entry) != entry_len:
            raise ValueError("truncated chunk record")
        at += entry_len
        members.append(Member(entry, offset, length, crc, member_cost))
    if at != len(value):
        raise ValueError("trailing bytes in a chunk record")
    return ChunkRecord(size, live, cost, state, members)


# --- totals saved at a clean close -------------------------------------------------------

_STATE = struct.Struct("<qqqqq")
_CHUNK_TOTALS = struct.Struct("<qqq")


class TierState(NamedTuple):
    """The SSD tier's totals (`C:state`): the policy's clocks, bytes used, gap totals."""

    clock: int
    misses: int
    used: int
    gap_sum: int
    gap_count: int


def encode_state(state: TierState) -> bytes:
    return _STATE.pack(*state)


def decode_state(value: bytes) -> TierState:
    """Raises ValueError for totals saved in another layout (they are recounted)."""
    if len(value) != _STATE.size:
        raise ValueError("tier totals of another layout")
    return TierState(*_STATE.unpack(value))


class ChunkTotals(NamedTuple):
    count: int
    data_bytes: int
    live_bytes: int


def encode_chunk_totals(totals: ChunkTotals) -> bytes:
    return _CHUNK_TOTALS.pack(*totals)


def decode_chunk_totals(value: bytes) -> ChunkTotals:
    return ChunkTotals(*_CHUNK_TOTALS.unpack(value))


def encode_counters(counters: dict[str, int]) -> bytes:
    return json.dumps(counters, sort_keys=True).encode()


def decode_counters(value: bytes | None) -> dict[str, int]:
    """Counters saved over mounts; {} if none were, or they are unreadable."""
    if value is None:
        return {}
    try:
        totals = json.loads(value)
    except ValueError:
        return {}
    if not isinstance(totals, dict):
        return {}
    return {k: v for k, v in totals.items() if isinstance(v, int) and not isinstance(v, bool)}


# --- the eviction order ------------------------------------------------------------------

_ALL_ONES = (1 << 64) - 1


def ordered(value: float) -> bytes:
    """8 bytes that sort, as bytes, like the float (IEEE 754 with the sign bit flipped,
    or every bit flipped for negative numbers)."""
    bits = struct.unpack(">Q", struct.pack(">d", value))[0]
    bits = bits ^ _ALL_ONES if bits >> 63 else bits | (1 << 63)
    return bits.to_bytes(8, "big")


def rank_key(rank: tuple[float, ...], name: bytes) -> bytes:
    return RANK + b"".join(ordered(x) for x in rank) + name


def rank_key_name(key: bytes, rank_width: int) -> bytes:
    """The entry or chunk name a rank key orders (`rank_width` bytes of rank)."""
    return key[len(RANK) + rank_width:]


RECENCY_WIDTH = 16


def recency_key(last_miss: int, last: int, name: bytes) -> bytes:
    return (RECENCY + max(last_miss, 0).to_bytes(8, "big") + max(last, 0).to_bytes(8, "big")
            + name)


def recency_key_miss(key: bytes) -> int:
    """The miss clock a recency key was written at."""
    return int.from_bytes(key[len(RECENCY):len(RECENCY) + 8], "big")


def recency_key_name(key: bytes) -> bytes:
    return key[len(RECENCY) + RECENCY_WIDTH:]


# --- directory listings ------------------------------------------------------------------

_U64 = struct.Struct(">Q")
_DIR_ENTRY = struct.Struct("<QBQqQ")  # inode, is_dir, size, mtime_ns, listing stamp
_TEXT_LENGTH = struct.Struct("<I")  # before each text of an entry (`_text`)
_INODE_RECORD = struct.Struct("<QBQq")  # parent inode, is_dir, size, mtime_ns


@dataclass(slots=True)
class DirEntry:
    """One directory entry: as the bucket listed it (before it has an inode), as the
    index stores it, and as the tree hands it out (with its parent and name)."""

    name: str
    is_dir: bool
    #: The object key for a file; the prefix (ending in "/", or "" at the bucket root)
    #: for a directory.
    key: str
    size: int = 0
    mtime_ns: int = 0
    version: str = ""
    inode: int = 0
    parent: int = 0
    #: The listing that wrote it (TreeIndex.finish drops entries of older listings).
    stamp: int = field(default=0, compare=False)

    def same_object(self, other: DirEntry) -> bool:
        """Whether `other` names the same directory, or the same version of the file: an
        inode stands for one version, so the kernel never mixes two in its page cache."""
        return self.is_dir == other.is_dir and (self.is_dir or self.version == other.version)


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogateescape")
    return _TEXT_LENGTH.pack(len(raw)) + raw


def encode_dir_entry(entry: DirEntry) -> bytes:
    """The stored form: its name and parent are in its key."""
    return (_DIR_ENTRY.pack(entry.inode, entry.is_dir, entry.size, entry.mtime_ns,
                            entry.stamp) + _text(entry.key) + _text(entry.version))


def decode_dir_entry(raw: bytes, parent: int, name: str) -> DirEntry:
    # Unrolled (key, then version): every lookup and every listed entry decodes one.
    inode, is_dir, size, mtime_ns, stamp = _DIR_ENTRY.unpack_from(raw)
    (length,) = _TEXT_LENGTH.unpack_from(raw, _DIR_ENTRY.size)
    key_end = _DIR_ENTRY.size + 4 + length
    key = raw[_DIR_ENTRY.size + 4:key_end].decode("utf-8", "surrogateescape")
    (length,) = _TEXT_LENGTH.unpack_from(raw, key_end)
    version = raw[key_end + 4:key_end + 4 + length].decode("utf-8", "surrogateescape")
    return DirEntry(name, bool(is_dir), key, size, mtime_ns, version, inode, parent, stamp)


def tree_space(source: str, prefix: str) -> bytes:
    """What a mount's tree keys are under: its origin and mounted prefix."""
    return f"{source}\0{prefix}".encode("utf-8", "surrogateescape") + b"\0"


def tree_dir_prefix(space: bytes, parent: int) -> bytes:
    return TREE_ENTRY + space + _U64.pack(parent)


def tree_entry_key(space: bytes, parent: int, name: str) -> bytes:
    return tree_dir_prefix(space, parent) + name.encode("utf-8", "surrogateescape")


def tree_inode_key(space: bytes, inode: int) -> bytes:
    return TREE_INODE + space + _U64.pack(inode)


def encode_inode_record(entry: DirEntry) -> bytes:
    """An inode's record: its entry as the listing holds it, less the listing's stamp,
    with its parent and name (the `N` record's key)."""
    return (_INODE_RECORD.pack(entry.parent, entry.is_dir, entry.size, entry.mtime_ns)
            + _text(entry.name) + _text(entry.key) + _text(entry.version))


def decode_inode_record(raw: bytes, inode: int) -> DirEntry:
    parent, is_dir, size, mtime_ns = _INODE_RECORD.unpack_from(raw)
    texts = []
    at = _INODE_RECORD.size
    for _ in range(3):  # name, key, version
        (length,) = _TEXT_LENGTH.unpack_from(raw, at)
        end = at + 4 + length
        if end > len(raw):
            raise ValueError("an inode record cut short")
        texts.append(raw[at + 4:end].decode("utf-8", "surrogateescape"))
        at = end
    name, key, version = texts
    return DirEntry(name, bool(is_dir), key, size, mtime_ns, version, inode, parent)


def format4_entry_key(inode_key: bytes, location: bytes) -> bytes:
    """The `N` key of the entry a format-4 inode record (parent inode, then the name's
    bytes) names: the same space, then the record's bytes as they are."""
    return TREE_ENTRY + inode_key[len(TREE_INODE):-_U64.size] + location


def decode_format4_location(raw: bytes) -> tuple[int, str]:
    return _U64.unpack_from(raw)[0], raw[_U64.size:].decode("utf-8", "surrogateescape")


def inode_of_key(inode_key: bytes) -> int:
    return _U64.unpack_from(inode_key, len(inode_key) - _U64.size)[0]


def tree_listed_key(space: bytes, inode: int) -> bytes:
    return TREE_LISTED + space + _U64.pack(inode)


def encode_listed_at(seconds: float) -> bytes:
    return struct.pack("<d", seconds)


def decode_listed_at(raw: bytes) -> float:
    return struct.unpack("<d", raw)[0]


def tree_meta_key(space: bytes, name: bytes) -> bytes:
    return TREE_META + space + name


def encode_counter(value: int) -> bytes:
    return _U64.pack(max(value, 0))


def decode_counter(raw: bytes | None) -> int:
    return _U64.unpack(raw)[0] if raw else 0


def next_prefix(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (for range deletes)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])
