"""Every index the daemon opens has RocksDB's Bloom filters (bucketfs/cache/index_options.py
says why): on each SST file and on the memtable, as RocksDB records the options it runs
with in the index's OPTIONS file."""

from __future__ import annotations

from pathlib import Path

from rocksdict import Options, Rdict

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.index_options import index_options
from bucketfs.namespace import Namespace
from bucketfs.prefetch.eviction import make_policy
from tests.membackend import MemoryBackend


def options_in_use(index_dir: Path) -> dict[str, str]:
    latest = max(index_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
    settings = {}
    for line in latest.read_text().splitlines():
        name, sep, value = line.strip().partition("=")
        if sep:
            settings[name] = value
    return settings


def assert_filtered(index_dir: Path) -> None:
    settings = options_in_use(index_dir)
    assert settings["filter_policy"].startswith("bloomfilter"), settings["filter_policy"]
    assert settings["memtable_whole_key_filtering"] == "true"
    assert float(settings["memtable_prefix_bloom_size_ratio"]) > 0


def test_the_ssd_tiers_index_has_bloom_filters(tmp_path):
    tier = DiskTier(tmp_path / "cache", 1 << 20, make_policy(), source="mem://bucket",
                    block_size=1 << 16)
    try:
        assert_filtered(tmp_path / "cache" / "index")
    finally:
        tier.close()


def test_a_ram_only_mounts_tree_index_has_bloom_filters():
    store = ObjectStore(MemoryBackend({"a": b"x"}), max_workers=1, retry=RetryPolicy(1))
    namespace = Namespace(store, "")
    try:
        assert namespace._temporary is not None
        assert_filtered(Path(namespace._temporary))
    finally:
        namespace.close()


def test_an_index_written_without_filters_is_read_with_them_and_back(tmp_path):
    """A cache written by a bucketfs before the filters opens with them (its old files
    carry none and are read as before), and an older bucketfs still opens it after."""
    path = str(tmp_path / "index")
    index = Rdict(path, Options(raw_mode=True))
    for i in range(5000):
        index[b"old%d" % i] = b"v"
    index.flush()
    index.close()
    index = Rdict(path, index_options())
    assert index.get(b"old123") == b"v" and index.get(b"absent") is None
    index[b"new"] = b"w"
    index.flush()
    index.close()
    index = Rdict(path, Options(raw_mode=True))
    assert (index.get(b"old4999"), index.get(b"new")) == (b"v", b"w")
    index.close()
