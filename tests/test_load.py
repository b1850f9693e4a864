"""Load on one real S3 mount (SeaweedFS) with a RAM + SSD cache: every kind of reader at
once, a watchdog on every read, the daemon's peak RSS against its budgets, and no growth
of its file descriptors or threads over thousands of open/read/close cycles.

Each test prints its figures as one JSON line (`pytest -s` shows them).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, get_worker_info
from torchvision import datasets

from bucketfs.cache.chunk_files import OPEN_CHUNKS
from bucketfs.demo import make_image_dataset
from bucketfs.hints import HintSampler
from bucketfs.hints.client import end_job, send_order
from bucketfs.runtime import daemon_pid
from tests.faultproxy import FaultProxy
from tests.mounting import metrics, mounted
from tests.servers import S3Server, free_ports
from tests.watchdog import Watchdog

pytestmark = pytest.mark.fuse

KiB, MiB = 1024, 1024**2
#: No single read may take longer (seconds). A read here takes milliseconds; a 32 MiB
#: `cat` well under a second. The bound leaves room for a 2-core machine shared with
#: other test runs without letting a stuck read pass.
BOUND_S = 20.0
RAM_CACHE, READAHEAD_BUDGET, PREFETCH_BUDGET = 64 * MiB, 16 * MiB, 24 * MiB
BLOCK_SIZE = 4 * MiB
MOUNT_ARGS = (
    "--addressing-style", "path", "--ram-cache", "64MiB", "--disk-cache", "128MiB",
    "--block-size", "4MiB", "--readahead-max", "8MiB", "--readahead-budget", "16MiB",
    "--prefetch-window", "16MiB", "--prefetch-budget", "24MiB",
)
#: The daemon's RSS just after mounting may not exceed this. Measured: 68 MiB (Python
#: 3.11 with trio, boto3, google-cloud-storage, rocksdict, pyfuse3, prometheus-client).
IDLE_ALLOWANCE = 96 * MiB
#: Readers that can each wait on a block of their own miss at once: the DataLoader's two
#: workers, job B, cat and dd.
DEMAND_READERS = 5


def rss_bound(idle: int) -> int:
    """What the daemon may hold: idle, plus its budgets, plus a block for each reader's
    own miss. The write-through queue is left out: its blocks are the RAM tier's own
    bytes objects unless RAM evicted them first (measured at most 16 MiB queued here)."""
    return (idle + RAM_CACHE + READAHEAD_BUDGET + PREFETCH_BUDGET
            + DEMAND_READERS * BLOCK_SIZE)


# Slots of the watchdog: one per reader.
JOB_B, CAT, DD, FIND, MAIN, WORKERS = range(6)


@dataclass
class Dataset:
    url: str
    env: dict[str, str]
    #: Mount-relative path -> bytes: the small files (ImageFolder layout), then the large.
    files: dict[str, bytes]
    small: list[str]
    large: list[str]


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """300 JPEGs in 6 class directories (9.5 MB) and four files of about 32 MiB: twice
    what the RAM tier holds, a little more than the SSD tier."""
    local = tmp_path_factory.mktemp("load-source")
    images = make_image_dataset(local / "train", classes=6, per_class=50, seed=7, mean_kb=30)
    files = {path.relative_to(local).as_posix(): path.read_bytes() for path in images}
    rng = random.Random(3)
    large = {f"large/{name}": rng.randbytes(size) for name, size in
             (("a.bin", 32 * MiB + 7), ("b.bin", 32 * MiB), ("c.bin", 31 * MiB + 12345),
              ("d.bin", 30 * MiB))}
    files.update(large)
    s3_server.create_bucket("load")
    for key, data in files.items():
        s3_server.put("load", key, data)
    small = sorted(key for key in files if key.startswith("train/"))
    return Dataset("s3://load", s3_server.env(), files, small, sorted(large))


def proc_status(pid: int) -> dict[str, int]:
    """The numeric fields of /proc/PID/status (kB fields in bytes)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def kill(pid: int) -> Callable[[], None]:
    """What a stall does: kill the daemon, so that the kernel fails every pending read
    with ENOTCONN and the test ends instead of hanging."""
    def stall() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return stall


@contextlib.contextmanager
def watched(names: list[str], pid: int, bound: float = BOUND_S) -> Iterator[Watchdog]:
    watchdog = Watchdog(names, slots=WORKERS + 2, bound=bound, on_stall=kill(pid))
    try:
        with watchdog:
            yield watchdog
    except BaseException as exc:
        # A stall explains whatever the readers then raised (ENOTCONN, a DataLoader
        # timeout): report it first.
        if watchdog.stall is not None:
            raise AssertionError(f"a read stalled: {watchdog.stall}") from exc
        raise
    watchdog.check()


