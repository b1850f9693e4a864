"""Mounting: checks that fail early with one clear line, then the serving loop.

Order of work:
  1. check the mountpoint (unmounting a stale bucketfs mount a dead daemon left) and
     /dev/fuse (nothing started yet);
  2. build the backend; open the SSD tier (RAM only, with a warning, if unwritable) and
     the tree's index (the SSD tier's, else a temporary one);
  3. prove access: a LIST, or with listings saved by an earlier mount a HEAD of an
     object they name; list the root;
  4. start hinted prefetch (unless prefetch_window is 0); pyfuse3.init mounts; from
     here on every exit path unmounts; with data_processes, start them on the
     connection (mount_data.py) and wait until they serve; listen on the hints socket,
     which also answers
     `bucketfs status` and `bucketfs warm` (if that fails, a warning: the mount serves
     without them);
  5. tell the waiting parent we are ready; serve until unmounted or signalled.
Teardown: unmount, stop the data processes (each flushes to its shard), flush what only
RAM (or the write queue) holds to SSD, save the cache counters, close the index (and
delete a temporary one).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import grp
import logging
import math
import os
import signal
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pyfuse3
import trio

from bucketfs import fs_dispatch, huge_buffers, huge_pages
from bucketfs.backends import open_backend
from bucketfs.backends.base import Backend, BackendError, NotFound
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.store import ObjectStore
from bucketfs.backends.urls import BucketUrl, parse_bucket_url
from bucketfs.cache.admin import save_counters
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import CacheDirError, CacheDirUnwritable, DiskTier
from bucketfs.cache.hinted_victims import HintedVictims
from bucketfs.cache.ram import RamTier
from bucketfs.cache.shared import SharedTier
from bucketfs.cache.shared_names import Dataset
from bucketfs.cache.shared_store import SharedError, SharedStore
from bucketfs.cache.tier import CacheEvents
from bucketfs.cache.tiered import BlockCache
from bucketfs.config import Config, options_for_other_buckets
from bucketfs.data_jobs import merged
from bucketfs.dispatch import DataProcesses
from bucketfs.fs import PATCHED_PYFUSE3, Operations
from bucketfs.fs_dispatch import DispatchingOperations
from bucketfs.hints.location import socket_path
from bucketfs.hints_server import HintsServerError, serve_hints
from bucketfs.loop_load import ServingLoad
from bucketfs.metrics import build_registry, start_metrics_server
from bucketfs.mount_data import (
    DataProcessError,
    data_setups,
    refuse_warm,
    start_data_processes,
)
from bucketfs.namespace import Namespace
from bucketfs.prefetch.eviction import EvictionPolicy, make_policy
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.private import UnsafePath
from bucketfs.reader import ByteBudget, Reader, ReadSettings
from bucketfs.runtime import (
    FSTYPE,
    clear_pid,
    mounted,
    prepare_state_dir,
    stale,
    unmount,
    write_pid,
)
from bucketfs.spare_buffers import spare_buffers
from bucketfs.status import MountStatus, facts_of
from bucketfs.tasks import describe, start_guarded
from bucketfs.warm import WarmJobs
from bucketfs.workers import in_worker

log = logging.getLogger(__name__)

# At mount time an unreachable endpoint or a broken credential should be reported in
# seconds, not after the full read-time retry budget.
MOUNT_CHECK_RETRY = RetryPolicy(attempts=3, base_delay=0.2, max_delay=1.0)
#: At unmount, how long the blocks still queued for the shared tier may hold it up.
SHARED_DRAIN_S = 10.0


class MountError(Exception):
    """Mounting cannot proceed; the message is the one line the user sees."""


def check_mountpoint(path: str) -> str:
    """Return the real path of a usable mountpoint, or raise MountError saying why not."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise MountError(f"mountpoint {path} does not exist") from None
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise MountError(f"mountpoint {path}: {exc.strerror}") from None
    real = os.path.realpath(path)
    entry = mounted(real)
    if entry is not None and stale(real):
        _clear_stale(path, real, entry.fstype)
        entry = mounted(real)
    if entry is not None:
        raise MountError(f"mountpoint {path} is already mounted ({entry.fstype} from "
                         f"{entry.source})")
    if not os.path.isdir(real):
        raise MountError(f"mountpoint {path} is not a directory")
    try:
        if os.listdir(real):
            raise MountError(f"mountpoint {path} is not empty")
    except PermissionError:
        raise MountError(f"mountpoint {path} is not readable") from None
    return real


