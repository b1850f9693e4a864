"""A data process: serves the reads of the objects it owns for a mount's dispatcher,
writing each reply to the mount's /dev/fuse descriptor itself (docs/DATA_PROCESSES.md).

    python -m bucketfs.data_process --fuse-fd N --jobs-fd J --parent PID --index K
                                    (started by dispatch.py)

It holds its own part of the data path, assembled as the daemon assembles its own
(mount.py): the GET engine through `ObjectStore` with the mount's retry policy, a RAM
tier of its share of `ram_cache`, an SSD tier of its own directory (its share of
`disk_cache`), `BlockCache` and `Reader` (read-ahead, every read pinned to the version
the job names), all on one trio thread. A read that fails is answered EIO; one whose
object changed in the bucket is also told to the dispatcher. It exits when the
dispatcher's end of the socket closes, after flushing to its SSD tier what only RAM
holds, and at once if the dispatcher dies (the kernel's parent-death signal): a data
process must never hold a mount's connection open on its own.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
import time

import trio

from bucketfs import huge_buffers, huge_pages
from bucketfs.backends import open_backend
from bucketfs.backends.base import VersionChanged
from bucketfs.backends.store import ObjectStore
from bucketfs.backends.urls import parse_bucket_url
from bucketfs.cache.disk import CacheDirError, DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tier import CacheEvents
from bucketfs.cache.tiered import BlockCache
from bucketfs.config import Config
from bucketfs.data_jobs import (
    CHANGED,
    COUNTS,
    JOB_MAX,
    LEVEL,
    LOG,
    READY,
    SETUP_MAX,
    Counts,
    Job,
    Setup,
    notice,
    unpack_job,
)
from bucketfs.fs import READ_STATES
from bucketfs.fuse_replies import fail, reply
from bucketfs.logs import Throttle, held_back
from bucketfs.mount import (
    MountError,
    backend_settings,
    eviction_policy,
    group_id,
    retry_policy,
)
from bucketfs.reader import ByteBudget, OpenFile, Reader, ReadSettings
from bucketfs.spare_buffers import spare_buffers

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: How often a data process sends its counters.
COUNTS_EVERY_S = 1.0
_throttle = Throttle(60.0)


class JobServer:
    """Answers the jobs that come over `jobs`, each by a task, replies to `fuse_fd`."""

    def __init__(self, fuse_fd: int, jobs: socket.socket, reader: Reader) -> None:
        self.fuse_fd, self.jobs, self.reader = fuse_fd, jobs, reader
        #: Jobs taken, and those answered EIO.
        self.reads = 0
        self.failures = 0
        #: Per (key, version), the read state of its latest reader (an LRU).
        self.states: collections.OrderedDict[tuple[str, str], OpenFile] = \
            collections.OrderedDict()

    async def serve(self, nursery: trio.Nursery) -> None:
        """Start a task per job until the dispatcher's end closes."""
        while True:
            await trio.lowlevel.wait_readable(self.jobs)
            while True:
                try:
                    message = self.jobs.recv(JOB_MAX)
                except BlockingIOError:
                    break
                if not message:
                    return
                self.reads += 1
                nursery.start_soon(self._answer, unpack_job(message))

    def _state(self, job: Job) -> OpenFile:
        """A read of the file's start starts over (a reader that opens the file again),
        as fs.Operations does for the files the kernel opens itself."""
        name = (job.key, job.version)
        state = self.states.get(name)
        if state is None or job.offset == 0:
            state = self.states[name] = self.reader.open(job.key, job.version,
                                                         job.object_size)
        self.states.move_to_end(name)
        if len(self.states) > READ_STATES:
            self.states.popitem(last=False)
        return state

    async def _answer(self, job: Job) -> None:
        try:
            data = await self.reader.read(self._state(job), job.offset, job.size)
        except VersionChanged:
            self._warn("changed", "object %r changed in the bucket while open; reads of "
                       "the old version fail, new opens get the new version", job.key)
            self.tell(notice(CHANGED, job.key))
            self._fail(job.unique)
        except Exception as exc:
            self._warn(type(exc).__name__, "read of %r failed: %s", job.key, exc)
            self._fail(job.unique)
        else:
            try:
                reply(self.fuse_fd, job.unique, data)
            except OSError as exc:
                # ENOENT: the reader was interrupted; ENODEV: unmounted. Either way
                # nobody waits for this answer.
                if exc.errno not in (errno.ENOENT, errno.ENODEV):
                    log.warning("reply to a read of %r failed: %s", job.key, exc)
                    self._fail(job.unique)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """A line at most once a minute per kind (as fs.py's): a reader rereading a file
        the bucket refuses must not fill the log's disk."""
        held = _throttle.admit(kind)
        if held is not None:
            log.warning(message + "%s", *args, held_back(held))

    def _fail(self, unique: int) -> None:
        self.failures += 1
        fail(self.fuse_fd, unique)

    def counts(self) -> Counts:
        """What this process has done, for the dispatcher's status and metrics: counters
        (only growing), and levels (`LEVEL`: what it holds now)."""
        reader, cache = self.reader, self.reader.cache
        requests = cache.store.counts
        tiers = {f"{tier.name}_evictions": tier.evictions for tier in cache.tiers}
        levels = {f"{LEVEL}{tier.name}_used": tier.used for tier in cache.tiers}
        return {"reads": self.reads, "failed_reads": self.failures,
                "cpu_us": int(time.process_time() * 1e6),
                "reader_opens": reader.opens, "reader_reads": reader.reads,
                "reader_bytes_read": reader.bytes_read,
                "reader_prefetches": reader.prefetches, **tiers, **levels,
                f"{LEVEL}readahead_bytes": reader.budget.used,
                f"{LEVEL}write_queue_bytes": cache.queued,
                **{f"cache_{name}": n for name, n in dataclasses.asdict(cache.stats).items()},
                **{f"origin_{name}": n for name, n in dataclasses.asdict(requests).items()}}

    async def send_counts(self) -> None:
        while True:
            await trio.sleep(COUNTS_EVERY_S)
            self.tell(notice(COUNTS, json.dumps(self.counts())))

    def tell(self, message: bytes) -> None:
        """Send the dispatcher a notice (data_jobs)."""
        with contextlib.suppress(OSError):  # a full socket drops a notice, not a read
            self.jobs.send(message)


