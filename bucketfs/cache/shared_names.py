"""How blocks are named and described in the shared tier, and how a read is checked.

A shared block is named by everything that makes its bytes what they are: the origin
(bucket URL and endpoint), the object's key and version (ETag), the block size and the
block's index. Those go through SHA-256 into the object's name, so no two datasets,
prefixes or block sizes can collide, and a name says nothing of the key (a shared
bucket may be listable by more people than the origin):

    <shared prefix>bucketfs-v1/<dataset>/blocks/<block digest>
    <shared prefix>bucketfs-v1/<dataset>/dataset.json   what the dataset is, for people

`<dataset>` is a digest of the origin, the mount's prefix and the block size: the unit
`bucketfs cache shared-list` and `shared-clear` work on.

The object's metadata repeats the identity in clear (key, version, block size and
index, the origin) with the block's length and SHA-256. A read compares every field
with what the reader expects and the body with its length and digest; anything that
does not match is a miss, never data. The digest catches corruption and torn writes,
not forgery: whoever can write to the shared bucket is trusted as much as whoever can
write to the origin.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from bucketfs.cache.blocks import BlockId

FORMAT = "1"
ROOT = "bucketfs-v1/"
DESCRIPTOR = "dataset.json"
#: The folder, in a dataset's folder, that holds its blocks.
BLOCKS = "blocks/"
#: S3 allows 2 KiB of user metadata per object; a key too long to repeat in clear is
#: still covered by the identity digest (`bucketfs-id`).
_METADATA_BUDGET = 1800

#: The metadata field holding the block's id, which is also its name in the folder.
BLOCK_ID = "bucketfs-id"
_KEY = "bucketfs-key"
_DIGEST = "bucketfs-sha256"
_LENGTH = "bucketfs-length"


def _digest(*parts: str) -> str:
    # Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    text = "".join(f"{len(part)}:{part}" for part in parts)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _clear(value: str) -> str:
    """A metadata value: HTTP headers carry visible ASCII only."""
    return quote(value, safe="/:@", errors="surrogatepass")


# A mount has one dataset: its digest and its origin's metadata value are computed once,
# not per block.
@functools.lru_cache(maxsize=16)
def _folder(source: str, prefix: str, block_size: int) -> str:
    return _digest(FORMAT, source, prefix, str(block_size))[:32]


@functools.lru_cache(maxsize=16)
def _clear_source(source: str) -> str:
    return _clear(source)


@dataclass(frozen=True, slots=True)
class Dataset:
    """What a mount's blocks are cut from: one origin, one prefix, one block size."""

    #: The origin as the cache names it (bucket URL and endpoint: `origin_identity`).
    source: str
    #: The mount's URL as the user gave it (without credentials).
    url: str
    prefix: str
    block_size: int

    @property
    def folder(self) -> str:
        return _folder(self.source, self.prefix, self.block_size)

    def descriptor(self) -> bytes:
        return json.dumps({"format": int(FORMAT), "url": self.url, "source": self.source,
                           "prefix": self.prefix, "block_size": self.block_size},
                          sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class SharedNames:
    """Names under one shared prefix ("" or ending in "/")."""

    prefix: str

    @property
    def root(self) -> str:
        return self.prefix + ROOT

    def folder(self, dataset: Dataset) -> str:
        return self.folder_of(dataset.folder)

    def folder_of(self, folder_id: str) -> str:
        """A dataset's folder by its id (what `bucketfs cache shared-list` shows)."""
        return f"{self.root}{folder_id}/"

    def blocks(self, dataset: Dataset) -> str:
        return self.folder(dataset) + BLOCKS

    def descriptor(self, dataset: Dataset) -> str:
        return self.folder(dataset) + DESCRIPTOR

    def block(self, dataset: Dataset, block: BlockId) -> str:
        return self.blocks(dataset) + block_id(dataset, block)


def block_id(dataset: Dataset, block: BlockId) -> str:
    return _digest(FORMAT, dataset.source, block.key, block.version,
                   str(dataset.block_size), str(block.index))


def identity(dataset: Dataset, block: BlockId) -> dict[str, str]:
    """The metadata a block of this identity must carry, its body's aside."""
    fields = {"bucketfs-format": FORMAT, "bucketfs-source": _clear_source(dataset.source)}
    key = _clear(block.key)
    if len(key) + len(fields["bucketfs-source"]) <= _METADATA_BUDGET:
        fields[_KEY] = key
    # The fields people read come first, so a mismatch is told by the one that differs;
    # the digest of them all comes last.
    return fields | {
        "bucketfs-version": _clear(block.version),
        "bucketfs-block-size": str(dataset.block_size),
        "bucketfs-block": str(block.index),
        BLOCK_ID: block_id(dataset, block),
    }


def describe(dataset: Dataset, block: BlockId, data: Any) -> dict[str, str]:
    """The metadata written with a block (its identity, its length and SHA-256)."""
    return identity(dataset, block) | {_LENGTH: str(len(data)),
                                       _DIGEST: hashlib.sha256(data).hexdigest()}


def mismatch(expected: Mapping[str, str], metadata: Mapping[str, str], data: Any,
             length: int) -> str | None:
    """Why an object read from the shared tier is not the block expected (its identity
    from `identity`, `length` bytes), or None if it is."""
    for name, value in expected.items():
        found = metadata.get(name)
        if found != value:
            what = name.removeprefix("bucketfs-")
            if found is None:
                return f"no {what} in its metadata"
            shown = unquote(found)[:80] if name in (_KEY, "bucketfs-source") else found[:80]
            return f"its {what} is {shown!r}"
    if metadata.get(_LENGTH) != str(length) or len(data) != length:
        return f"{len(data)} bytes where {length} were expected"
    if metadata.get(_DIGEST) != hashlib.sha256(data).hexdigest():
        return "its bytes do not match their SHA-256"
    return None
