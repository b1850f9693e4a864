"""Chunk packing end to end: a real mount of a file:// bucket with an SSD cache reads a
hinted order, packs what it read into chunk files in that order, and after a remount
serves the epoch from the chunks with one read per chunk; a DataLoader whose
HintSampler announces the next epoch has what it reads laid out in that next order; a
kill -9 while chunks are being written never costs a wrong byte."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import DatasetFolder

from bucketfs.hints import HintSampler, send_order
from bucketfs.packer import layout_tag
from bucketfs.prefetch.layout import DEFAULT_CHUNK_BYTES, plan_chunks
from tests.crashing import open_index
from tests.mounting import (
    bucketfs,
    daemon_pid,
    drop_page_cache,
    force_unmount,
    metrics,
    mounted,
)
from tests.servers import free_ports
from tests.test_packing_next_epoch import chunk_layouts, follows

pytestmark = [pytest.mark.fuse, pytest.mark.root]

KiB = 1024
COUNT = 240
#: A RAM tier smaller than the bucket's ~26 MB: the next epoch reads SSD, so it is
#: laid out there (a RAM tier that holds every file makes packing pointless).
SMALL_RAM = ("--ram-cache", "16MiB")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    """A file:// bucket of ~110 KB files: its URL and its objects."""
    root = tmp_path_factory.mktemp("packed-bucket")
    rng = random.Random(4)
    files = {f"train/c{i % 3}/{i:04d}.jpg": rng.randbytes(rng.randrange(60, 160) * KiB)
             for i in range(COUNT)}
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return f"file://{root}", files



def indexed_chunks(cache: Path) -> list:
    """`chunk_layouts` of the cache's index, read after its mount is gone."""
    index = open_index(cache)
    try:
        return chunk_layouts(index)
    finally:
        index.close()

