"""What the data path costs, in CPU per file and per GiB, against GET clients alone:

    python -m bench.dataplane [--files 2000] [--file-kb 100] [--large-mib 1024]
                              [--readers 16] [--scale 16,64] [--profile DIR]
                              [--cache-root DIR] [--out DIR]

On loopback SeaweedFS (unshaped), with FILES objects of about FILE_KB in an ImageFolder
layout and one LARGE_MIB object:
  - clients alone, in this process (its CPU from /proc/self/stat): boto3 `get_object`,
    obstore `get`, and s3torchconnector's `S3Client.get_object`, READERS threads;
  - bucketfs, CPU charged to the daemon (/proc/PID/stat, all threads): a cold pass of
    READERS threads doing open/read/close in a shuffled order, with --cache-dir and RAM
    only, and with --cache-dir through a RAM tier a quarter of the files' bytes (a
    dataset larger than RAM: nearly every file admitted evicts one); warm passes from
    the RAM tier (page cache and names dropped; then again with the tree listed first,
    as a dataset scan does) and from the page cache; from the SSD tier (the cache
    directory mounted again, RAM and page cache empty, another shuffled order);
    the cold pass again with hints (the readers' order sent first, as HintSampler
    does; the daemon's CPU taken once it is idle, its packing and prefetch included);
    the page cache again read through os.open() in place of Python's open() (which
    asks the daemon once per file: an IOCTL, for its isatty());
    the same cold and warm passes again with --no-kernel-opens (the daemon answers
    every open, as under a stock pyfuse3);
  - for every pass, the requests the kernel sent the daemon per file, by kind, where
    perf and the kernel's FUSE tracepoints allow (bench/harness/fuse_census.py);
  - a cold sequential read of the large object (dd bs=4M) against 8 parallel 8 MiB
    obstore range GETs: MB/s and CPU-s per GiB; the mount's read twice, as the VM gives
    memory and right after fresh memory was touched (`back_memory` says why); through
    a RAM tier a quarter of its size (each block evicts one, as a dataset larger than
    the RAM budget reads); without an SSD tier, then from the RAM tier alone (the READs'
    cost, no GETs); then again from the SSD tier, its cache directory mounted anew;
  - the scale runs: files/s and MB/s one daemon serves with each reader count of
    --scale, cold and warm, with its CPU per file and per GiB;
  - for every pass, the daemon's CPU by thread (/proc/PID/task/*/stat): its event loop
    (the main thread, where every FUSE request and cache decision runs under the GIL),
    trio's worker threads, and the rest (obstore's runtime, RocksDB, threads that
    exited; harness/procstats.py says how they are told apart). The loop is one core at
    most, so files / loop CPU is the most files/s one daemon can serve however many
    cores the node has (an upper bound: the GIL shared with the workers may cut it);
  - for every pass, the daemon's voluntary context switches per file by the same parts
    (/proc/PID/task/*/status): each a thread that blocked and was woken again, a
    hand-off between threads, a wait for the GIL, for I/O or for work. They are what a
    node with many cores pays most for (a wakeup crosses cores), and they count the
    same on two cores as on sixty-four.
With --profile DIR, py-spy (--gil --native) records the daemon during the cold and warm
passes (raw collapsed stacks, and a summary of the top frames); sampling slows the
daemon, so a profiled run's figures are not the ones to report. The mounts' SSD tiers
go under --cache-root (default: the system's temporary directory). Where one disk holds
them and SeaweedFS's volumes too, as on a VM with one disk, a cold read through an SSD
tier reads each byte from that disk (the server's GET) and writes it there again (the
tier's): the large object's rows with an SSD tier then measure the disk as much as the
daemon; a root on another disk, or tmpfs, takes the tier off it. Needs root (FUSE,
drop_caches). Results: JSON and a markdown table under --out (bench/results).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import unittest.mock
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.dataplane_report import report
from bench.fresh_memory import touch
from bench.harness.fuse_census import Census
from bench.harness.procstats import (
    cpu_seconds,
    self_cpu,
    split_by_thread,
    switches_by_thread,
    thread_cpu,
    thread_switches,
)
from bench.harness.saving import save_results
from bench.harness.tree import this_tree
from bucketfs.hints import send_order
from bucketfs.hints.client import Target
from bucketfs.hints.control import status
from bucketfs.runtime import daemon_pid
from tests.mounting import bucketfs, force_unmount
from tests.servers import S3Server

KiB, MiB, GiB = 1024, 1024**2, 1024**3
BUCKET = "dataplane"


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def back_memory(gib: int) -> float:
    """Touch GIB of fresh memory and free it, so that the host backs it again; returns
    the CPU it took. On a VM whose host takes freed pages back, the first touch of such
    a page costs several times a plain fault (`bench.fresh_memory` measures it), and a
    large read through the daemon needs fresh memory three times over (its RAM tier,
    the SSD file's page cache, the reader's page cache), where a GET client that frees
    each buffer reuses its own. So the large-object row is taken both ways."""
    return sum(touch(gib))


def make_dataset(server: S3Server, files: int, file_kb: int, large_mib: int,
                 ) -> tuple[list[str], str]:
    server.create_bucket(BUCKET)
    rng = random.Random(13)
    keys = [f"train/c{i % 20:02d}/{i:06d}.jpg" for i in range(files)]
    client = server.client()

    def put(key: str) -> None:
        size = int(file_kb * KiB * rng.uniform(0.8, 1.2))
        client.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(size))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))
    large = "large/blob.bin"
    if large_mib:
        # Multipart, as any uploader sends a large object.
        from boto3.s3.transfer import TransferConfig
        with tempfile.NamedTemporaryFile() as tmp:
            chunk = os.urandom(8 * MiB)
            for _ in range(large_mib // 8):
                tmp.write(chunk)
            tmp.flush()
            client.upload_file(tmp.name, BUCKET, large,
                               Config=TransferConfig(multipart_chunksize=64 * MiB))
    return keys, large


def parallel(items: list[str], threads: int, fn: Callable[[str], int]) -> tuple[int, float]:
    """Run fn over items with `threads` threads; (bytes, wall seconds)."""
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(fn, items, chunksize=8))
    return total, time.monotonic() - began


def measure_client(name: str, keys: list[str], threads: int, get: Callable[[str], int],
                   ) -> dict[str, Any]:
    get(keys[0])  # connections, imports, credentials: not per-file cost
    cpu = self_cpu()
    total, wall = parallel(keys, threads, get)
    used = self_cpu() - cpu
    return {"client": name, "files": len(keys), "bytes": total, "wall_s": wall,
            "cpu_s": used, "cpu_ms_per_file": 1000 * used / len(keys),
            "files_per_s": len(keys) / wall}


def clients(server: S3Server, keys: list[str], threads: int) -> list[dict[str, Any]]:
    rows = []
    boto = server.client()
    rows.append(measure_client("boto3 get_object", keys, threads, lambda k: len(
        boto.get_object(Bucket=BUCKET, Key=k)["Body"].read())))
    try:
        import obstore
        from obstore.store import S3Store
        store = S3Store(BUCKET, endpoint=server.endpoint, region=server.region,
                        access_key_id=server.access_key, secret_access_key=server.secret_key,
                        virtual_hosted_style_request=False, client_options={"allow_http": True})
        rows.append(measure_client("obstore get", keys, threads,
                                   lambda k: len(obstore.get(store, k).bytes())))
    except ImportError:
        pass
    try:
        from s3torchconnector._s3client import S3Client, S3ClientConfig
    except ImportError:
        return rows
    # Its CRT client reads the credential chain; the environment is put back after.
    with unittest.mock.patch.dict(os.environ, server.env()):
        s3t = S3Client(region=server.region, endpoint=server.endpoint,
                       s3client_config=S3ClientConfig(force_path_style=True))
        rows.append(measure_client("s3torchconnector get_object", keys, threads,
                                   lambda k: len(s3t.get_object(BUCKET, k).read())))
    return rows


def obstore_large(server: S3Server, key: str, size: int) -> dict[str, Any] | None:
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return None
    store = S3Store(BUCKET, endpoint=server.endpoint, region=server.region,
                    access_key_id=server.access_key, secret_access_key=server.secret_key,
                    virtual_hosted_style_request=False, client_options={"allow_http": True})
    part = 8 * MiB
    starts = list(range(0, size, part))
    cpu, began = self_cpu(), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(lambda s: len(obstore.get_range(
            store, key, start=s, end=min(size, s + part))), starts))
    wall, used = time.monotonic() - began, self_cpu() - cpu
    return {"reader": "obstore 8 x 8 MiB range GETs", "bytes": total, "wall_s": wall,
            "mb_per_s": total / wall / 1e6, "cpu_s_per_gib": used / (total / GiB)}


def read_with_open(path: Path) -> int:
    """As a dataset's loader reads a file (PIL and torchvision use `open()`)."""
    with open(path, "rb") as f:
        return len(f.read())