class Readers:
    """Background readers until `stop`, each error kept; join() fails on a hang. Leaving
    the `with` block stops and joins them whatever happened, so none is left reading
    the mount while it is unmounted."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is None:
            self.join()
        else:  # the error that ended the block matters more than the readers'
            with contextlib.suppress(Exception):
                self.join()

    def start(self, name: str, body: Callable[[], None]) -> None:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                self.errors.append(exc)
        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(self.timeout)
            assert not thread.is_alive(), f"{thread.name} did not finish in {self.timeout} s"
        if self.errors:
            raise self.errors[0]


class WatchedRead:
    """ImageFolder's loader in the DataLoader workers: the file's bytes, timed."""

    def __init__(self, watchdog: Watchdog, root: Path, index: dict[str, int]) -> None:
        self.watchdog = watchdog
        self.root = root
        self.index = index

    def __call__(self, path: str) -> tuple[str, bytes]:
        info = get_worker_info()
        slot = WORKERS + (info.id if info is not None else 0)
        name = Path(path).relative_to(self.root).as_posix()
        with self.watchdog.timing(slot, self.index[name]), open(path, "rb") as f:
            return name, f.read()


def keep_samples(batch: list[tuple[tuple[str, bytes], int]]) -> list[tuple[str, bytes]]:
    return [sample for sample, _ in batch]


def read_direct(path: Path, watchdog: Watchdog, slot: int, what: int, chunk: int) -> bytes:
    """The whole file in `chunk`-byte preads that bypass the page cache (each reaches
    the daemon), each timed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        parts = []
        while True:
            with watchdog.timing(slot, what):
                part = os.pread(fd, chunk, sum(map(len, parts)))
            if not part:
                return b"".join(parts)
            parts.append(part)
    finally:
        os.close(fd)


class Load:
    """The readers of test_every_reader_at_once, each checking every byte it reads."""

    def __init__(self, dataset: Dataset, root: Path, watchdog: Watchdog,
                 readers: Readers) -> None:
        self.dataset = dataset
        self.root = root
        self.watchdog = watchdog
        self.readers = readers
        self.index = {name: i for i, name in enumerate(watchdog.names)}
        self.verified = 0
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def check(self, name: str, data: bytes) -> None:
        assert data == self.dataset.files[name], f"{name}: wrong bytes"
        with self._lock:
            self.verified += len(data)

    def more(self, done: int, at_least: int) -> bool:
        """Keep going until the DataLoader is done, and at least `at_least` rounds."""
        return not self.readers.stop.is_set() or done < at_least

    def job_a(self, epochs: int) -> None:
        """ImageFolder through a two-worker DataLoader with HintSampler. Its own timeout
        backs up the watchdog."""
        images = datasets.ImageFolder(str(self.root / "train"),
                                      loader=WatchedRead(self.watchdog, self.root, self.index))
        sampler = HintSampler(RandomSampler(
            images, generator=torch.Generator().manual_seed(1)), images)
        loader = DataLoader(images, sampler=sampler, batch_size=16, num_workers=2,
                            collate_fn=keep_samples, timeout=BOUND_S + 10)
        for _ in range(epochs):
            seen = 0
            for batch in loader:
                for name, data in batch:
                    self.check(name, data)
                seen += len(batch)
            assert seen == len(self.dataset.small)

    def job_b(self) -> None:
        """Another job's order over the small files, read in it with O_DIRECT."""
        epoch, mount = 0, str(self.root)
        while self.more(epoch, 1):
            order = random.Random(epoch).sample(self.dataset.small, len(self.dataset.small))
            assert send_order(order, epoch=epoch, job="load-job-b", mount=mount)
            for name in order:
                self.check(name, read_direct(self.root / name, self.watchdog, JOB_B,
                                             self.index[name], 64 * KiB))
            epoch += 1
        assert end_job("load-job-b", mount=mount)
        self.counts["job_b_epochs"] = epoch

    def command(self, slot: int, *argv: str) -> Callable[[], None]:
        """Run `argv` ("{}" standing for the path) on each large file, until done."""
        def body() -> None:
            passes = 0
            while self.more(passes, 2):
                for name in self.dataset.large:
                    with self.watchdog.timing(slot, self.index[name]):
                        path = str(self.root / name)
                        done = subprocess.run([a.replace("{}", path) for a in argv],
                                              capture_output=True, timeout=BOUND_S + 10)
                    assert done.returncode == 0, done.stderr
                    self.check(name, done.stdout)
                passes += 1
            self.counts[f"{argv[0]}_passes"] = passes
        return body

    def find(self) -> None:
        want = sorted(self.dataset.files)
        walks = 0
        while self.more(walks, 3):
            with self.watchdog.timing(FIND, self.index["find"]):
                done = subprocess.run(["find", ".", "-type", "f"], cwd=self.root,
                                      capture_output=True, text=True, timeout=BOUND_S + 10)
            assert done.returncode == 0, done.stderr
            assert sorted(p.removeprefix("./") for p in done.stdout.split()) == want
            walks += 1
        self.counts["find_walks"] = walks