class _ToDispatcher(logging.Handler):
    """Log records go to the dispatcher, which logs them where the mount logs."""

    def __init__(self, jobs: socket.socket, index: int) -> None:
        super().__init__()
        self.jobs, self.index = jobs, index

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            text = f"{record.levelno}\tdata process {self.index}: {record.getMessage()}"
            self.jobs.send(notice(LOG, text))


def open_shard(setup: Setup, config: Config) -> DiskTier | None:
    if setup.shard_dir is None:
        return None
    try:
        budget = setup.disk_budget
        disk = DiskTier(setup.shard_dir,
                        config.disk_cache // setup.count if budget is None else budget,
                        eviction_policy(config), source=setup.source,
                        block_size=config.block_size,
                        free_floor=config.disk_free_floor,
                        group=group_id(config, "cache_group"))
    except (CacheDirError, MountError) as exc:  # unwritable, held by another mount
        log.warning("%s; caching in RAM only", exc)
        return None
    for warning in disk.warnings:
        log.warning(warning)
    return disk


async def serve(setup: Setup, fuse_fd: int, jobs: socket.socket) -> JobServer:
    """Serve jobs until the dispatcher's end closes; the server, for its counts."""
    config = Config(setup.options)
    # As the daemon's own data path is set up (mount.py).
    huge_pages.return_freed_blocks_to_the_system()
    huge_buffers.choose(config.huge_buffers)
    spare_buffers.limit = config.readahead_max
    backend = open_backend(parse_bucket_url(setup.url), backend_settings(config))
    store = ObjectStore(backend, max_workers=config.max_connections,
                        retry=retry_policy(config))
    disk = open_shard(setup, config)
    budget = max(config.block_size, config.readahead_budget // setup.count)
    try:
        async with trio.open_nursery() as nursery:
            cache = BlockCache(
                store, RamTier(config.ram_cache // setup.count, eviction_policy(config),
                               CacheEvents()),
                disk, block_size=config.block_size, nursery=nursery)
            reader = Reader(cache, ByteBudget(budget),
                            ReadSettings(readahead_max=min(config.readahead_max, budget)),
                            nursery)
            server = JobServer(fuse_fd, jobs, reader)
            server.tell(notice(READY, ""))
            nursery.start_soon(server.send_counts)
            await server.serve(nursery)
            await cache.flush()  # what only RAM holds, to the SSD shard
            nursery.cancel_scope.cancel()
    finally:
        if disk is not None:
            disk.close()
        backend.close()
    return server


def die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuse-fd", type=int, required=True)
    parser.add_argument("--jobs-fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True, help="the dispatcher's pid")
    parser.add_argument("--index", type=int, help="which of the mount's (for ps)")
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    # SIGINT from a terminal goes to the whole process group: the dispatcher decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    jobs = socket.socket(fileno=args.jobs_fd)
    setup = Setup.unpack(jobs.recv(SETUP_MAX))
    jobs.setblocking(False)
    handler = _ToDispatcher(jobs, setup.index)
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger().setLevel(str(setup.options.get("log_level", "info")).upper())
    try:
        trio.run(serve, setup, args.fuse_fd, jobs)
    except Exception as exc:  # told to the dispatcher, which starts it again
        log.error("stopped: %s", exc, exc_info=exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