def _clear_stale(path: str, real: str, fstype: str) -> None:
    """A bucketfs mount whose daemon is gone (killed, crashed) is unmounted lazily, so
    the new mount replaces it; another filesystem's is left to the user."""
    fix = f"run: fusermount3 -uz {path}"
    if fstype != FSTYPE:
        raise MountError(f"mountpoint {path} is a stale {fstype} mount whose daemon is "
                         f"gone; {fix}")
    result = unmount(real, lazy=True)
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip().splitlines()
        raise MountError(f"mountpoint {path} is a stale mount whose daemon is gone and "
                         f"unmounting it failed ({reason[-1] if reason else 'unknown'}); "
                         f"{fix}")
    log.warning("mountpoint %s was a stale bucketfs mount whose daemon is gone; "
                "unmounted it", path)


def check_fuse_device() -> None:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        raise MountError(f"cannot open /dev/fuse ({exc.strerror}): is the fuse module loaded? "
                         "in a container, pass --device /dev/fuse") from None
    os.close(fd)


def backend_settings(config: Config) -> BackendSettings:
    return BackendSettings(
        max_connections=config.max_connections,
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        endpoint_url=config.endpoint_url,
        region=config.region,
        addressing_style=config.addressing_style,
        profile=config.profile,
        s3_unsigned=not config.sign_request,
        s3_requester_pays=config.requester_pays,
        gcs_project=config.project,
        gcs_anonymous=config.anonymous,
        gcs_billing_project=config.billing_project,
    )


def open_shared_store(config: Config) -> SharedStore:
    """The shared tier's bucket, reached with the origin's credentials, region and
    addressing style, at its own endpoint if one is given; signed even where the origin
    is a public bucket read unsigned (the tier writes), and paying as its owner."""
    settings = dataclasses.replace(
        backend_settings(config), s3_unsigned=False, s3_requester_pays=False,
        endpoint_url=config.shared_endpoint_url or config.endpoint_url)
    return SharedStore(config.shared, settings, timeout=config.shared_timeout)


def shared_overlap(url: BucketUrl, config: Config) -> str | None:
    """Why the shared tier cannot be where it is, or None: inside the mounted prefix
    (the mount would list its blocks), or holding the mount (it would cache itself)."""
    shared = parse_bucket_url(config.shared)
    same_store = config.shared_endpoint_url in (None, config.endpoint_url)
    if url.scheme != "s3" or shared.bucket != url.bucket or not same_store:
        return None
    if shared.prefix.startswith(url.prefix) or url.prefix.startswith(shared.prefix):
        return (f"the shared tier {shared} overlaps the mount {url}: give it a bucket "
                "or a prefix of its own")
    return None


def fuse_options(url: BucketUrl, config: Config) -> set[str]:
    options = set(pyfuse3.default_options)
    options |= {"ro", f"fsname={url}", f"subtype={FSTYPE.split('.', 1)[1]}"}
    if config.allow_other:
        options.add("allow_other")
    return options


@dataclass
class MountInfo:
    url: BucketUrl
    mountpoint: str
    config: Config
    #: How cache entries and listings name the origin (`origin_identity`).
    source: str = ""
    #: The shared tier's bucket (cache.shared), opened by run_mount.
    shared: SharedStore | None = None