def test_every_reader_at_once(dataset: Dataset, tmp_path: Path) -> None:
    """A DataLoader with two workers over ImageFolder with HintSampler (job A, two
    epochs), job B sending its own order and reading it with O_DIRECT, `cat` and
    `dd iflag=direct` of the large files, and `find` walking the tree, all at once.
    Every byte is checked against the source; no read may take longer than BOUND_S.

    The daemon's RSS just after mounting ("idle", measured 68 MiB) is below 96 MiB, and
    its peak RSS (VmHWM) below rss_bound(idle): idle + ram_cache (64 MiB) +
    readahead_budget (16 MiB) + prefetch_budget (24 MiB) + one block (4 MiB) of a miss
    for each of the 5 readers = idle + 124 MiB, about 192 MiB. Measured peaks: 147-151
    MiB; 204 MiB with a RAM tier holding 134 MiB, which the bound catches. The daemon
    fixes glibc's mmap threshold itself (mount.py): without that, glibc's heaps kept
    freed blocks and the peak varied from 195 to 284 MiB.
    """
    port = free_ports(1)[0]
    with mounted(dataset.url, tmp_path / "mnt", *MOUNT_ARGS, "--cache-dir",
                 str(tmp_path / "cache"), "--metrics-port", str(port),
                 env=dataset.env) as mnt:
        root = mnt.resolve()
        pid = daemon_pid(str(root))
        assert pid is not None
        idle_rss = proc_status(pid)["VmRSS"]
        rss_seen = [0]
        with (watched([*dataset.small, *dataset.large, "find"], pid) as watchdog,
              Readers(timeout=2 * BOUND_S + 20) as readers):
            watchdog.on_tick.append(
                lambda: rss_seen.__setitem__(0, max(rss_seen[0], proc_status(pid)["VmRSS"])))
            load = Load(dataset, root, watchdog, readers)
            readers.start("job B", load.job_b)
            readers.start("cat", load.command(CAT, "cat", "{}"))
            readers.start("dd", load.command(DD, "dd", "if={}", "bs=1M", "iflag=direct",
                                             "status=none"))
            readers.start("find", load.find)
            load.job_a(epochs=2)
        status = proc_status(pid)
        after = metrics(port)
    longest, longest_what = watchdog.longest()
    figures = dict(
        test="every_reader_at_once", reads=watchdog.reads, bytes_verified=load.verified,
        max_read_s=round(longest, 3), max_read_of=longest_what, **load.counts,
        idle_rss_mib=round(idle_rss / MiB, 1), peak_rss_mib=round(status["VmHWM"] / MiB, 1),
        sampled_rss_max_mib=round(rss_seen[0] / MiB, 1),
        rss_bound_mib=round(rss_bound(idle_rss) / MiB, 1),
        threads=status["Threads"], hints_orders=after["bucketfs_hints_orders_total"],
        prefetch_started=after["bucketfs_prefetch_started_total"],
        prefetch_hits=after["bucketfs_prefetch_hits_total"],
    )
    print(json.dumps(figures))
    # Both epochs of job A and each epoch of job B reached the daemon as orders.
    assert after["bucketfs_hints_orders_total"] == 2 + load.counts["job_b_epochs"]
    assert after["bucketfs_prefetch_failed_total"] == 0
    assert idle_rss < IDLE_ALLOWANCE, figures
    assert status["VmHWM"] < rss_bound(idle_rss), figures


