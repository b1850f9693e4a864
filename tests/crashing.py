"""Crash runs for tests/test_crash.py: a seeded schedule (which phase of the daemon's
work a kill -9 lands in, and when), the workloads that keep a mount busy in each phase,
the kill, and the checks after a remount: every byte through the mount, and a cache
directory whose index agrees with itself and with its files.

A run is a function of its seed alone (phase, delay, orders, options), so a failure
is replayed by running that seed again; timing on the machine still varies, which is
what a soak of many seeds is for.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rocksdict import AccessType, Options, Rdict

from bucketfs.cache.chunk_files import _HEADER, DATA_START
from bucketfs.cache.disk import block_file_name
from bucketfs.cache.schema import (
    CHUNK,
    CHUNK_TOTALS_KEY,
    ENTRY,
    RANK,
    RECENCY,
    STATE_KEY,
    chunk_of_key,
    decode_block,
    decode_chunk,
    decode_chunk_totals,
    decode_packed,
    decode_state,
)
from bucketfs.hints import HintError, send_next_order, send_order
from bucketfs.runtime import daemon_pid
from tests.mounting import bucketfs, expected_tree, force_unmount, read_log, tree

KiB, MiB = 1024, 1024**2
PHASES = ("cold", "hinted", "packing", "eviction")
#: Small blocks: the large files are many blocks, so many writes are under way at once.
BLOCK = "256KiB"
#: SSD budgets of the eviction phase, a fifth and a third of the dataset: with the
#: larger, whole ~4 MiB chunks fit, so chunks are evicted too.
EVICTION_BUDGETS = (3 * MiB, 5 * MiB)
#: After a kill -9 (no power loss: what reached the page cache survives) none of these
#: may appear when the cache is opened again: each means the index and the files
#: disagreed, or a torn file was found under a real name.
SUSPICIOUS = re.compile(r"checksum|does not match|names a missing entry|dropping|"
                        r"dropped chunk|chunk records whose files are gone|Traceback")


def dataset() -> dict[str, bytes]:
    """~14 MiB: 160 small files (packable, one block each) in four directories, three
    files of 3 to 9 blocks, and an empty one."""
    rng = random.Random(11)
    files = {f"train/c{i % 4}/{i:04d}.jpg": rng.randbytes(rng.randrange(8, 120) * KiB + i)
             for i in range(160)}
    for name, size in (("big/a.bin", 600 * KiB + 3), ("big/b.bin", MiB + 100_000),
                       ("big/c.bin", 2 * MiB + 1)):
        files[name] = rng.randbytes(size)
    files["empty.txt"] = b""
    return files


@dataclass(frozen=True, slots=True)
class Plan:
    """What one crash run does; made from its seed by `plan`."""

    seed: int
    phase: str
    #: Seconds from the start of the work to the kill.
    delay: float
    readers: int
    #: Keys per LIST: small pages keep listings in flight for longer.
    page_size: int
    #: The eviction phase: with hints (hinted victims, packing under pressure).
    hinted: bool
    #: The SSD budget (--disk-cache); None: the default, far above the dataset.
    budget: int | None
    #: Kill the remounted daemon too, this long into a pass over everything.
    second_kill: float | None

    def describe(self) -> str:
        second = "" if self.second_kill is None else f", second kill {self.second_kill:.2f}s"
        budget = "" if self.budget is None else f", SSD budget {self.budget}"
        return (f"seed {self.seed}: {self.phase}, kill after {self.delay:.2f}s, "
                f"{self.readers} readers, pages of {self.page_size}"
                f"{', hinted' if self.hinted else ''}{budget}{second}")


def plan(seed: int) -> Plan:
    rng = random.Random(seed)
    phase = PHASES[seed % len(PHASES)]  # every phase equally often, whatever the count
    # Cold: one pass of every reader takes ~1.4 s here, the directories are listed in
    # the first ~0.2 s (a third of the runs kill then); hinted: the prefetcher has
    # fetched everything by ~0.8 s; packing: chunks are written from ~0.5 s on, at the
    # end of each epoch (~0.5 s); eviction starts once 3 MiB are in (~0.2 s).
    listing = rng.random() < 1 / 3
    delay = {"cold": rng.uniform(0.0, 0.2 if listing else 1.2),
             "hinted": rng.uniform(0.0, 0.8),
             "packing": rng.uniform(0.3, 2.0), "eviction": rng.uniform(0.2, 1.5)}[phase]
    return Plan(seed, phase, delay, readers=rng.choice((4, 6, 8)),
                page_size=rng.choice((7, 50, 1000)),
                hinted=rng.random() < 0.5 and phase == "eviction",
                second_kill=rng.uniform(0.0, 0.6) if rng.random() < 0.25 else None,
                budget=rng.choice(EVICTION_BUDGETS) if phase == "eviction" else None)


def mount_args(p: Plan, cache: Path) -> list[str]:
    args = ["--addressing-style", "path", "--cache-dir", str(cache), "--block-size", BLOCK,
            "--disk-free-floor", "0", "--list-page-size", str(p.page_size)]
    if p.budget is not None:
        args += ["--disk-cache", str(p.budget), "--ram-cache", "2MiB"]
    return args


# --- the daemon ---------------------------------------------------------------------------


def mount(url: str, mnt: Path, args: list[str], env: dict[str, str], log: Path) -> None:
    result = bucketfs("mount", url, str(mnt), "--log-file", str(log), *args, env=env)
    assert result.returncode == 0, f"mount failed: {result.stderr}\n{read_log(log)}"


def kill_daemon(mnt: Path) -> None:
    """kill -9 the mount's daemon and wait until it is gone (its index lock with it)."""
    pid = daemon_pid(str(mnt))
    assert pid is not None, f"no daemon pid for {mnt}"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < deadline, f"daemon {pid} survived kill -9"
        time.sleep(0.01)


