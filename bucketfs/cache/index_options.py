"""How the daemon's RocksDB indexes are opened: the options every open shares.

Bloom filters, on each SST file (10 bits per key, whole keys) and on the memtable (1% of
its 64 MiB: ~20 bits per key of a full one). A cold file's first read asks the SSD
tier's index for a block it does not hold (`DiskTier.holds`), and without filters
RocksDB looks for that key in every level's file that could hold it, reading and
searching a data block each time, and seeks the memtable's skip list. At a million
entries that took 11.1-11.3 µs of CPU per absent key and 8.4-8.8 per held one, against
0.6 and 6.1-6.3 with the filters (`python -m bench.index_gets`); a key absent from a
memtable of 200,000 took 2.2 µs, against 0.4 (docs/BENCHMARKS.md, step 49). Memory:
~1.2 MiB of file filters per million keys, held with their files' readers, and ~0.7 MiB
per memtable (5% gave no faster reads for 3.3 MiB).
"""

from __future__ import annotations

from rocksdict import BlockBasedOptions, Options


def index_options() -> Options:
    """Options for a raw-mode index (bytes keys and values), with its Bloom filters."""
    options = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)  # one filter per file, not per block
    options.set_block_based_table_factory(table)
    options.set_memtable_prefix_bloom_ratio(0.01)
    options.set_memtable_whole_key_filtering(True)
    return options