def read_with_os_open(path: Path) -> int:
    """The same bytes without Python's `open()`: no `isatty()`, so no IOCTL request (as
    Python 3.14's `open()` of a regular file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
        return total
    finally:
        os.close(fd)


class Mount:
    def __init__(self, server: S3Server, mountpoint: Path, args: list[str],
                 prefix: str = "train", tree: Path | None = None) -> None:
        """`tree`: the checkout whose bucketfs the daemon runs (default: this one)."""
        self.server, self.mountpoint, self.args = server, mountpoint, args
        self.prefix = prefix
        self.tree = tree

    def __enter__(self) -> Mount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        result = bucketfs("mount", f"s3://{BUCKET}/{self.prefix}", str(self.mountpoint),
                          "--addressing-style", "path", *self.args,
                          "--log-file", f"{self.mountpoint}.log",
                          env={**self.server.env(), **(
                              this_tree() if self.tree is None
                              else {"PYTHONPATH": str(self.tree)})})
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        self.pid = daemon_pid(str(self.mountpoint.resolve()))
        assert self.pid is not None
        return self

    def __exit__(self, *exc: object) -> None:
        bucketfs("umount", str(self.mountpoint))
        force_unmount(self.mountpoint)

    def list_tree(self, relpaths: list[str]) -> None:
        """List every directory first: the passes time reads, not listings."""
        for directory in sorted({os.path.dirname(rel) for rel in relpaths}):
            os.listdir(self.mountpoint / directory)

    def read_all(self, relpaths: list[str], threads: int,
                 read: Callable[[Path], int] | None = None, *,
                 begin: Callable[[], None] | None = None,
                 idle: bool = False) -> dict[str, Any]:
        """Each file read whole by `read(path)` (Python's `open()` by default), from
        `threads` threads; the daemon's CPU, and the requests the kernel sent it (by
        kind, per file) where this machine can count them (harness/fuse_census.py).
        `begin`: called once the daemon's CPU is taken, before the reads (a hinted
        pass sends its order there, so the prefetch it starts is the pass's cost).
        `idle`: also wait for the daemon to stop using CPU (hinted packing and prefetch,
        which `settle` does not see) before taking its CPU."""
        read = read or read_with_open
        with Census(self.mountpoint) as census:
            cpu, threads_before = cpu_seconds(self.pid), thread_cpu(self.pid)
            switches_before = thread_switches(self.pid)
            if begin is not None:
                begin()
            total, wall = parallel(relpaths, threads, lambda rel: read(self.mountpoint / rel))
            # What the reads left queued (write-through to SSD, read-ahead) is their cost
            # too, not the next pass's: wait for it, then take the CPU.
            self.settle()
            if idle:
                self.idle()
            used = cpu_seconds(self.pid) - cpu
            by_thread = split_by_thread(self.pid, threads_before, thread_cpu(self.pid), used)
            switches = switches_by_thread(self.pid, switches_before,
                                          thread_switches(self.pid))
        return {"files": len(relpaths), "bytes": total, "wall_s": wall,
                "daemon_cpu_s": used, "cpu_ms_per_file": 1000 * used / len(relpaths),
                "cpu_ms_per_file_by_thread": {
                    part: 1000 * seconds / len(relpaths) for part, seconds in by_thread.items()},
                "switches_per_file_by_thread": {
                    part: n / len(relpaths) for part, n in switches.items()},
                "cpu_s_per_gib": used / (total / GiB), "files_per_s": len(relpaths) / wall,
                "mb_per_s": total / wall / 1e6, "threads": threads,
                "requests_per_file": census.per_file(len(relpaths))}

    def send_order(self, relpaths: list[str], *, next_follows: bool = False) -> None:
        """Send the readers' order (epoch 0) as HintSampler does; RuntimeError if the
        daemon refuses it."""
        where = str(self.mountpoint)
        if not send_order([f"{where}/{rel}" for rel in relpaths], epoch=0, mount=where,
                          strict=True, next_follows=next_follows):
            raise RuntimeError("the daemon refused the order")

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the daemon has nothing queued for SSD and nothing read ahead in
        flight (its status, polled every 50 ms)."""
        target = Target(str(self.mountpoint.resolve()), os.getuid())
        if "--data-processes" in self.args:
            time.sleep(1.2)  # their figures in the status are up to a second old
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            report = status(target)
            ssd = [t for t in report["cache"]["tiers"] if t["name"] == "ssd"]
            if (not ssd or not ssd[0]["write_queue_bytes"]) \
                    and not report["prefetch"]["readahead"]["inflight_bytes"]:
                return
            time.sleep(0.05)
        raise RuntimeError("the daemon never settled")

    def idle(self, quiet_s: float = 0.5, timeout: float = 60.0) -> None:
        """Wait until the daemon has used no CPU for `quiet_s` (/proc counts in 10 ms
        ticks; an idle mount uses none)."""
        deadline = time.monotonic() + timeout
        last = cpu_seconds(self.pid)
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            now = cpu_seconds(self.pid)
            if now == last:
                return
            last = now
        raise RuntimeError("the daemon never went idle")

    def dd(self, rel: str) -> dict[str, Any]:
        cpu, began = cpu_seconds(self.pid), time.monotonic()
        subprocess.run(["dd", f"if={self.mountpoint / rel}", "of=/dev/null", "bs=4M"],
                       check=True, capture_output=True)
        wall = time.monotonic() - began
        self.settle()  # the write-through to SSD still queued is this read's CPU too
        used = cpu_seconds(self.pid) - cpu
        size = (self.mountpoint / rel).stat().st_size
        return {"reader": "bucketfs, dd bs=4M", "bytes": size, "wall_s": wall,
                "mb_per_s": size / wall / 1e6, "cpu_s_per_gib": used / (size / GiB)}


