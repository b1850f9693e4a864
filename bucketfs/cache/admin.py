"""Offline tools over an SSD cache directory: `bucketfs cache stats DIR` and
`bucketfs cache clear DIR` (the shared tier's are in shared_admin.py).

`stats` opens the index read-only, which RocksDB allows while a mount holds the
directory, and with its info log sent to a temporary directory, so looking never
changes the cache. `clear` proves the directory is a bucketfs cache (an `index/` whose
format key is set) and that no mount uses it (opening the index for writing takes
RocksDB's LOCK, which fails while a mount holds it), then moves `data/`, `chunks/` and
`index/` aside into one trash directory and deletes that. Were a mount to start in the instant
between the check and the move, the check is made again on the moved index, and
everything is moved back if it is held.

The daemon may save its hit and miss counters in the index at unmount
(`save_counters`); they add up over mounts and `stats` shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Rdict

from bucketfs.cache import shared_admin
from bucketfs.cache.index_options import index_options
from bucketfs.cache.scans import prefixed
from bucketfs.cache.schema import (
    COUNTERS_KEY,
    ENTRY,
    FORMAT_KEY,
    TREE_LISTED,
    decode_block,
    decode_counters,
    decode_packed,
    encode_counters,
)
from bucketfs.status_view import size

_TRASH_PREFIX = ".bucketfs-clearing-"
_ROCKSDICT_CONFIG = "rocksdict-config.json"


#: Where in a cache directory a mount's data processes keep their SSD tiers.
SHARDS = "shards"


class CacheAdminError(Exception):
    """Why a cache directory cannot be inspected or cleared (one line for the user)."""


# --- counters saved by the daemon -------------------------------------------------------


def save_counters(index: Rdict, stats: dict[str, int]) -> None:
    """Add one mount's counters (e.g. `dataclasses.asdict(cache.stats)`) to the totals
    kept in the index. Call it once per mount, before the index is closed."""
    totals = load_counters(index)
    for name, value in stats.items():
        totals[name] = totals.get(name, 0) + value
    totals["mounts"] = totals.get("mounts", 0) + 1
    index[COUNTERS_KEY] = encode_counters(totals)


def load_counters(index: Rdict) -> dict[str, int]:
    """The totals saved by `save_counters`; empty if none were (or they are unreadable)."""
    return decode_counters(index.get(COUNTERS_KEY))


# --- stats ------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _raw_mode(index_dir: Path) -> bool:
    try:
        config = json.loads((index_dir / _ROCKSDICT_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("raw_mode") is True


@contextmanager
def _open_read_only(directory: Path) -> Iterator[Rdict]:
    """The cache's index, read-only (no LOCK taken, nothing written to the directory)."""
    # rocksdict (re)writes its config file in whatever it opens, even read-only and even
    # if the open then fails: open only what a DiskTier made, a raw-mode rocksdict DB.
    index_dir = directory / "index"
    if not (index_dir / "CURRENT").is_file() or not _raw_mode(index_dir):
        raise CacheAdminError(f"{directory} is not a bucketfs cache directory (no index)")
    with tempfile.TemporaryDirectory(prefix="bucketfs-admin-") as log_dir:
        options = index_options()
        options.set_db_log_dir(log_dir)
        try:
            index = Rdict(str(index_dir), options,
                          access_type=AccessType.read_only())
        except Exception as exc:  # rocksdict raises plain Exception
            raise CacheAdminError(f"{directory} is not a bucketfs cache directory "
                                  f"({_first_line(exc)})") from None
        try:
            if index.get(FORMAT_KEY) is None:
                raise CacheAdminError(f"{directory} is not a bucketfs cache directory "
                                      "(its index has no format key)")
            yield index
        finally:
            index.close()


def _tree_size(path: Path) -> tuple[int, int, int]:
    """(number of files, their bytes, the bytes the filesystem gives them) under
    `path`; zeros if it does not exist. The last leaves out holes: members punched out
    of a chunk file keep its length but not its room on disk."""
    files = total = allocated = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # a mount evicted it while we walked
                continue
            total += info.st_size
            allocated += info.st_blocks * 512
            files += 1
    return files, total, allocated


