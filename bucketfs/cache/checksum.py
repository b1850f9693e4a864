"""The SSD tier's checksum of every block and packed member.

CRC-32 with zlib's polynomial, so entries written by any version verify the same, but
computed by zlib-ng's SIMD code: 18 GB/s against zlib's 2.2 GB/s on this VM for blocks
not in the CPU cache, where zlib's CRC was 18% of the daemon's CPU on a cold read of a
large object (docs/BENCHMARKS.md).
"""

from zlib_ng.zlib_ng import crc32

__all__ = ["crc32"]