def _running(pid: int) -> bool:
    """Until every thread has exited: the main thread is a zombie (which nobody may reap
    here) while others still close the process's files, /dev/fuse and the index's lock
    among them."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False
    return len(threads) > 1 or not zombie


# --- workloads ---------------------------------------------------------------------------


@dataclass
class Work:
    """Readers of a mount until `stop`; what they read is checked as it comes."""

    mnt: Path
    files: dict[str, bytes]
    stop: threading.Event = field(default_factory=threading.Event)
    wrong: list[str] = field(default_factory=list)

    def read(self, name: str) -> bool:
        """Read one file; False once the mount is gone (or the work is stopped)."""
        if self.stop.is_set():
            return False
        try:
            with open(self.mnt / name, "rb") as f:
                data = f.read()
        except OSError:
            return False  # the daemon is gone
        if data != self.files[name]:
            self.wrong.append(name)
        return True

    def hint(self, order: list[str], epoch: int, *, next_follows: bool = False) -> bool:
        try:
            return send_order([str(self.mnt / n) for n in order], epoch=epoch,
                              job="crash", strict=True, next_follows=next_follows)
        except HintError:
            return False  # the daemon is gone

    def announce(self, order: list[str], epoch: int) -> bool:
        try:
            return send_next_order([str(self.mnt / n) for n in order], epoch=epoch,
                                   job="crash", strict=True)
        except HintError:
            return False


def _shared(names: list[str], lock: threading.Lock) -> Callable[[], str | None]:
    """The next name of one order that several readers share (DataLoader workers)."""
    it = iter(names)

    def take() -> str | None:
        with lock:
            return next(it, None)

    return take


def _read_shared(work: Work, order: list[str], readers: int, pause: float = 0.0) -> bool:
    """`readers` threads read `order` between them; False if the mount went away."""
    take = _shared(order, threading.Lock())

    def reader() -> bool:
        while (name := take()) is not None:
            if not work.read(name):
                return False
            if pause:
                time.sleep(pause)
        return True

    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        return all(list(pool.map(lambda _: reader(), range(readers))))


def cold(work: Work, p: Plan, rng: random.Random) -> None:
    """Every reader walks the whole dataset in its own order: listings, single-flight
    GETs and write-through all at once."""
    orders = [rng.sample(list(work.files), len(work.files)) for _ in range(p.readers)]

    def reader(order: list[str]) -> None:
        while not work.stop.is_set():
            for name in order:
                if not work.read(name):
                    return

    with concurrent.futures.ThreadPoolExecutor(p.readers) as pool:
        list(pool.map(reader, orders))


def hinted(work: Work, p: Plan, rng: random.Random) -> None:
    """An order sent, then two slow readers: the prefetcher runs ahead of them."""
    epoch = 0
    while not work.stop.is_set():
        order = rng.sample(list(work.files), len(work.files))
        if not work.hint(order, epoch) or not _read_shared(work, order, 2, pause=0.002):
            return
        epoch += 1


def packing(work: Work, p: Plan, rng: random.Random) -> None:
    """Epochs whose next order is announced: what an epoch reads is packed into chunks
    in the next one's order, and files packed by the last layout move to new chunks
    (their old chunks reclaimed)."""
    names = list(work.files)
    order, epoch = rng.sample(names, len(names)), 0
    while not work.stop.is_set():
        upcoming = rng.sample(names, len(names))
        if not (work.hint(order, epoch, next_follows=True)
                and work.announce(upcoming, epoch + 1)
                and _read_shared(work, order, 4)):
            return
        order, epoch = upcoming, epoch + 1


def eviction(work: Work, p: Plan, rng: random.Random) -> None:
    """Epochs over a dataset five times the SSD budget: the tier evicts all along
    (hinted: by next use, packing under the same budget)."""
    if not p.hinted:
        cold(work, p, rng)
        return
    names = list(work.files)
    epoch = 0
    while not work.stop.is_set():
        order = rng.sample(names, len(names))
        if not work.hint(order, epoch) or not _read_shared(work, order, 4):
            return
        epoch += 1


WORKLOADS: dict[str, Callable[[Work, Plan, random.Random], None]] = {
    "cold": cold, "hinted": hinted, "packing": packing, "eviction": eviction}


def run_then_kill(work: Work, p: Plan, workload: Callable[[Work, Plan, random.Random], None],
                  rng: random.Random, delay: float, cache: Path) -> dict[str, int]:
    """Run the workload in the background and kill -9 the daemon `delay` seconds in;
    what the kill left in the cache directory (files by suffix)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(workload, work, p, rng)
        time.sleep(delay)
        kill_daemon(work.mnt)
        work.stop.set()
        running.result(timeout=60)
    force_unmount(work.mnt)  # the stale mount the killed daemon left
    left: dict[str, int] = {}
    for sub in ("data", "chunks"):
        for path in (cache / sub).rglob("*"):
            if path.is_file():
                left[path.suffix] = left.get(path.suffix, 0) + 1
    return left