def cache_stats(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What a cache directory holds. Works while a mount uses it.

    Keys: `directory`, `entries` and `bytes` (indexed blocks and their data bytes),
    `packed_entries` (those of them packed in chunk files), `block_files` and
    `file_bytes` (block files under data/, headers included), `chunk_files` and
    `chunk_bytes` (chunk files under chunks/, their length: dead members, holes and
    headers included), `chunk_disk_bytes` (the room the filesystem gives them: holes
    left out),
    `index_bytes` (the RocksDB index on disk), `listings` (directory listings kept for
    remounts), `counters` (the totals saved by `save_counters`, {} if none), `shards`
    (data processes' shards, whose entries and files the other figures include)."""
    path = Path(directory)
    with _open_read_only(path) as index:
        entries = data_bytes = packed_entries = 0
        for _, value in prefixed(index, ENTRY):
            entries += 1
            packed = decode_packed(value)
            packed_entries += packed is not None
            data_bytes += packed.length if packed is not None else decode_block(value).length
        listings = sum(1 for _ in prefixed(index, TREE_LISTED))
        counters = load_counters(index)
    block_files = file_bytes = 0
    if (path / "data").is_dir():
        for sub in (path / "data").iterdir():
            if not sub.is_dir():
                continue
            for block in sub.iterdir():
                if block.name.endswith(".blk"):
                    try:
                        file_bytes += block.lstat().st_size
                    except FileNotFoundError:
                        continue
                    block_files += 1
    chunk_files, chunk_bytes, chunk_disk_bytes = _tree_size(path / "chunks")
    stats = {
        "directory": str(path),
        "entries": entries,
        "bytes": data_bytes,
        "packed_entries": packed_entries,
        "block_files": block_files,
        "file_bytes": file_bytes,
        "chunk_files": chunk_files,
        "chunk_bytes": chunk_bytes,
        "chunk_disk_bytes": chunk_disk_bytes,
        "index_bytes": _tree_size(path / "index")[1],
        "listings": listings,
        "counters": counters,
        "shards": 0,
    }
    # A mount with data processes keeps their blocks in shards (mount_data.py), each a
    # cache directory of its own: counted with the rest.
    for shard in shard_dirs(path):
        stats["shards"] += 1
        for name, value in cache_stats(shard).items():
            if name in _SUMMED:
                stats[name] += value
    return stats


#: What `cache_stats` adds up over a cache directory's shards.
_SUMMED = ("entries", "bytes", "packed_entries", "block_files", "file_bytes",
           "chunk_files", "chunk_bytes", "chunk_disk_bytes", "index_bytes")


def shard_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """The data processes' shards a cache directory holds, by index."""
    shards = Path(directory) / SHARDS
    if not shards.is_dir():
        return []
    return sorted((path for path in shards.iterdir() if path.name.isdigit()),
                  key=lambda path: int(path.name))


def format_stats(d: dict[str, Any]) -> str:
    """`cache_stats`' result as a short table for people."""
    rows = [
        ("directory", d["directory"]),
        ("entries", f"{d['entries']:,}"),
        ("cached data", size(d["bytes"])),
        ("block files", f"{d['block_files']:,} ({size(d['file_bytes'])})"),
        ("chunk files", f"{d.get('chunk_files', 0):,} ({size(d.get('chunk_bytes', 0))}, "
                        f"{size(d.get('chunk_disk_bytes', 0))} on disk), "
                        f"{d.get('packed_entries', 0):,} entries packed"),
        ("index", f"{size(d['index_bytes'])}, {d['listings']:,} directory listings"),
    ]
    if d.get("shards"):
        rows.append(("shards", f"{d['shards']} (data processes'; counted above)"))
    counters = d.get("counters") or {}
    ram, ssd = counters.get("ram_hits", 0), counters.get("disk_hits", 0)
    shared = counters.get("shared_hits", 0)
    lookups = ram + ssd + shared + counters.get("misses", 0)
    if lookups:
        mounts = counters.get("mounts", 0)
        rows.append(("lookups", f"{lookups:,} over {mounts} mount{'s' * (mounts != 1)}"))
        rows.append(("hit rate ram", f"{ram / lookups:.1%}"))
        rows.append(("hit rate ssd", f"{ssd / lookups:.1%}"))
        if shared:
            rows.append(("hit rate shared", f"{shared / lookups:.1%}"))
        rows.append(("origin", f"{counters.get('misses', 0) / lookups:.1%} of lookups, "
                               f"{size(counters.get('origin_bytes', 0))}"))
    else:
        rows.append(("hit rate", "no counters saved yet"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# --- clear ------------------------------------------------------------------------------


def _check_not_in_use(index_dir: Path, directory: Path) -> None:
    """Open the index for writing and close it again: fails while a mount holds LOCK."""
    with tempfile.TemporaryDirectory(prefix="bucketfs-admin-") as log_dir:
        options = index_options()
        options.set_db_log_dir(log_dir)
        try:
            Rdict(str(index_dir), options).close()
        except Exception as exc:  # rocksdict raises plain Exception
            reason = _first_line(exc)
            if "lock" in reason.lower():
                raise CacheAdminError(f"{directory} is in use by a mount; unmount it "
                                      "first") from None
            raise CacheAdminError(f"cannot clear {directory}: {reason}") from None


def clear_cache(directory: str | os.PathLike[str]) -> int:
    """Delete every cached block and the index of a cache directory that no mount uses;
    the bytes freed. The directory itself stays."""
    path = Path(directory)
    with _open_read_only(path):
        pass  # proves it is a bucketfs cache
    _check_not_in_use(path / "index", path)
    # The shards of data processes, each a cache directory of its own; a mount that
    # holds this directory's lock would hold theirs too.
    freed = sum(clear_cache(shard) for shard in shard_dirs(path))
    if (path / SHARDS).is_dir():
        shutil.rmtree(path / SHARDS)
    trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=path))
    moved: list[str] = []
    try:
        # data/ first: interrupted here, the index still names the cache, so clearing
        # again works; a mount would only find its entries missing (misses).
        for name in ("data", "chunks", "index"):
            if (path / name).exists():
                os.rename(path / name, trash / name)
                moved.append(name)
        _check_not_in_use(trash / "index", path)  # a mount may have started meanwhile
    except BaseException:
        for name in reversed(moved):
            os.rename(trash / name, path / name)
        trash.rmdir()
        raise
    freed += _tree_size(trash)[1]
    shutil.rmtree(trash)
    for leftover in path.glob(_TRASH_PREFIX + "*"):  # from an earlier, interrupted clear
        freed += _tree_size(leftover)[1]
        shutil.rmtree(leftover, ignore_errors=True)
    return freed


# --- command line -----------------------------------------------------------------------


def add_cache_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `cache stats DIR`, `cache clear DIR` and the shared tier's `cache shared-list`
    and `cache shared-clear` to the `bucketfs` command."""
    cache = subparsers.add_parser(
        "cache", help="inspect or clear an SSD cache directory or a shared tier",
        description="Inspect or clear the SSD cache directory of a mount (cache.cache_dir), "
                    "or the datasets in a shared tier (cache.shared).",
    )
    commands = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    stats = commands.add_parser(
        "stats", help="show what a cache directory holds",
        description="Show the entries, bytes and saved hit rates of DIR (works while mounted).",
    )
    stats.add_argument("directory", metavar="DIR")
    clear = commands.add_parser(
        "clear", help="delete everything in a cache directory",
        description="Delete the cached blocks and the index in DIR. Refuses if DIR is not "
                    "a bucketfs cache or a mount is using it.",
    )
    clear.add_argument("directory", metavar="DIR")
    shared_admin.add_commands(commands)


def run_cache_command(args: argparse.Namespace) -> int:
    """Run `bucketfs cache ...`: 0, or 1 after a one-line error on stderr."""
    if args.cache_command.startswith("shared-"):
        return shared_admin.run_command(args)
    try:
        if args.cache_command == "stats":
            print(format_stats(cache_stats(args.directory)))
        else:
            freed = clear_cache(args.directory)
            print(f"cleared {args.directory}: freed {size(freed)}")
    except (CacheAdminError, OSError) as exc:
        if isinstance(exc, CacheAdminError):
            message = str(exc)
        else:
            message = f"{exc.filename or args.directory}: {exc.strerror or exc}"
        print(f"bucketfs: error: {message}", file=sys.stderr)
        return 1
    return 0
