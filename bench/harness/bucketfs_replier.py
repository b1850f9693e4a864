"""A replier of dispatch_fuse.py that serves reads through bucketfs's own data path,
for `bench.fuse_clones`: what each data process of a dispatching bucketfs would cost.

dispatch_fuse.py's own repliers are threads around one GET; bucketfs's would carry its
cache. This one runs bucketfs's modules as the daemon assembles them (mount.py): the
libcurl GET driver through `ObjectStore` with the mount's retry policy, a RAM tier
(`ram_cache` divided among the repliers), optionally an SSD tier of its own directory
(`--cache-dir`), `BlockCache` and `Reader` (read-ahead, version pinning), all in one
trio thread. Each job from the dispatcher (unique, inode, offset, size) is served by a
task: the inode's object (key, ETag, size) from the driver's table, a read state per
inode made again at a read of the file's start (as fs.Operations keeps them with
kernel_opens), `Reader.read`, and the reply written to the shared /dev/fuse descriptor.
A read that fails is answered EIO. It exits when the dispatcher's end closes, after
flushing to its SSD tier what only RAM holds.

    python -m bench.harness.bucketfs_replier --fd N --table F --jobs J --procs P
                                             --stats F [--cache-dir DIR]

The origin and its credentials come from the driver's table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from bench.harness.dispatch_fuse import JOB
from bench.harness.raw_fuse import OUT_HEADER, Tree, answer_failure, ready
from bucketfs.backends import open_backend
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.backends.urls import parse_bucket_url
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tier import CacheEvents
from bucketfs.cache.tiered import BlockCache
from bucketfs.config import Config
from bucketfs.mount import backend_settings, eviction_policy
from bucketfs.reader import ByteBudget, OpenFile, Reader, ReadSettings

log = logging.getLogger(__name__)


class JobServer:
    """Reads by inode through `reader`, each reply written to `fd`."""

    def __init__(self, fd: int, tree: Tree, versions: dict[int, str], reader: Reader
                 ) -> None:
        self.fd, self.tree, self.versions, self.reader = fd, tree, versions, reader
        #: A read state per inode read (the daemon keeps a bounded number; the
        #: benchmark's few thousand files need no bound).
        self.states: dict[int, OpenFile] = {}
        self.counts: Counter[str] = Counter()

    async def serve(self, job: socket.socket, nursery: trio.Nursery) -> None:
        """Start a task per job until the dispatcher's end closes."""
        while True:
            await trio.lowlevel.wait_readable(job)
            while True:
                try:
                    message = job.recv(JOB.size)
                except BlockingIOError:
                    break
                if not message:
                    return
                nursery.start_soon(self._answer, *JOB.unpack(message))

    async def _answer(self, unique: int, ino: int, offset: int, size: int) -> None:
        self.counts["READ"] += 1
        try:
            state = self.states.get(ino)
            if state is None or offset == 0:  # a reader that starts the file starts over
                state = self.states[ino] = self.reader.open(
                    self.tree.key[ino], self.versions[ino], self.tree.size[ino])
            data = await self.reader.read(state, offset, size)
            os.writev(self.fd, [OUT_HEADER.pack(OUT_HEADER.size + len(data), 0, unique),
                                data])
        except Exception as error:
            if answer_failure(self.fd, unique, error) == "answered":
                self.counts["EIO"] += 1
                log.warning("read of inode %d failed: %s", ino, error)


async def replier(args: argparse.Namespace, table: dict[str, Any], tree: Tree
                  ) -> Counter[str]:
    origin = table["origin"]
    # The origin's credentials, where a bucketfs mount finds them (the driver's table
    # holds them for the raw servers too).
    os.environ.update({"AWS_ACCESS_KEY_ID": origin["access_key"],
                       "AWS_SECRET_ACCESS_KEY": origin["secret_key"],
                       "AWS_EC2_METADATA_DISABLED": "true"})
    config = Config({"endpoint_url": origin["endpoint"], "region": origin["region"],
                     "addressing_style": "path"})
    backend = open_backend(parse_bucket_url(f"s3://{origin['bucket']}/"),
                           backend_settings(config))
    retry = RetryPolicy(config.retry_attempts, config.retry_base_delay,
                        config.retry_max_delay)
    store = ObjectStore(backend, max_workers=config.max_connections, retry=retry)
    disk = None if args.cache_dir is None else DiskTier(
        args.cache_dir, config.disk_cache // args.procs, eviction_policy(config),
        source=origin["endpoint"], block_size=config.block_size,
        free_floor=config.disk_free_floor)
    job = socket.socket(fileno=args.jobs)
    job.setblocking(False)
    versions = {int(ino): etag for ino, etag in table["etags"].items()}
    try:
        async with trio.open_nursery() as nursery:
            cache = BlockCache(
                store, RamTier(config.ram_cache // args.procs, eviction_policy(config),
                               CacheEvents()),
                disk, block_size=config.block_size, nursery=nursery)
            reader = Reader(cache, ByteBudget(config.readahead_budget // args.procs),
                            ReadSettings(readahead_max=config.readahead_max), nursery)
            server = JobServer(args.fd, tree, versions, reader)
            ready(args.stats)
            await server.serve(job, nursery)
            await cache.flush()  # what only RAM holds, to the SSD tier
            nursery.cancel_scope.cancel()
    finally:
        if disk is not None:
            disk.close()
        backend.close()
    return server.counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--procs", type=int, default=1, help="repliers (budgets divided)")
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--cache-dir", help="this replier's SSD tier (default: RAM only)")
    args = parser.parse_args(argv)
    table = json.loads(args.table.read_text())
    counts = trio.run(replier, args, table, Tree(table["rows"]))
    args.stats.write_text(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