# --- checks ------------------------------------------------------------------------------


def verify(mnt: Path, files: dict[str, bytes]) -> int:
    """Every name and every byte through the mount (sha256); the bytes verified."""
    seen, expected = tree(mnt), expected_tree(files)
    wrong = sorted(name for name in expected.keys() | seen.keys()
                   if seen.get(name) != expected.get(name))
    assert not wrong, f"{len(wrong)} paths wrong after the remount, e.g. {wrong[:5]}"
    return sum(map(len, files.values()))


def second_pass(mnt: Path, files: dict[str, bytes]) -> None:
    """Read everything again, past the kernel's page cache (so the daemon serves it)."""
    for name, data in files.items():
        with open(mnt / name, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            got = f.read()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), name


def suspicious_lines(log: Path) -> list[str]:
    return [line for line in read_log(log).splitlines()
            if " ERROR " in line or SUSPICIOUS.search(line)]


@dataclass(frozen=True, slots=True)
class CacheFacts:
    used: int
    block_entries: int
    packed_entries: int
    chunks: int


def check_cache(cache: Path, budget: int | None) -> CacheFacts:
    """After a clean unmount: `bucketfs cache stats` works, and the index agrees with
    itself and with the files (see `_index_facts`). Raises AssertionError saying what
    disagrees."""
    stats = bucketfs("cache", "stats", str(cache))
    assert stats.returncode == 0, f"cache stats failed: {stats.stderr}"
    facts = _index_facts(cache)
    if budget is not None:
        assert facts.used <= budget, f"{facts.used} bytes cached, budget {budget}"
    return facts


