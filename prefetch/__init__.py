"""Decisions about what to fetch ahead of the reader, kept pure and deterministic so a
trace can be replayed through them without FUSE or a network.

Installed as `bucketfs.prefetch`.
"""
