"""An SSD-served epoch of small files, with and without chunk packing:

    python -m bench.packing [--files 2000] [--rounds 5] [--threads 1] [--next-epoch]
                            [--fill-ram 128MiB]

Makes a file:// bucket of FILES files of 80-140 KB, fills two cache directories (one
with a hinted order, so its files are packed into chunks; one without, where the
write-through stores them in chunks in the order they were fetched) through a RAM tier
of FILL_RAM, smaller than the files (one that holds them all serves the next epoch
itself, and the daemon lays nothing out on SSD for it), then, ROUNDS
times and alternating the two so drift hits both alike: mount, drop the page cache,
read every file in the hinted order with THREADS threads, and time it. Every round
must make 0 GETs (the cache serves everything). Needs root (drop_caches, FUSE).

With --next-epoch the timed epoch is the next one, in another shuffled order, and
three caches are filled by reading the hinted epoch: without hints (write-through
chunks in fetch order); packed in that
epoch's read order (the daemon's guess when the next order is unknown); packed in the
next epoch's order, announced while the hinted epoch was read (`send_next_order`, as
HintSampler does for a DistributedSampler).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from bucketfs.hints import send_next_order, send_order
from tests.mounting import mounted
from tests.servers import free_ports
from tests.test_fuse_hints import metrics

N = ROUNDS = THREADS = 0
FILL_RAM = ""  # the RAM tier of the mounts that fill the caches
NEXT_EPOCH = False
BASE = Path()
SSD_HITS = 'bucketfs_cache_hits_total{tier="ssd"}'


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_all(mnt: Path, order: list[str]) -> int:
    if THREADS == 1:
        return sum(len((mnt / k).read_bytes()) for k in order)
    it = iter(order)

    def worker() -> int:
        return sum(len((mnt / k).read_bytes()) for k in it)

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(lambda _: worker(), range(THREADS)))


def wait(port: int, pred, timeout: float = 120) -> dict:
    end = time.monotonic() + timeout
    while True:
        v = metrics(port)
        if pred(v) or time.monotonic() > end:
            return v
        time.sleep(0.1)


def settled(port: int, counter: str, quiet_s: float = 1.0, timeout: float = 120) -> dict:
    """The metrics once `counter` has not moved for `quiet_s` and nothing waits to be
    written to SSD."""
    end = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        v = metrics(port)
        if v[counter] != last or v["bucketfs_cache_write_queue_bytes"]:
            last, since = v[counter], time.monotonic()
        elif time.monotonic() - since >= quiet_s or time.monotonic() > end:
            return v
        time.sleep(0.1)


def main() -> None:
    global N, ROUNDS, THREADS, NEXT_EPOCH, BASE, FILL_RAM
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--next-epoch", action="store_true",
                        help="time a shuffled next epoch: no hints, packed in the read "
                             "order, packed in the announced next order")
    parser.add_argument("--fill-ram", default="128MiB",
                        help="the RAM tier of the mounts that fill the caches: smaller "
                             "than the files, or nothing is laid out on SSD")
    args = parser.parse_args()
    N, ROUNDS, THREADS, NEXT_EPOCH = args.files, args.rounds, args.threads, args.next_epoch
    FILL_RAM = args.fill_ram
    BASE = Path(tempfile.mkdtemp(prefix="bucketfs-packing-"))
    try:
        run()
    finally:
        shutil.rmtree(BASE, ignore_errors=True)


def run() -> None:
    bucket = BASE / "bucket"
    rng = random.Random(1)
    keys = []
    for i in range(N):
        key = f"train/c{i % 20:02d}/{i:05d}.jpg"
        (bucket / key).parent.mkdir(parents=True, exist_ok=True)
        (bucket / key).write_bytes(rng.randbytes(rng.randrange(80, 141) * 1024))
        keys.append(key)
    total = sum((bucket / k).stat().st_size for k in keys)
    order = list(keys)
    random.Random(2).shuffle(order)
    # The timed epoch: the hinted one again, or (--next-epoch) the next, reshuffled.
    timed = list(order)
    if NEXT_EPOCH:
        random.Random(3).shuffle(timed)
    url = f"file://{bucket}"
    port = free_ports(1)[0]
    setups = {}
    names = ("no-hints", "read-order", "next-order") if NEXT_EPOCH \
        else ("no-hints", "packed")
    for name in names:
        cache = BASE / f"cache-{name}"
        args = ("--cache-dir", str(cache), "--disk-free-floor", "0", "--metrics-port", str(port))
        # Filled through a RAM tier smaller than the files, as on a node whose dataset
        # outgrows it: a RAM tier that holds them all serves the next epoch itself, and
        # nothing is laid out on SSD for it (bucketfs/packer.py).
        with mounted(url, BASE / "mnt", *args, "--ram-cache", FILL_RAM) as mnt:
            if name != "no-hints":
                send_order([str(mnt / k) for k in order], epoch=0, job="bench", strict=True,
                           next_follows=name == "next-order")
                wait(port, lambda v: v.get("bucketfs_hints_files", 0) > 0)
            if name == "next-order":
                send_next_order([str(mnt / k) for k in timed], epoch=1, job="bench",
                                strict=True)
            read_all(mnt, order)
            if name != "no-hints":
                # The next epoch starts: what is left of this one's layout is packed.
                send_order([str(mnt / k) for k in timed], epoch=1, job="bench", strict=True)
                # Packed bytes count the write-through's chunks too: wait for the packer
                # to stop writing (its counter still for a second).
                v = settled(port, "bucketfs_packing_chunks_written_total")
                print(f"{name}: {v['bucketfs_cache_ssd_chunks']:.0f} chunks, "
                      f"{v['bucketfs_cache_ssd_packed_bytes'] / 2**20:.1f} MiB packed",
                      flush=True)
            wait(port, lambda v: v["bucketfs_cache_write_queue_bytes"] == 0)
        setups[name] = args
    print(f"{N} files, {total / 2**20:.1f} MiB, {THREADS} reader thread(s), timed epoch: "
          f"{'the next, reshuffled' if NEXT_EPOCH else 'the hinted order again'}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(ROUNDS):
        for name, args in setups.items():  # alternate, so drift hits all alike
            with mounted(url, BASE / "mnt", *args) as mnt:
                drop_caches()
                began = time.perf_counter()
                assert read_all(mnt, timed) == total
                elapsed = time.perf_counter() - began
                v = metrics(port)
            assert v['bucketfs_origin_requests_total{kind="get"}'] == 0
            times[name].append(elapsed)
            print(f"  {name:12s} {elapsed:6.2f} s  {total / 2**20 / elapsed:7.1f} MiB/s  "
                  f"ssd hits {v[SSD_HITS]:.0f}  "
                  f"chunk reads {v['bucketfs_cache_ssd_chunk_reads_total']:.0f}", flush=True)
    for name, values in times.items():
        values.sort()
        print(f"{name:12s} median {values[len(values) // 2]:.2f} s "
              f"({total / 2**20 / values[len(values) // 2]:.1f} MiB/s), "
              f"all {', '.join(f'{t:.2f}' for t in values)}")


if __name__ == "__main__":
    main()