def open_index(cache: Path) -> Rdict:
    """The cache's index, read-only (its log kept out of the cache directory)."""
    options = Options(raw_mode=True)
    options.set_db_log_dir(str(cache.parent))  # not into the cache directory
    return Rdict(str(cache / "index"), options, access_type=AccessType.read_only())


def _keys(index: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    for key, value in index.items(from_key=prefix):
        if not key.startswith(prefix):
            return
        yield key, value


def _index_facts(cache: Path) -> CacheFacts:
    """The invariants a clean close leaves: the saved totals are the records' sums,
    every record's file exists and every file has its record, a chunk's live bytes are
    its members', each entry and chunk has one place in the eviction order."""
    index = open_index(cache)
    try:
        saved = index.get(STATE_KEY)
        assert saved is not None, "no totals saved: the last unmount was not clean"
        used = decode_state(saved).used
        blocks: set[str] = set()
        block_bytes = 0
        live: dict[int, int] = {}
        packed_at: dict[bytes, tuple[int, int, int]] = {}
        for key, value in _keys(index, ENTRY):
            packed = decode_packed(value)
            if packed is None:
                block_bytes += decode_block(value).length
                blocks.add(block_file_name(key[1:]))
            else:
                live[packed.chunk] = live.get(packed.chunk, 0) + packed.length
                packed_at[key[1:]] = (packed.chunk, packed.offset, packed.length)
        chunks: dict[int, tuple[int, int]] = {}
        for key, value in _keys(index, CHUNK):
            chunk = chunk_of_key(key)
            record = decode_chunk(value)
            chunks[chunk] = (record.size, record.live)
            assert record.live == live.get(chunk, 0) > 0, \
                f"chunk {chunk}: {record.live} live bytes, its members hold {live.get(chunk)}"
            members = {m.entry: (chunk, m.offset, m.length) for m in record.members}
            for entry, where in packed_at.items():
                if where[0] == chunk:
                    assert members.get(entry) == where, f"chunk {chunk} lacks a member"
        assert not live.keys() - chunks.keys(), "packed entries name missing chunks"
        assert used == block_bytes + sum(s for s, _ in chunks.values()), \
            f"saved used {used} != {block_bytes} in blocks + chunks {chunks}"
        totals = index.get(CHUNK_TOTALS_KEY)
        assert totals is None or decode_chunk_totals(totals) == (
            len(chunks), sum(s for s, _ in chunks.values()), sum(v for _, v in chunks.values()))
        ranked = len(blocks) + len(chunks)
        ranks = sum(1 for _ in _keys(index, RANK))
        assert ranks == ranked, f"{ranks} rank keys for {ranked} entries and chunks"
        recency = sum(1 for _ in _keys(index, RECENCY))
        assert recency in (0, ranked), f"{recency} recency keys for {ranked}"
    finally:
        index.close()
    on_disk = {p.name for p in (cache / "data").rglob("*") if p.is_file()}
    assert on_disk == blocks, (f"block files {len(on_disk)}, records {len(blocks)}: "
                               f"{sorted(on_disk ^ blocks)[:3]}")
    chunk_files = {p.name: p.stat().st_size for p in (cache / "chunks").iterdir()}
    assert chunk_files.keys() == {f"{c:016x}.chk" for c in chunks}, \
        f"chunk files {sorted(chunk_files)} for records {sorted(chunks)}"
    # A chunk's record counts its bytes less the members punched out (holes keep the
    # file's length).
    for chunk, (size, live) in chunks.items():
        path = cache / "chunks" / f"{chunk:016x}.chk"
        written = _HEADER.unpack_from(path.read_bytes())[2]  # its header's length
        assert chunk_files[path.name] == DATA_START + written, f"chunk {chunk} cut short"
        assert live <= size <= written, \
            f"chunk {chunk}: {live} live, {size} counted, {written} written"
    return CacheFacts(used, len(blocks), len(packed_at), len(chunks))