def daemon_fds(pid: int) -> list[str]:
    """What each of the daemon's open file descriptors points at."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def fd_kinds(targets: list[str]) -> dict[str, int]:
    """socket, pipe, anon_inode, a device, or file (the log, the index's files)."""
    kinds: dict[str, int] = {}
    for target in targets:
        if ":" in target:
            kind = target.split(":")[0]
        else:
            kind = target if target.startswith("/dev/") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def test_open_read_close_cycles_leak_no_fds_or_threads(dataset: Dataset, tmp_path: Path) -> None:
    """After a warm-up of 400 cycles, 2,000 more open/read/close cycles (small files
    whole, 256 KiB ranges of the large ones; every other one with O_DIRECT, so the
    read reaches the daemon) leave the daemon with at most 4 more open file descriptors
    and 4 more threads than the warm-up did: nothing is held per open (besides the chunk
    files the SSD tier keeps open, at most OPEN_CHUNKS of them)."""
    names = [*dataset.small, *dataset.large]
    rng = random.Random(9)

    def cycles(root: Path, watchdog: Watchdog, count: int) -> None:
        for i in range(count):
            name = rng.choice(names) if i % 7 else rng.choice(dataset.large)
            data = dataset.files[name]
            offset = rng.randrange(0, len(data) - 256 * KiB) if len(data) > MiB else 0
            flags = os.O_RDONLY | (os.O_DIRECT if i % 2 else 0)
            with watchdog.timing(MAIN, names.index(name)):
                fd = os.open(root / name, flags)
                try:
                    got = os.pread(fd, 256 * KiB, offset)
                finally:
                    os.close(fd)
            assert got == data[offset:offset + 256 * KiB], name

    with mounted(dataset.url, tmp_path / "mnt", *MOUNT_ARGS, "--cache-dir",
                 str(tmp_path / "cache"), env=dataset.env) as mnt:
        root = mnt.resolve()
        pid = daemon_pid(str(root))
        assert pid is not None
        with watched(names, pid) as watchdog:
            cycles(root, watchdog, 400)
            fds_before, threads_before = daemon_fds(pid), proc_status(pid)["Threads"]
            cycles(root, watchdog, 2000)
            fds_after, threads_after = daemon_fds(pid), proc_status(pid)["Threads"]
    longest, longest_what = watchdog.longest()
    figures = dict(
        test="open_read_close_cycles", cycles=2000, warm_up=400, reads=watchdog.reads,
        max_read_s=round(longest, 3), max_read_of=longest_what,
        fds_before=len(fds_before), fds_after=len(fds_after), threads_before=threads_before,
        threads_after=threads_after, fd_kinds_after=fd_kinds(fds_after),
    )
    print(json.dumps(figures))
    # The SSD tier keeps up to OPEN_CHUNKS chunk files open (an LRU), whatever the opens.
    chunks_open = [fd for fd in fds_after if fd.endswith(".chk")]
    assert len(chunks_open) <= OPEN_CHUNKS, figures
    others_before = [fd for fd in fds_before if not fd.endswith(".chk")]
    others_after = [fd for fd in fds_after if not fd.endswith(".chk")]
    assert len(others_after) <= len(others_before) + 4, (fd_kinds(fds_before),
                                                        fd_kinds(fds_after))
    assert threads_after <= threads_before + 4, figures


def test_watchdog_fails_a_stalled_read_instead_of_hanging(
        dataset: Dataset, fault_proxy: Callable[..., FaultProxy], tmp_path: Path) -> None:
    """The watchdog itself: a GET held back for a minute makes a read exceed a 1 s
    bound; the test gets an AssertionError naming the file within seconds, not a hang."""
    proxy = fault_proxy(dataset.env["AWS_ENDPOINT_URL"])
    stalled = dataset.small[0]
    proxy.add_rule(method="GET", path_contains=stalled, action="delay:60")
    env = {**dataset.env, "AWS_ENDPOINT_URL": proxy.endpoint}
    with mounted(dataset.url, tmp_path / "mnt", *MOUNT_ARGS, env=env) as mnt:
        root = mnt.resolve()
        pid = daemon_pid(str(root))
        assert pid is not None
        started = time.monotonic()
        with (pytest.raises(AssertionError, match=f"{stalled} has been read for") as caught,
              watched(dataset.small, pid, bound=1.0) as watchdog,
              watchdog.timing(MAIN, 0)):
            (root / stalled).read_bytes()
        elapsed = time.monotonic() - started
    # The daemon was killed, so the read failed: the kernel's "not connected".
    assert isinstance(caught.value.__cause__, OSError), caught.value.__cause__
    assert caught.value.__cause__.errno == errno.ENOTCONN
    assert elapsed < 10, elapsed
