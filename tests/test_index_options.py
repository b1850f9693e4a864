"""Every index the daemon opens has RocksDB's Bloom filters (bucketfs/cache/index_options.py
says why): on each SST file and on the memtable, as RocksDB records the options it runs
with in the index's OPTIONS file."""

from __future__ import annotations

from pathlib import Path

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.disk import DiskTier
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
