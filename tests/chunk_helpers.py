"""What the SSD tier's chunk tests share (test_chunks.py, test_chunk_packing.py,
test_write_through_chunks.py and the mounts that look at a tier's files): a tier opened
on a directory, blocks to put in it, and what its files look like."""

from __future__ import annotations

import random
from pathlib import Path

from rocksdict import Options, Rdict

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.schema import STATE_KEY
from bucketfs.prefetch.eviction import make_policy

KiB, MiB = 1024, 1024**2
NS = "mem://bucket"
LAYOUT_A, LAYOUT_B = b"layout-a", b"layout-b"


def files(count: int, seed: int = 0, size: int = 100 * KiB) -> dict[BlockId, bytes]:
    rng = random.Random(seed)
    return {BlockId(f"img/{seed}-{i:04d}.jpg", "v1", 0, size=size + 17 * i):
            rng.randbytes(size + 17 * i) for i in range(count)}


def open_tier(directory: Path, capacity: int = 64 * MiB, policy: str = "cost-lrfu") -> DiskTier:
    return DiskTier(directory, capacity, make_policy(policy), source=NS, block_size=MiB)


def as_if_crashed(directory: Path) -> None:
    """Make the last run look like one that did not close cleanly (kill -9)."""
    index = Rdict(str(directory / "index"), Options(raw_mode=True))
    index.delete(STATE_KEY)
    index.close()


def chunk_files(directory: Path) -> list[Path]:
    return sorted((directory / "chunks").glob("*.chk"))


def block_files(directory: Path) -> list[Path]:
    return sorted((directory / "data").rglob("*.blk"))


def cache_files(directory: Path) -> list[Path]:
    """The block files and chunk files of an SSD tier."""
    return sorted([*block_files(directory), *chunk_files(directory)])


def forget_reads(disk: DiskTier) -> None:
    """Close the open chunk files and forget the passes: the next read goes to disk."""
    disk.chunks._files.close()
    for chunk in range(disk.chunks.next_id):
        disk.chunks._passes.forget(chunk)


def pack(disk: DiskTier, blocks: dict[BlockId, bytes], layout: bytes = LAYOUT_A) -> bool:
    return disk.write_chunk([(b, d, 0.01) for b, d in blocks.items()], layout)


def totals(disk: DiskTier) -> tuple[int, int, int, int]:
    return disk.used, disk.chunks.count, disk.chunks.data_bytes, disk.chunks.live_bytes


def allocated(path: Path) -> int:
    """Bytes of disk a file takes (holes take none)."""
    return path.stat().st_blocks * 512