def wait_for(port: int, ready: Callable[[dict[str, float]], bool],
             timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(port)
        if ready(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def hint(mnt: Path, order: list[str], epoch: int, port: int) -> None:
    orders = metrics(port).get("bucketfs_hints_orders_total", 0)
    assert send_order([str(mnt / key) for key in order], epoch=epoch, job="packing-test",
                      strict=True)
    # Installed once the plan lists the files (the daemon resolves the paths first).
    values = wait_for(port, lambda v: v["bucketfs_hints_orders_total"] > orders
                      and v["bucketfs_hints_files"] >= len(order) - 64)
    assert values["bucketfs_hints_files"] > 0


def read_in_order(mnt: Path, files: dict[str, bytes], order: list[str]) -> None:
    for key in order:
        assert (mnt / key).read_bytes() == files[key], key


def test_a_hinted_epoch_is_packed_in_read_order_and_served_from_chunks(bucket, tmp_path):
    url, files = bucket
    order = list(files)
    random.Random(8).shuffle(order)
    total = sum(map(len, files.values()))
    port = free_ports(1)[0]
    args = ("--cache-dir", str(tmp_path / "cache"), "--disk-free-floor", "0",
            "--metrics-port", str(port), *SMALL_RAM)
    with mounted(url, tmp_path / "mnt", *args) as mnt:
        hint(mnt, order, 0, port)
        # Cold: from the bucket, into the write-through's chunks in the order fetched.
        # No next order is known: laying them out by this one would be a guess.
        read_in_order(mnt, files, order)
        ssd = 'bucketfs_cache_used_bytes{tier="ssd"}'
        cold = wait_for(port, lambda v: v[ssd] == total)
        assert cold[ssd] == total
        # Most in write-through chunks (a batch of one block is a block file).
        assert cold["bucketfs_cache_ssd_packed_bytes"] >= total / 2
        assert cold["bucketfs_packing_chunks_written_total"] == 0
        hint(mnt, order, 1, port)  # the same order again: the guess proved right
        drop_page_cache()
        read_in_order(mnt, files, order)  # packed as read, from the SSD tier
        hint(mnt, order, 2, port)  # and again: the last chunk is packed now
        most = total / (4 * 1024**2) + 2
        # Done when every chunk left is one the packer wrote: while it still writes,
        # the write-through's chunks it empties go one by one.
        packed = wait_for(port, lambda v: v["bucketfs_cache_ssd_chunks"] <= most
                          and v["bucketfs_packing_chunks_written_total"]
                          >= v["bucketfs_cache_ssd_chunks"])
        assert packed["bucketfs_cache_ssd_packed_bytes"] == total
        chunks = packed["bucketfs_cache_ssd_chunks"]  # the write-through's emptied, gone
        assert total / (4 * 1024**2) <= chunks <= most
        assert packed["bucketfs_packing_chunks_written_total"] >= chunks
        drop_page_cache()
        read_in_order(mnt, files, order)
        third = metrics(port)
        # Already laid out in this order: nothing written again.
        assert third["bucketfs_cache_ssd_chunks"] == chunks
        assert third["bucketfs_cache_ssd_packed_bytes"] == total
        assert third['bucketfs_origin_requests_total{kind="get"}'] == COUNT
    stats = bucketfs("cache", "stats", str(tmp_path / "cache"))
    assert stats.returncode == 0 and f"{COUNT} entries packed" in stats.stdout
    assert not list((tmp_path / "cache/data").rglob("*.blk"))  # every file moved

    # After a remount (RAM empty, page cache dropped) the epoch comes from the chunks:
    # one pread per chunk brings the files after the first into RAM.
    with mounted(url, tmp_path / "mnt", *args) as mnt:
        drop_page_cache()
        read_in_order(mnt, files, order)
        remounted = metrics(port)
    assert remounted['bucketfs_origin_requests_total{kind="get"}'] == 0
    assert remounted["bucketfs_cache_ssd_chunks"] == chunks
    assert 0 < remounted["bucketfs_cache_ssd_chunk_reads_total"] <= chunks + 2
    assert remounted['bucketfs_cache_hits_total{tier="ssd"}'] \
        == remounted["bucketfs_cache_ssd_chunk_reads_total"]
    assert remounted['bucketfs_cache_hits_total{tier="ram"}'] >= COUNT - chunks - 2


def read_bytes(path: str) -> bytes:
    # Workers start reading as the sampler sends the order, before the daemon has
    # resolved it: the daemon replays those first opens into the plan.
    return Path(path).read_bytes()


def test_an_epoch_is_laid_out_in_the_order_the_sampler_will_read_next(bucket, tmp_path):
    url, files = bucket
    total = sum(map(len, files.values()))
    port = free_ports(1)[0]
    cache = tmp_path / "cache"
    args = ("--cache-dir", str(cache), "--disk-free-floor", "0", "--metrics-port", str(port),
            *SMALL_RAM)
    with mounted(url, tmp_path / "mnt", *args) as mnt:
        dataset = DatasetFolder(str(mnt / "train"), loader=read_bytes,
                                extensions=(".jpg",))

        def keys(epoch: int) -> list[str]:
            """The files a DistributedSampler reads in `epoch`, as bucket keys."""
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True,
                                         seed=21)
            sampler.set_epoch(epoch)
            return [str(Path(dataset.samples[i][0]).relative_to(mnt)) for i in sampler]

        sampler = HintSampler(DistributedSampler(dataset, num_replicas=1, rank=0,
                                                 shuffle=True, seed=21), dataset)
        loader = DataLoader(dataset, sampler=sampler, batch_size=8, num_workers=2,
                            collate_fn=list)
        sampler.set_epoch(0)
        read = [data for batch in loader for data, _ in batch]
        epoch_0, epoch_1 = keys(0), keys(1)
        assert read == [files[key] for key in epoch_0]
        # A chunk planned by epoch 1's order is written once all its files were read:
        # every chunk, during epoch 0 (nothing flushed them: no epoch 1 order was sent).
        # Packed bytes alone say nothing: the write-through's chunks count in them too.
        planned = len(plan_chunks(((key, len(files[key])) for key in epoch_1),
                                  chunk_bytes=DEFAULT_CHUNK_BYTES))
        packed = wait_for(port, lambda v: v["bucketfs_cache_ssd_packed_bytes"] == total
                          and v["bucketfs_packing_chunks_written_total"] >= planned)
        assert packed["bucketfs_cache_ssd_packed_bytes"] == total
        assert packed["bucketfs_hints_orders_total"] == 1  # the announcement is not one
    chunks = indexed_chunks(cache)
    assert sorted(key for _, members in chunks for key in members) == sorted(files)
    assert follows(chunks, epoch_1), "each chunk holds a run of epoch 1's order"
    assert not follows(chunks, epoch_0)
    assert {tag for tag, _ in chunks} == {
        layout_tag((key, len(files[key])) for key in epoch_1)}, "epoch 1's own ORDER's tag"
    assert len(chunks) <= total / (4 * 1024**2) + 2

    # Epoch 1 then comes from the chunks in sequence: one pread per chunk.
    with mounted(url, tmp_path / "mnt", *args) as mnt:
        drop_page_cache()
        read_in_order(mnt, files, epoch_1)
        served = metrics(port)
    assert served['bucketfs_origin_requests_total{kind="get"}'] == 0
    assert served["bucketfs_cache_ssd_chunk_reads_total"] == len(chunks)


@pytest.mark.parametrize("chunks_before_kill", [1, 3])
def test_kill_9_while_packing_then_remount_is_byte_exact(bucket, tmp_path,
                                                         chunks_before_kill):
    url, files = bucket
    order = list(files)
    random.Random(chunks_before_kill).shuffle(order)
    port = free_ports(1)[0]
    cache = tmp_path / "cache"
    args = ("--cache-dir", str(cache), "--disk-free-floor", "0", *SMALL_RAM)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = bucketfs("mount", url, str(mnt), *args, "--metrics-port", str(port))
    assert result.returncode == 0, result.stderr
    pid = daemon_pid(mnt)
    hint(mnt, order, 0, port)
    upcoming = iter(order)  # four readers share the order, as DataLoader workers do

    def reader() -> None:
        for key in upcoming:
            try:
                (mnt / key).read_bytes()
            except OSError:
                return  # the daemon is gone

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        readers = [pool.submit(reader) for _ in range(4)]
        values = wait_for(port, lambda v: v["bucketfs_cache_ssd_chunks"]
                          >= chunks_before_kill)
        os.kill(pid, signal.SIGKILL)
        for future in readers:
            future.result()
    assert values["bucketfs_cache_ssd_chunks"] >= chunks_before_kill
    force_unmount(mnt)  # the stale mount the killed daemon left
    with mounted(url, tmp_path / "mnt2", *args, "--metrics-port", str(port)) as again:
        recovered = metrics(port)
        drop_page_cache()
        read_in_order(again, files, order)
        after = metrics(port)
    assert recovered["bucketfs_cache_ssd_chunks"] >= chunks_before_kill
    assert after["bucketfs_cache_ssd_chunk_reads_total"] > 0  # what was packed is used
    assert not [p for p in (cache / "chunks").iterdir() if p.suffix != ".chk"]
    # Every chunk file is indexed (the unmount's flush may have written more since).
    indexed = len(indexed_chunks(cache))
    assert indexed >= after["bucketfs_cache_ssd_chunks"]
    assert len(list((cache / "chunks").iterdir())) == indexed
