"""How the daemon's RocksDB indexes are opened: the options every open shares.

Bloom filters, on each SST file (10 bits per key, whole keys) and on the memtable (5% of
its size). A cold file's first read asks the SSD tier's index for a block it does not
hold (`DiskTier.holds`), and without filters RocksDB looks for that key in every level's
file that could hold it, reading and searching a data block each time, and seeks the
memtable's skip list. At a million entries that took 11.1-11.3 µs of CPU per absent
key and 8.4-8.8 per held one, against 0.6 and 6.1-6.3 with the filters (`python -m
bench.index_gets`; docs/BENCHMARKS.md, step 49), for ~1.2 MiB of filters per million
keys, held in memory with their files' readers.
"""

from __future__ import annotations

from rocksdict import BlockBasedOptions, Options


def index_options() -> Options:
    """Options for a raw-mode index (bytes keys and values), with its Bloom filters."""
    options = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)  # one filter per file, not per block
    options.set_block_based_table_factory(table)
    options.set_memtable_prefix_bloom_ratio(0.05)
    options.set_memtable_whole_key_filtering(True)
    return options