def origin_identity(url: BucketUrl, backend: Backend) -> str:
    """The origin as the cache names it: the bucket URL and the endpoint that serves it,
    so that two stores with a bucket of the same name never share cache entries."""
    endpoint = getattr(backend, "endpoint", "")
    return f"{url.bucket_url} via {endpoint}" if endpoint else url.bucket_url


def _kernel_ttl(config: Config) -> float:
    ttl = min(config.kernel_ttl, config.metadata_ttl)
    return ttl if math.isfinite(ttl) else 365 * 24 * 3600.0


async def _serve(
    info: MountInfo, backend: Backend, ready: Callable[[list[str]], None]
) -> None:
    config = info.config
    store = ObjectStore(backend, max_workers=config.max_connections,
                        retry=retry_policy(config), page_size=config.list_page_size)
    warnings: list[str] = []
    if unused := options_for_other_buckets(config, info.url.scheme):
        warnings.append(f"{', '.join(unused)}: for another kind of bucket; nothing for "
                        f"{info.url}")
    info.source = origin_identity(info.url, backend)
    if config.data_processes:
        if not fs_dispatch.supported():  # before anything is set up for them
            raise MountError("data_processes: needs the pyfuse3 that `make venv` builds "
                             "(packaging/pyfuse3/build.py)")
        warnings.append(f"data_processes {config.data_processes}: hints, packing, warm and "
                        "the shared tier are off with data processes (for now)")
        info.shared = None
    # The plans come first: both tiers' hinted eviction reads them.
    hints = _Hints.make(config) if config.prefetch_window > 0 and \
        not config.data_processes else None
    disk = open_disk_tier(info, config, warnings, hints)
    try:
        await _serve_with(info, store, disk, hints, ready, warnings)
    finally:
        if disk is not None:
            disk.close()


async def _check_access(backend: Backend, namespace: Namespace) -> None:
    """Prove the credentials and the bucket before mounting. With listings kept from an
    earlier mount, a HEAD of an object they name does it without a LIST."""
    checker = ObjectStore(backend, max_workers=1, retry=MOUNT_CHECK_RETRY)
    probe = namespace.any_file_key()
    try:
        if probe is not None:
            try:
                await checker.head(probe)
                await checker.locate()  # as check_access does
                return
            except NotFound:
                pass  # the saved listing is out of date there; ask the bucket itself
        await checker.check_access()
    except BackendError as exc:
        raise MountError(str(exc)) from None


async def _serve_with(
    info: MountInfo, store: ObjectStore, disk: DiskTier | None, hints: _Hints | None,
    ready: Callable[[list[str]], None], warnings: list[str],
) -> None:
    config = info.config
    namespace = Namespace(store, info.url.prefix, metadata_ttl=config.metadata_ttl,
                          index=disk.index if disk is not None else None,
                          space=info.source, on_gone=_kernel_forgets_name)
    try:
        await _serve_namespace(info, store, disk, hints, namespace, ready, warnings)
    finally:
        namespace.close()


