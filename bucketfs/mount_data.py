"""A mount's data processes (the `data_processes` option; docs/DATA_PROCESSES.md): their
setups, their SSD shards under the cache directory, and starting them once the kernel's
connection exists.

Each data process keeps its SSD tier in `cache_dir/shards/K`, a cache directory of its
own (its own index and lock). The mount's own tier in `cache_dir` keeps the tree's
listings, and the blocks a mount without data processes left there; the shards share
what of `disk_cache` those leave. Shards of a mount with more data processes than this
one are deleted at mount, so that the disk holds at most `disk_cache`: the mount holds
the cache directory's lock, so no other mount uses them.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence

import trio

from bucketfs.cache.admin import SHARDS, shard_dirs
from bucketfs.cache.disk import DiskTier
from bucketfs.config import Config
from bucketfs.data_jobs import Setup
from bucketfs.dispatch import DataProcesses
from bucketfs.private import private_directory

log = logging.getLogger(__name__)

#: How long data processes may take to build their data paths before the mount serves
#: anyway (their reads fail until they are ready, or started again).
READY_S = 60.0


class DataProcessError(Exception):
    """The data processes cannot start; the message is the one line the user sees."""


def prepare_shards(disk: DiskTier, count: int, group: int | None) -> list[str]:
    """Each data process's shard directory, private as the cache directory's own; those
    of a mount with more processes deleted."""
    mode = 0o700 if group is None else 0o2750
    parent = private_directory(disk.directory / SHARDS, mode, group=group)
    for stale in shard_dirs(disk.directory):
        if int(stale.name) >= count:
            log.info("deleting %s: a shard of a mount with more data processes", stale)
            shutil.rmtree(stale, ignore_errors=True)
    return [str(private_directory(parent / str(index), mode, group=group))
            for index in range(count)]


def data_setups(url: str, source: str, config: Config, disk: DiskTier | None,
                group: int | None) -> list[Setup]:
    """One setup per data process; with a writable SSD tier, a shard each sharing what
    of `disk_cache` the mount's own tier does not hold."""
    count = config.data_processes
    options = config.as_dict()
    if disk is None or not disk.writable:
        return [Setup(url, options, index, count, None, source) for index in range(count)]
    if disk.used > config.disk_cache // 2:
        log.warning("%s holds %d MiB of blocks a mount without data processes cached; the "
                    "data processes' shards share the rest of disk_cache (bucketfs cache "
                    "clear frees it)", disk.directory, disk.used >> 20)
    budget = max(0, config.disk_cache - disk.used) // count
    return [Setup(url, options, index, count, shard, source, disk_budget=budget)
            for index, shard in enumerate(prepare_shards(disk, count, group))]


def fuse_descriptor() -> int:
    """The mount's /dev/fuse descriptor, which pyfuse3 keeps to itself: the one open
    descriptor of /dev/fuse in this process (mount.check_fuse_device closed its own)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    if len(found) != 1:
        raise DataProcessError(f"cannot tell the mount's /dev/fuse descriptor: this "
                               f"process holds {len(found)}")
    return found[0]


async def start_data_processes(nursery: trio.Nursery, data: DataProcesses) -> None:
    """Start `data`'s processes on the mounted connection; wait until they serve."""
    data.fuse_fd = fuse_descriptor()
    await nursery.start(data.run)
    with trio.move_on_after(READY_S) as waited:
        await data.wait_ready()
    if waited.cancelled_caught:
        log.warning("data processes not ready after %.0f s; their reads fail until they "
                    "are", READY_S)


def refuse_warm(paths: Sequence[str]) -> int:
    """`bucketfs warm` with data processes: the reply's one line (warm would fill the
    daemon's cache, where no read looks)."""
    raise ValueError("warm is off with data processes (for now; docs/DATA_PROCESSES.md)")
