"""Opening the SSD tier's directory: its private directories, the format check, and
the recount after a crash (disk.py's docstring says when each happens).

A clean close saves the few totals, which the next open reads and deletes; when they
are missing the last run crashed, so the records are scanned once to recount them and
block files no record names (a crash between rename and index) are deleted.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import stat
import struct
from pathlib import Path

from rocksdict import Rdict, WriteBatch

from bucketfs.cache import schema
from bucketfs.cache.chunks import ChunkStore
from bucketfs.cache.listings import upgrade_inode_records
from bucketfs.cache.ranking import IndexRanking
from bucketfs.cache.scans import prefixed
from bucketfs.cache.schema import ENTRY
from bucketfs.prefetch.eviction import RankedPolicy
from bucketfs.private import UnsafePath, openness, private_directory

log = logging.getLogger("bucketfs.cache.disk")


#: errnos that mean "this directory cannot take writes now", not a bug.
STEP_ASIDE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class CacheDirError(Exception):
    """The cache directory cannot be used at all (one line for the user)."""


class CacheDirUnwritable(CacheDirError):
    """The directory cannot take writes (permissions, read-only, full): the mount goes on
    with a RAM-only cache."""


class OpensDirectory:
    """DiskTier's steps at startup (a mixin: the tier's state is set by its __init__)."""

    directory: Path
    data_dir: Path
    index: Rdict
    policy: RankedPolicy
    ranking: IndexRanking
    chunks: ChunkStore
    used: int
    warnings: list[str]

    def _private_directories(self, group: int | None) -> None:
        """The cache holds a private bucket's bytes and key names: its directories are
        the owner's (mode 0700), or with `group` readable by it (02750: new files take
        the group). The directory the user named is left as it is, with a warning if it
        is more open; the ones inside it are ours and made private."""
        mode = 0o700 if group is None else 0o2750
        top = self.directory
        if not top.exists():
            top.parent.mkdir(parents=True, exist_ok=True)
            private_directory(top, mode, group=group)
        else:
            info = top.stat()
            if info.st_uid != os.geteuid() and info.st_mode & 0o022:
                raise UnsafePath(f"{top} belongs to uid {info.st_uid} and other users can "
                                 "write to it")
            if (opened := openness(top, mode)) is not None:
                self.warnings.append(
                    f"cache directory {top} is open to other users (mode {opened:04o}); its "
                    f"contents are kept private, but run: chmod {mode & 0o777:o} {top}")
        for sub in (self.data_dir, top / "chunks", top / "index"):
            private_directory(sub, mode, group=group)

    def _load(self) -> None:
        found = self.index.get(schema.FORMAT_KEY)
        if found not in (None, *schema.OLDER_FORMATS, schema.INODE_LOCATIONS_FORMAT,
                         schema.FORMAT):
            raise CacheDirError(f"{self.directory} holds a cache of another format; "
                                "clear it with: bucketfs cache clear DIR")
        if found in schema.OLDER_FORMATS:
            self._start_afresh(found)
            found = None
        elif found == schema.INODE_LOCATIONS_FORMAT:
            upgraded = upgrade_inode_records(self.index)
            log.info("cache: %s upgraded to format %s (%d inode records)", self.directory,
                     schema.FORMAT.decode(), upgraded)
        identity = self.policy.identity().encode()
        # Ranks saved by another policy are rebuilt.
        rebuild = found is not None and self.index.get(schema.POLICY_KEY) != identity
        saved = self.index.get(schema.STATE_KEY)
        state = None
        if saved is not None:
            try:
                state = schema.decode_state(saved)
            except ValueError:
                rebuild = True  # totals of another layout: recount rather than misread
        if state is not None and not rebuild:
            ranking = self.ranking
            (ranking.clock, ranking.misses, self.used, ranking.gap_sum,
             ranking.gap_count) = state
            self.chunks.restore_totals(self.index.get(schema.CHUNK_TOTALS_KEY))
        else:
            self._recover(rebuild)
        self.index[schema.FORMAT_KEY] = schema.FORMAT
        self.index[schema.POLICY_KEY] = identity
        if saved is not None:
            # From now on a crash must look like one: the next open recounts.
            batch = WriteBatch(raw_mode=True)
            batch.delete(schema.STATE_KEY)
            batch.delete(schema.CHUNK_TOTALS_KEY)
            self.index.write(batch)
            self.index.flush_wal(True)

    def _start_afresh(self, found: bytes) -> None:
        """Drop everything a cache of an older format holds: its entries do not say the
        span they hold, so none can be trusted to be the bytes a read needs."""
        log.warning("cache: %s was written by an older bucketfs (format %s) whose entries "
                    "do not name the block size that cut them; starting it afresh",
                    self.directory, found.decode())
        self.index.delete_range(b"\0", b"\xff" * 8)
        self.index.flush_wal(True)
        for directory in (self.data_dir, self.chunks.directory):
            mode = stat.S_IMODE(directory.stat().st_mode)
            shutil.rmtree(directory, ignore_errors=True)
            private_directory(directory, mode)

    def _recover(self, rebuild: bool) -> None:
        """Recount the records (the last run did not close cleanly, or the ranks are
        rebuilt) and delete block files no record names."""
        if rebuild:
            self.ranking.clear_keys()
        self.chunks.recover_chunks(rebuild)
        batch = WriteBatch(raw_mode=True) if rebuild else None
        indexed: set[str] = set()
        broken: list[bytes] = []
        # Blocks of every bucket this directory ever cached compete for its room alike.
        for name, value in prefixed(self.index, ENTRY):
            packed = schema.decode_packed(value)
            if packed is not None:  # counted in its chunk's bytes
                if not self.chunks.recover_member(packed):
                    broken.append(name)  # its chunk is gone
                continue
            try:
                record = schema.decode_block(value)
                self.ranking.restored(batch, name[1:], record.length, record.cost,
                                      record.state)
            except (ValueError, TypeError, IndexError, OverflowError, struct.error):
                broken.append(name)  # not a record this code wrote: a miss
                continue
            indexed.add(block_file_name(name[1:]))
            self.used += record.length
            if batch is not None and len(batch) >= 10_000:
                self.index.write(batch)
                batch = WriteBatch(raw_mode=True)
        if batch is not None:
            self.index.write(batch)
        for name in broken:
            self.index.delete(name)
        self.chunks.finish_recovery()
        self.index.delete(schema.CHUNK_TOTALS_KEY)
        self._sweep(indexed)

    def _sweep(self, indexed: set[str]) -> None:
        """Delete temporary files and files no index entry names (a crash left them)."""
        removed = 0
        for sub in self.data_dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name not in indexed:
                    path.unlink(missing_ok=True)
                    removed += 1
        if removed:
            log.info("cache: removed %d unindexed block files from %s", removed, self.data_dir)


def block_file_name(entry: bytes) -> str:
    """The name of an entry's block file (under data/, in a directory of its first two
    characters)."""
    return hashlib.sha256(entry).hexdigest()[:40] + ".blk"


def open_error(directory: Path, exc: Exception) -> CacheDirError:
    """What opening the cache directory failed with, for the user: unwritable (the
    mount goes on with RAM only) or unusable."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    message = f"cannot use cache directory {directory}: {reason}"
    unwritable = (isinstance(exc, OSError) and exc.errno in STEP_ASIDE) or any(
        s in reason for s in ("Permission denied", "Read-only file system", "No space left"))
    return (CacheDirUnwritable if unwritable else CacheDirError)(message)