class Profiler:
    """py-spy recording the daemon while a pass runs (--gil --native, raw stacks)."""

    def __init__(self, directory: Path | None, pid: int, name: str) -> None:
        self.directory, self.pid, self.name = directory, pid, name
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Profiler:
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            out = self.directory / f"{self.name}.txt"
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(self.pid),
                 "--gil",
                 "--native", "--format", "raw", "--rate", "200", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the pass starts
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.send_signal(2)
            self.process.wait(timeout=60)
            summarize(self.directory / f"{self.name}.txt")  # type: ignore[operator]


def summarize(path: Path, top: int = 25) -> None:
    """Write PATH.summary.txt: the frames where samples were, by self and total share."""
    if not path.exists():
        return
    own, total, samples = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [f.split(" (")[0] for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples (GIL held)"]
    lines += ["", "self:"] + [f"{100 * n / samples:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "total:"] + [f"{100 * n / samples:5.1f}%  {f}"
                               for f, n in total.most_common(top)]
    path.with_suffix(".summary.txt").write_text("\n".join(lines) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": f"{platform.node()}, {os.cpu_count()} cores",
                               "args": vars(args) | {"out": str(args.out),
                                                     "profile": str(args.profile),
                                                     "cache_root": str(args.cache_root)}}
    profile = args.profile
    with S3Server() as server, tempfile.TemporaryDirectory(prefix="dataplane-") as work, \
            tempfile.TemporaryDirectory(prefix="dataplane-caches-", dir=args.cache_root) as caches:
        work_dir, cache_root = Path(work), Path(caches)
        keys, large = make_dataset(server, args.files, args.file_kb, args.large_mib)
        rel = [k.removeprefix("train/") for k in keys]
        random.Random(5).shuffle(rel)
        results["clients"] = clients(server, keys, args.readers)
        ram = ["--ram-cache", "2GiB", "--metadata-ttl", "forever"]
        passes: dict[str, Any] = {}
        with Mount(server, work_dir / "cached", [*ram, "--cache-dir",
                                                   str(cache_root / "cache")]) as mnt:
            mnt.list_tree(rel)
            with Profiler(profile, mnt.pid, "cold-ssd"):
                passes["cold, --cache-dir"] = mnt.read_all(rel, args.readers)
            drop_page_cache()
            with Profiler(profile, mnt.pid, "warm-ram"):
                passes["warm, RAM tier"] = mnt.read_all(rel, args.readers)
            # The same after listing the tree again, as a dataset's scan (ImageFolder)
            # does: READDIRPLUS gives the kernel every name, so no file needs a LOOKUP.
            drop_page_cache()
            mnt.list_tree(rel)
            passes["warm, RAM tier, names listed"] = mnt.read_all(rel, args.readers)
            with Profiler(profile, mnt.pid, "warm-pagecache"):
                passes["warm, page cache"] = mnt.read_all(rel, args.readers)
            # What is left of the last one once nothing asks the daemon: Python's open()
            # sends one IOCTL per file (its isatty()); os.open() does not.
            passes["warm, page cache, os.open"] = mnt.read_all(
                rel, args.readers, read_with_os_open)
        # The cold pass again with hints: the readers' order sent first, as a job's
        # HintSampler sends it (prefetch ahead of the readers; small files packed on SSD
        # in that order). What the daemon does after the last read (packing, prefetch)
        # is charged to the pass: it waits until the daemon is idle.
        with Mount(server, work_dir / "hinted", [*ram, "--cache-dir",
                                                   str(cache_root / "cache-hinted")]) as mnt:
            mnt.list_tree(rel)
            passes["cold, --cache-dir, hints"] = mnt.read_all(
                rel, args.readers, begin=lambda: mnt.send_order(rel), idle=True)
        # The same cache directory mounted again: RAM is empty, so every file comes from
        # the SSD tier, in another shuffled order (as the next epoch's would be).
        reshuffled = list(rel)
        random.Random(6).shuffle(reshuffled)
        with Mount(server, work_dir / "cached", [*ram, "--cache-dir",
                                                   str(cache_root / "cache")]) as mnt:
            mnt.list_tree(rel)
            drop_page_cache()
            with Profiler(profile, mnt.pid, "warm-ssd"):
                passes["warm, SSD tier (remounted)"] = mnt.read_all(reshuffled, args.readers)
        with Mount(server, work_dir / "ramonly", ram) as mnt:
            mnt.list_tree(rel)
            passes["cold, RAM only"] = mnt.read_all(rel, args.readers)
        # A dataset larger than the RAM tier, as most are: past its first quarter, every
        # file admitted evicts one (the eviction policy's work is then per file too).
        small_ram = ["--ram-cache", f"{max(16, args.files * args.file_kb // 4096)}MiB",
                     "--metadata-ttl", "forever"]
        with Mount(server, work_dir / "smallram", [*small_ram, "--cache-dir",
                                                     str(cache_root / "cache-smallram")]) as mnt:
            mnt.list_tree(rel)
            passes[f"cold, --cache-dir, RAM tier {small_ram[1]}"] = mnt.read_all(
                rel, args.readers)
        # The same three passes with the daemon answering every open (what a stock
        # pyfuse3 gives): the kernel_opens comparison, in the same run.
        with Mount(server, work_dir / "daemonopens", [*ram, "--no-kernel-opens", "--cache-dir",
                                                        str(cache_root / "cache-do")]) as mnt:
            mnt.list_tree(rel)
            passes["cold, --cache-dir, daemon opens"] = mnt.read_all(rel, args.readers)
            drop_page_cache()
            passes["warm, RAM tier, daemon opens"] = mnt.read_all(rel, args.readers)
            passes["warm, page cache, daemon opens"] = mnt.read_all(rel, args.readers)
        if args.data_processes:
            # The daemon as dispatcher, its data processes serving the reads
            # (docs/DATA_PROCESSES.md): the daemon's CPU here includes theirs (they are
            # its children); its event loop's is the serial part.
            procs = ["--data-processes", str(args.data_processes)]
            name = f"{args.data_processes} data processes"
            with Mount(server, work_dir / "data", [*ram, *procs, "--cache-dir",
                                                   str(cache_root / "cache-data")]) as mnt:
                mnt.list_tree(rel)
                with Profiler(profile, mnt.pid, "cold-data-processes"):
                    passes[f"cold, --cache-dir, {name}"] = mnt.read_all(rel, args.readers)
                drop_page_cache()
                passes[f"warm, RAM tier, {name}"] = mnt.read_all(rel, args.readers)
                passes[f"warm, page cache, {name}"] = mnt.read_all(rel, args.readers)
        results["passes"] = passes
        if args.large_mib:
            large_rows = []
            large_name = large.removeprefix("large/")  # the mounts' prefix is large/
            backing_gib = 3 * -(-args.large_mib // 1024) + 1
            for backed in (False, True):
                cache_dir = cache_root / f"cache-large-{int(backed)}"
                with Mount(server, work_dir / "large", [*ram, "--cache-dir", str(cache_dir)],
                           prefix="large") as mnt:
                    drop_page_cache()
                    row = {"memory_backed_first": backed}
                    if backed:
                        row["backing_cpu_s"] = back_memory(backing_gib)
                    with Profiler(profile if backed else None, mnt.pid, "large"):
                        large_rows.append(mnt.dd(large_name) | row)
            # A RAM tier a quarter of the object: every block past it evicts one, as a
            # dataset larger than the RAM budget reads (the evicted blocks' memory is
            # what the next GETs fill: bucketfs/spare_buffers.py).
            small_ram = ["--ram-cache", f"{max(64, args.large_mib // 4)}MiB",
                         "--metadata-ttl", "forever"]
            with Mount(server, work_dir / "large", [*small_ram, "--cache-dir",
                       str(cache_root / "cache-large-small-ram")], prefix="large") as mnt:
                drop_page_cache()
                row = {"memory_backed_first": True, "small_ram_tier": small_ram[1],
                       "backing_cpu_s": back_memory(backing_gib)}
                large_rows.append(mnt.dd(large_name) | row)
            if args.large_mib <= 1024:  # held whole by the RAM tier: what serving the
                # READs costs (page cache dropped), set against the cold read's GET side.
                with Mount(server, work_dir / "large", ram, prefix="large") as mnt:
                    drop_page_cache()
                    row = {"memory_backed_first": True, "ram_only": True,
                           "backing_cpu_s": back_memory(backing_gib)}
                    large_rows.append(mnt.dd(large_name) | row)
                    drop_page_cache()
                    large_rows.append(mnt.dd(large_name) | {"ram_only": True,
                                                             "from_ram_tier": True})
            # The last cache directory mounted again: every block from the SSD tier, as a
            # later epoch reads a dataset larger than the page cache.
            with Mount(server, work_dir / "large", [*ram, "--cache-dir", str(cache_dir)],
                       prefix="large") as mnt:
                drop_page_cache()
                row = {"memory_backed_first": True, "from_ssd_tier": True,
                       "backing_cpu_s": back_memory(backing_gib)}
                large_rows.append(mnt.dd(large_name) | row)
            if args.data_processes:
                with Mount(server, work_dir / "large",
                           [*ram, "--data-processes", str(args.data_processes),
                            "--cache-dir", str(cache_root / "cache-large-data")],
                           prefix="large") as mnt:
                    drop_page_cache()
                    row = {"memory_backed_first": True,
                           "data_processes": args.data_processes,
                           "backing_cpu_s": back_memory(backing_gib)}
                    large_rows.append(mnt.dd(large_name) | row)
            base = obstore_large(server, large, args.large_mib * MiB)
            if base is not None:
                large_rows.append(base)
            results["large"] = large_rows
        scale = []
        for readers in args.scale:
            for procs in sorted({0, args.data_processes}):
                cache = cache_root / f"cache-scale-{readers}-{procs}"
                extra = ["--data-processes", str(procs)] if procs else []
                with Mount(server, work_dir / f"scale{readers}",
                           [*ram, *extra, "--cache-dir", str(cache)]) as mnt:
                    mnt.list_tree(rel)
                    cold = mnt.read_all(rel, readers)
                    drop_page_cache()
                    warm = mnt.read_all(rel, readers)
                scale.append({"readers": readers, "data_processes": procs, "cold": cold,
                              "warm_ram": warm})
        results["scale"] = scale
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kb", type=int, default=100)
    parser.add_argument("--large-mib", type=int, default=1024)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--scale", default="16,64",
                        type=lambda text: [int(x) for x in text.split(",") if x])
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--cache-root", type=Path, default=None,
                        help="where the mounts' cache directories go (default: the "
                             "system's temporary directory)")
    parser.add_argument("--data-processes", type=int, default=0,
                        help="also mount with this many data processes (cold, warm and "
                             "a large object's passes)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = run(args)
    text = report(results)
    save_results(args.out, "dataplane", results, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
