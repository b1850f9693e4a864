"""The tiered block cache: RAM, then local SSD, indexed in RocksDB.

`blocks` says how an object is cut into cached entries, `ram` and `disk` are the two
tiers, `index` is the on-disk index of the SSD tier, and `tiered.BlockCache` puts them
together in front of the origin. Eviction decisions come from `bucketfs.prefetch.eviction`.
"""