async def _serve_namespace(
    info: MountInfo, store: ObjectStore, disk: DiskTier | None, hints: _Hints | None,
    namespace: Namespace, ready: Callable[[list[str]], None], warnings: list[str],
) -> None:
    config = info.config
    if config.refresh:
        namespace.forget_listings()
    await _check_access(store.backend, namespace)
    try:
        if not await namespace.children(namespace.root.inode):
            warnings.append(f"{info.url} names no objects: the mount is empty")
    except BackendError as exc:
        raise MountError(str(exc)) from None
    hints_gid = hints_group(config)
    kernel_opens = config.kernel_opens and PATCHED_PYFUSE3
    if config.kernel_opens and not PATCHED_PYFUSE3:
        log.info("this pyfuse3 lacks bucketfs's patch (packaging/pyfuse3/build.py): the "
                 "daemon answers every open, and kernel_opens is off")
    async with trio.open_nursery() as nursery:
        ram_policy = eviction_policy(config)
        if hints is not None:  # evict what the plans read farthest ahead
            ram_policy = HintedPolicy(ram_policy, hints.next_use, key_of=_file_of_block)
        shared = None if info.shared is None else SharedTier(
            info.shared, Dataset(info.source, str(info.url), info.url.prefix,
                                 config.block_size), nursery,
            max_object=config.shared_max_object, write_queue=config.shared_write_queue,
            connections=config.max_connections)
        cache = BlockCache(
            store, RamTier(config.ram_cache, ram_policy, CacheEvents()),
            disk, block_size=config.block_size, nursery=nursery, shared=shared,
        )
        # Fewer than the origin's connections, so a reader's own miss always finds one.
        connections = min(config.prefetch_connections, max(1, config.max_connections - 2))
        prefetch = None if hints is None else HintedPrefetch(
            namespace, cache, hints.scheduler, connections=connections,
            block_size=config.block_size)
        reader = Reader(
            cache, ByteBudget(config.readahead_budget),
            ReadSettings(readahead_max=config.readahead_max), nursery,
            on_open=None if prefetch is None else prefetch.observed_open,
        )
        if prefetch is not None:
            await nursery.start(prefetch.run)
        load = ServingLoad()  # this is the thread that answers every request
        # With data processes, they read; this process's cache and reader stay idle.
        data = None if not config.data_processes else DataProcesses(
            data_setups(str(info.url), info.source, config, disk,
                        group_id(config, "cache_group")), -1)
        status = MountStatus(facts_of(info.url, info.mountpoint, config, store,
                                     kernel_opens=kernel_opens), cache,
                             store, reader, prefetch,
                             WarmJobs(namespace, cache, nursery, connections=connections),
                             load, data)
        start_guarded(nursery, "sampling the origin's throughput and the CPU", status.run)
        huge_buffers.choose(config.huge_buffers)
        # A read-ahead window's evictions come back together: keep that many spare.
        spare_buffers.limit = config.readahead_max
        start_guarded(nursery, "letting spare block buffers go",
                      spare_buffers.let_go_when_idle)
        if shared is not None:
            start_guarded(nursery, "describing the dataset in the shared tier",
                          shared.announce)
        if config.metrics_port:
            try:
                start_metrics_server(config.metrics_port, config.metrics_address,
                                     build_registry(cache, store, reader, prefetch, load,
                                                    data))
            except OSError as exc:
                raise MountError(f"cannot serve metrics on {config.metrics_address}:"
                                 f"{config.metrics_port}: {exc.strerror}") from None
        options = dict(uid=os.getuid() if config.uid is None else config.uid,
                       gid=os.getgid() if config.gid is None else config.gid,
                       kernel_ttl=_kernel_ttl(config), kernel_opens=kernel_opens,
                       max_background=config.kernel_background if PATCHED_PYFUSE3 else 0)
        try:
            operations = Operations(namespace, reader, **options) if data is None else \
                DispatchingOperations(namespace, reader, data, nursery.start_soon, **options)
        except ValueError as exc:
            raise MountError(f"data_processes: {exc}") from None
        try:
            pyfuse3.init(operations, info.mountpoint, fuse_options(info.url, config))
        except RuntimeError as exc:
            raise MountError(f"cannot mount on {info.mountpoint}: {exc}") from None
        try:
            write_pid(info.mountpoint)
            if data is not None:
                try:
                    await start_data_processes(nursery, data)
                except DataProcessError as exc:
                    raise MountError(str(exc)) from None
            await _serve_hints(nursery, info.mountpoint, prefetch, status, hints_gid,
                               warnings)
            log.info("mounted %s on %s", info.url, info.mountpoint)
            for warning in warnings:
                log.warning(warning)
            ready(warnings)
            nursery.start_soon(_stop_on_signal)
            start_guarded(nursery, "raising the kernel's read-ahead",
                          _set_kernel_readahead, info.mountpoint, config.kernel_readahead)
            # What start-up made (modules, the SDKs' tables: most of the heap) lives until
            # exit; frozen, the collector's full passes during reads no longer walk it.
            gc.freeze()
            # Returns when the kernel ends the session (fusermount -u) or a signal
            # calls terminate(); unmounting an already unmounted path is harmless, and
            # a crash must not leave a stale mount behind.
            # As many request workers stay as were ever needed (min_tasks = max_tasks):
            # with pyfuse3's default of one idle worker, the pool shrank and grew
            # all the time under concurrent readers, and each worker that came and went
            # mapped and unmapped its 1 MiB request buffer (0.63 pairs per cold file,
            # each unmap a TLB shootdown; docs/BENCHMARKS.md, step 20). An idle worker
            # waits on pyfuse3's read lock. Only the pages of its buffer that requests
            # touched are resident: a page or two for a READ or LOOKUP, at most 1 MiB
            # after a large batch of FORGETs, so at most `workers` MiB in all.
            workers = max(16, 2 * config.max_connections)
            await pyfuse3.main(min_tasks=workers, max_tasks=workers)
        finally:
            pyfuse3.close(unmount=True)
            clear_pid(info.mountpoint)
        log.info("unmounted %s", info.mountpoint)
        if data is not None:  # each flushes its RAM tier to its shard and exits
            await data.close()
        status.warm.cancel_all("unmounted")  # a warm job must not hold the flush up
        if shared is not None:  # what this node read last is for the next node too
            await shared.drain(SHARED_DRAIN_S)
        # A clean exit keeps what only RAM held, so the next mount finds it on SSD.
        try:
            await cache.flush()
            if disk is not None and disk.writable:
                save_counters(disk.index, dataclasses.asdict(cache.stats if data is None
                              else merged(cache.stats, data.counts(), "cache_")))
        except Exception as exc:  # a full or read-only disk: the next mount recounts
            log.warning("could not save the cache's state at unmount: %s", describe(exc))
        nursery.cancel_scope.cancel()


