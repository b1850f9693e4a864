"""`bucketfs cache stats|clear` over a real SSD-tier directory: what stats reports, that
clear frees everything, and that clear refuses what is not a cache or is in use."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from bucketfs.cache import admin
from bucketfs.cache.admin import (
    CacheAdminError,
    add_cache_commands,
    cache_stats,
    clear_cache,
    format_stats,
    load_counters,
    run_cache_command,
    save_counters,
)
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.listings import TreeIndex
from bucketfs.cache.schema import DirEntry, tree_space
from bucketfs.prefetch.eviction import make_policy

KiB, MiB = 1024, 1024**2
SIZES = [100 * KiB + i for i in range(5)]


def open_tier(directory: Path) -> DiskTier:
    return DiskTier(directory, 64 * MiB, make_policy("lru"), source="mem://bucket",
                    block_size=4 * MiB)


def populate(directory: Path) -> int:
    """Five blocks through the SSD tier, as a mount writes them; their data bytes."""
    rng = random.Random(3)
    disk = open_tier(directory)
    for i, size in enumerate(SIZES):
        assert disk.put(BlockId(f"img/{i}.jpg", "v1", 0, size=size), rng.randbytes(size), 0.01)
    disk.close()
    return sum(SIZES)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its contents."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bucketfs")
    add_cache_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_stats_of_a_populated_cache(tmp_path):
    directory = tmp_path / "cache"
    data = populate(directory)
    stats = cache_stats(directory)
    assert stats["entries"] == stats["block_files"] == 5
    assert stats["bytes"] == data
    assert data < stats["file_bytes"] < data + 5 * 200  # headers are small
    assert stats["index_bytes"] > 0
    assert stats["counters"] == {}
    assert stats["listings"] == 0
    assert "no counters saved yet" in format_stats(stats)


def test_stats_counts_saved_listings(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    disk = open_tier(directory)
    tree = TreeIndex(disk.index, tree_space("mem://bucket", ""))
    tree.store(1, [DirEntry("img", True, "img/")], listed_at=0.0)
    tree.store(2, [DirEntry("0.jpg", False, "img/0.jpg", 10, 0, "v1")], listed_at=0.0)
    disk.close()
    stats = cache_stats(directory)
    assert stats["listings"] == 2 and stats["entries"] == 5
    assert "2 directory listings" in format_stats(stats)


def test_stats_does_not_change_the_directory(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    before = snapshot(directory)
    cache_stats(directory)
    assert snapshot(directory) == before


def test_counters_add_up_over_mounts_and_show_as_hit_rates(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    for _ in range(2):
        disk = open_tier(directory)
        save_counters(disk.index, {"ram_hits": 6, "disk_hits": 3, "misses": 1,
                                   "origin_bytes": 2 * MiB})
        disk.close()
    stats = cache_stats(directory)
    assert stats["counters"] == {"ram_hits": 12, "disk_hits": 6, "misses": 2,
                                 "origin_bytes": 4 * MiB, "mounts": 2}
    table = format_stats(stats)
    assert "hit rate ram  60.0%" in table
    assert "hit rate ssd  30.0%" in table
    assert "20 over 2 mounts" in table
    assert "shared" not in table
    disk = open_tier(directory)
    assert disk.used == sum(SIZES), "counters must not look like entries"
    save_counters(disk.index, {"shared_hits": 20})
    disk.close()
    table = format_stats(cache_stats(directory))
    assert "hit rate shared  50.0%" in table and "40 over 3 mounts" in table


def test_unreadable_counters_are_no_counters(tmp_path):
    index = Rdict(str(tmp_path / "db"))
    index[admin.COUNTERS_KEY] = b"{not json"
    assert load_counters(index) == {}
    index.close()


def test_stats_works_while_a_mount_uses_the_cache(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    disk = open_tier(directory)
    try:
        assert cache_stats(directory)["entries"] == 5
    finally:
        disk.close()


def test_clear_frees_everything_and_a_new_mount_starts_empty(tmp_path):
    directory = tmp_path / "cache"
    data = populate(directory)
    on_disk = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    freed = clear_cache(directory)
    assert freed >= on_disk > data  # opening the index to check its lock may add a file
    assert directory.is_dir() and not list(directory.iterdir())
    disk = open_tier(directory)
    assert disk.used == 0 and disk.get(BlockId("img/0.jpg", "v1", 0, size=SIZES[0])) is None
    disk.close()


@pytest.mark.parametrize("layout", ["missing", "empty", "index_not_rocksdb", "foreign_db",
                                    "foreign_raw_db"])
def test_clear_refuses_what_is_not_a_cache(tmp_path, layout):
    directory = tmp_path / "dir"
    if layout != "missing":
        directory.mkdir()
        (directory / "data").mkdir()
        (directory / "data" / "keep.txt").write_text("precious")
    if layout == "index_not_rocksdb":
        (directory / "index").mkdir()
        (directory / "index" / "notes.txt").write_text("precious")
    if layout == "foreign_db":  # a rocksdict DB, but not a bucketfs index
        db = Rdict(str(directory / "index"))
        db["a"] = 1
        db.close()
    if layout == "foreign_raw_db":  # a raw-mode rocksdict DB, but without a format key
        db = Rdict(str(directory / "index"), Options(raw_mode=True))
        db[b"E1"] = b"not a record"
        db.close()
    before = snapshot(directory)
    with pytest.raises(CacheAdminError, match="not a bucketfs cache directory"):
        clear_cache(directory)
    with pytest.raises(CacheAdminError, match="not a bucketfs cache directory"):
        cache_stats(directory)
    assert snapshot(directory) == before


def test_clear_refuses_a_cache_in_use_by_this_process(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    disk = open_tier(directory)
    try:
        with pytest.raises(CacheAdminError, match="in use by a mount"):
            clear_cache(directory)
        first = BlockId("img/0.jpg", "v1", 0, size=SIZES[0])
        assert disk.get(first) is not None, "the mount was disturbed"
    finally:
        disk.close()
    assert cache_stats(directory)["entries"] == 5
    assert not list(directory.glob(".bucketfs-clearing-*"))
    assert clear_cache(directory) > 0


def test_clear_refuses_a_cache_in_use_by_another_process(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from rocksdict import Rdict, Options; "
         "db = Rdict(sys.argv[1], Options(raw_mode=True)); print('open', flush=True); "
         "sys.stdin.read()",
         str(directory / "index")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(CacheAdminError, match="in use by a mount"):
            clear_cache(directory)
    finally:
        holder.communicate("", timeout=10)
    assert cache_stats(directory)["entries"] == 5


def test_a_mount_starting_during_clear_puts_everything_back(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    populate(directory)
    checks = []
    real_check = admin._check_not_in_use

    def check(index_dir, path):
        checks.append(index_dir)
        if len(checks) == 2:  # the second look, after the move, finds the index held
            raise CacheAdminError(f"{path} is in use by a mount; unmount it first")
        real_check(index_dir, path)

    monkeypatch.setattr(admin, "_check_not_in_use", check)
    with pytest.raises(CacheAdminError, match="in use"):
        clear_cache(directory)
    assert len(checks) == 2
    assert sorted(p.name for p in directory.iterdir()) == ["chunks", "data", "index"]
    assert cache_stats(directory)["entries"] == 5


def test_clear_removes_what_an_interrupted_clear_left(tmp_path):
    directory = tmp_path / "cache"
    populate(directory)
    leftover = directory / ".bucketfs-clearing-old"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "x.blk").write_bytes(b"x" * 1000)
    assert clear_cache(directory) > 1000
    assert not list(directory.iterdir())


def test_command_line(tmp_path, capsys):
    directory = tmp_path / "cache"
    populate(directory)
    assert run_cache_command(parse(["cache", "stats", str(directory)])) == 0
    assert "entries" in capsys.readouterr().out
    assert run_cache_command(parse(["cache", "clear", str(directory)])) == 0
    assert capsys.readouterr().out.startswith(f"cleared {directory}: freed ")
    assert run_cache_command(parse(["cache", "clear", str(directory)])) == 1
    err = capsys.readouterr().err
    assert err.startswith("bucketfs: error: ") and "not a bucketfs cache" in err
    assert err.count("\n") == 1