@dataclass(frozen=True, slots=True)
class _Hints:
    """The hinted orders' plans, and their next uses as both tiers' eviction reads them."""

    scheduler: PrefetchScheduler
    next_use: NextUse

    @classmethod
    def make(cls, config: Config) -> _Hints:
        # Prefetched bytes wait in RAM for their reader: they must not crowd out the rest.
        room = max(1, config.ram_cache // 2)
        scheduler = PrefetchScheduler(
            window_bytes=max(1, min(config.prefetch_window, room)),
            budget_bytes=max(1, min(config.prefetch_budget, room)))
        return cls(scheduler, NextUse(scheduler))


def hints_group(config: Config) -> int | None:
    return group_id(config, "hints_group")


def group_id(config: Config, option: str) -> int | None:
    """The gid a group option names, or None. A group that does not exist is a mount
    error."""
    group = getattr(config, option)
    if group is None:
        return None
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise MountError(f"{option}: no group named {group!r}") from None


async def _serve_hints(nursery: trio.Nursery, mountpoint: str,
                       prefetch: HintedPrefetch | None, status: MountStatus,
                       gid: int | None, warnings: list[str]) -> None:
    """Listen on the mount's hints socket (hints when prefetch is on; status always,
    warm without data processes); if that fails, the mount serves without."""
    try:
        await nursery.start(functools.partial(
            serve_hints, socket_path(mountpoint), owner_uid=os.geteuid(), allowed_gid=gid,
            on_order=None if prefetch is None else prefetch.on_order,
            on_end=None if prefetch is None else prefetch.on_end,
            on_status=status.snapshot,
            on_warm=status.warm.start if status.data is None else refuse_warm,
            on_cancel=status.warm.cancel))
    except HintsServerError as exc:
        warnings.append(f"hints, status and warm are off: {exc}")


def _kernel_forgets_name(parent: int, name: str) -> None:
    """The kernel drops what it cached of a name that stands for another inode now (a
    changed or deleted object), so the next open looks it up again. Queued to pyfuse3's
    own thread: never from inside a handler."""
    try:
        pyfuse3.invalidate_entry_async(parent, os.fsencode(name), ignore_enoent=True)
    except Exception as exc:  # not mounted (any more): the kernel caches nothing
        log.debug("cannot invalidate %r: %s", name, exc)


def _file_of_block(block: Hashable) -> Hashable:
    return block.key if isinstance(block, BlockId) else block


def retry_policy(config: Config) -> RetryPolicy:
    """The mount's one retry policy for reads (its data processes' too)."""
    return RetryPolicy(config.retry_attempts, config.retry_base_delay,
                       config.retry_max_delay)


def eviction_policy(config: Config) -> EvictionPolicy:
    return make_policy(config.eviction, cooldown=config.eviction_cooldown)


def open_disk_tier(info: MountInfo, config: Config, warnings: list[str],
                   hints: _Hints | None = None) -> DiskTier | None:
    """The SSD tier, or None: without a cache_dir, or (with a warning) when the directory
    cannot take writes. A directory another mount holds is an error. With hints, its
    victims are chosen by their next use, from a few candidates per victim."""
    if config.cache_dir is None:
        return None
    hinted = None if hints is None else HintedVictims(hints.next_use.distance,
                                                      hints.next_use.plans)
    try:
        disk = DiskTier(
            config.cache_dir, config.disk_cache, eviction_policy(config),
            source=info.source, block_size=config.block_size,
            free_floor=config.disk_free_floor, group=group_id(config, "cache_group"),
            hinted=hinted,
        )
        warnings.extend(disk.warnings)
        return disk
    except CacheDirUnwritable as exc:
        warnings.append(f"{exc}; caching in RAM only")
        return None
    except CacheDirError as exc:
        raise MountError(str(exc)) from None


async def _stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s; unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def _set_kernel_readahead(mountpoint: str, size: int) -> None:
    """The kernel reads ahead 128 KiB by default, so a big file arrives in many small FUSE
    requests, each a trip into Python. Only root may raise it; others keep the default."""
    # The kernel sets the value when the FUSE INIT handshake completes, so change it only
    # after a request has gone through (in a thread: this loop must serve the request).
    try:
        await in_worker(os.statvfs, mountpoint)
    except OSError as exc:  # unmounted meanwhile
        log.debug("kernel read-ahead left at its default (%s)", exc.strerror)
        return
    entry = mounted(mountpoint)
    if entry is None:
        return
    path = f"/sys/class/bdi/{entry.device}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(max(4, size // 1024)))
    except OSError as exc:
        log.debug("kernel read-ahead left at its default (%s: %s)", path, exc.strerror)


def run_mount(info: MountInfo, ready: Callable[[list[str]], None]) -> None:
    """Mount and serve until unmounted. Raises MountError for anything the user must fix.
    `ready` is called once the mount serves, with warnings for the user."""
    info.mountpoint = check_mountpoint(info.mountpoint)
    check_fuse_device()
    huge_pages.return_freed_blocks_to_the_system()
    try:
        prepare_state_dir(info.mountpoint, hints_group(info.config))
    except (UnsafePath, OSError) as exc:
        raise MountError(f"cannot use the mount's state directory: {exc}") from None
    try:
        backend = open_backend(info.url, backend_settings(info.config))
    except BackendError as exc:
        raise MountError(str(exc)) from None
    if info.config.shared is not None:
        overlap = shared_overlap(info.url, info.config)
        if overlap:
            backend.close()
            raise MountError(overlap)
        try:
            info.shared = open_shared_store(info.config)
        except SharedError as exc:
            backend.close()
            raise MountError(str(exc)) from None
    try:
        trio.run(_serve, info, backend, ready)
    except* MountError as group:
        raise group.exceptions[0] from None
    finally:
        backend.close()
