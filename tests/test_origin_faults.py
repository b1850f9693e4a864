"""Origin faults through a mount (issue 11, "never wrong, never down").

Thousands of ranged reads of small and multi-block files go through FaultProxy with a
seeded mix of 503 SlowDown with Retry-After, 500, resets mid-body, truncated bodies and
stalls past the read timeout: every byte must be right, EIO must come only for reads
whose every attempt failed (one object that always fails), and after the link to the
store goes down and comes back the same mount serves again without a remount.

Reads are O_DIRECT and the RAM tier holds 4 blocks, so nearly every read reaches the
origin. Each test prints what it did (reads, faults by kind, EIOs, seconds); run with
-rP to see it, or set BUCKETFS_FAULT_REPORT to a file to collect it as JSON lines.
The one-minute outage and the long mix are marked `soak` (run them with -m soak).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.mounting import mounted, read_log
from tests.servers import S3Server

pytestmark = pytest.mark.fuse

KiB, MiB = 1024, 1024**2
BUCKET = "origin-faults"
ATTEMPTS = 10
READ_TIMEOUT = 1.0


def make_files() -> dict[str, bytes]:
    rng = random.Random(2011)
    files = {f"small/{i:03d}.bin": rng.randbytes(rng.randrange(1 * KiB, 200 * KiB))
             for i in range(120)}
    files.update({f"large/{i}.bin": rng.randbytes(rng.randrange(5 * MiB // 4, 5 * MiB // 2))
                  for i in range(4)})
    # Read only by the outage tests, each by one, so their first read is a miss.
    files.update({f"outage/{i}.bin": rng.randbytes(150 * KiB) for i in range(3)})
    files["doomed.bin"] = rng.randbytes(100 * KiB)
    return files


FILES = make_files()
# (action, probability per GET). First match wins, so later shares are of what is left.
FAULT_MIX = [
    ("status:503:1", 0.03),  # SlowDown, Retry-After: 1 (waited up to --retry-max-delay)
    ("status:500", 0.03),
    ("reset", 0.03),  # half the body, then RST
    ("truncate", 0.03),  # half the body under the full Content-Length, then FIN
    (f"stall:{3 * READ_TIMEOUT:g}", 0.004),  # half the body, then silence past the timeout
]


def report(record: dict[str, object]) -> None:
    line = json.dumps(record, sort_keys=True)
    print(line)
    if path := os.environ.get("BUCKETFS_FAULT_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")


@dataclass
class Mount:
    proxy: FaultProxy
    path: Path
    log: Path

    def failures(self) -> list[str]:
        """Keys of the GETs the daemon gave up on after the whole budget (one per line)."""
        return re.findall(rf"GET '([^']+)' \S+ \S+ failed after {ATTEMPTS} attempts",
                          read_log(self.log))


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    s3_server.create_bucket(BUCKET)
    for key, data in FILES.items():
        s3_server.put(BUCKET, key, data)
    return BUCKET


def mount_options(read_timeout: float, attempts: int) -> tuple[str, ...]:
    return (
        "--addressing-style", "path", "--block-size", "256KiB", "--ram-cache", "1MiB",
        "--readahead-max", "256KiB", "--prefetch-window", "0",
        "--retry-attempts", str(attempts), "--retry-base-delay", "0.01",
        "--retry-max-delay", "0.2", "--read-timeout", f"{read_timeout:g}",
        "--connect-timeout", "1",
    )


@contextlib.contextmanager
def proxied_mount(server: S3Server, mountpoint: Path, *, read_timeout: float = READ_TIMEOUT,
                  attempts: int = ATTEMPTS, seed: int = 11) -> Iterator[Mount]:
    host, port = server.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port), seed=seed).start()
    env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        with mounted(f"s3://{BUCKET}", mountpoint, *mount_options(read_timeout, attempts),
                     env=env) as path:
            yield Mount(proxy, path, mountpoint.parent / f"{mountpoint.name}.log")
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def mount(s3_server: S3Server, bucket: str, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[Mount]:
    with proxied_mount(s3_server, tmp_path_factory.mktemp("faults") / "mnt") as m:
        yield m


def read_direct(path: Path, offset: int, length: int) -> bytes | OSError:
    """One pread on a fresh O_DIRECT handle: it reaches the daemon, never the page cache."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return exc
    try:
        return os.pread(fd, length, offset)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)


def plan_reads(count: int, seed: int) -> list[tuple[str, int, int]]:
    """(key, offset, length): three in four reads of small files, the rest of large ones
    (crossing block boundaries), at random offsets, some past the end."""
    rng = random.Random(seed)
    small = [k for k in FILES if k.startswith("small/")]
    large = [k for k in FILES if k.startswith("large/")]
    plan = []
    for _ in range(count):
        key = rng.choice(small) if rng.random() < 0.75 else rng.choice(large)
        size = len(FILES[key])
        length = rng.choice([1, 4 * KiB, 64 * KiB, 200 * KiB, 300 * KiB])
        offset = rng.randrange(0, size + 1000) if rng.random() < 0.1 else rng.randrange(size)
        plan.append((key, offset, length))
    return plan


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("reads", [4000, pytest.param(20000, marks=pytest.mark.soak)])
def test_thousands_of_reads_under_a_fault_mix(mount: Mount, reads: int) -> None:
    proxy = mount.proxy
    proxy.clear()
    faults_before = Counter(proxy.faults)
    failures_before = len(mount.failures())
    proxy.add_rule(method="GET", path_contains="doomed.bin", action="status:502")
    for action, probability in FAULT_MIX:
        proxy.add_rule(method="GET", action=action, probability=probability)
    plan = plan_reads(reads, seed=reads)
    doomed_reads = max(1, reads // 240)
    began = time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        results = pool.map(lambda r: read_direct(mount.path / r[0], r[1], r[2]), plan)
        # One at a time beside the pool: a read joining another's GET would share its
        # failure, and the count of EIOs per budget spent would blur.
        doomed = [read_direct(mount.path / "doomed.bin", 0, 100 * KiB)
                  for _ in range(doomed_reads)]
        results = list(results)
    seconds = time.monotonic() - began

    wrong = [(r, type(got).__name__ if isinstance(got, OSError) else len(got))
             for r, got in zip(plan, results, strict=True)
             if got != FILES[r[0]][r[1]:r[1] + r[2]]]
    assert not wrong, f"{len(wrong)} of {len(plan)} reads wrong or failed: {wrong[:5]}"
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in doomed), doomed
    # Each EIO is a read whose every attempt failed: the daemon gave up on doomed.bin once
    # per read, after exactly the budget, and on nothing else.
    failures = mount.failures()[failures_before:]
    assert failures == ["doomed.bin"] * doomed_reads, Counter(failures)
    assert proxy.count("GET", "doomed.bin") == ATTEMPTS * doomed_reads
    gets = proxy.count("GET")
    faults = Counter(proxy.faults)
    faults.subtract(faults_before)
    faults = +faults  # drop kinds not seen in this test
    assert gets >= reads, "the reads did not reach the origin"
    for action, probability in FAULT_MIX:  # every kind happened, at about its share
        assert faults[action] >= gets * probability / 3, (action, faults)
    report({"test": "fault_mix", "reads": len(plan) + doomed_reads, "gets": gets,
            "faults": dict(faults), "faults_total": sum(faults.values()),
            "eio": len(doomed), "eio_other": 0, "seconds": round(seconds, 1)})


def survive_outage(mount: Mount, key: str, seconds: float) -> dict[str, float]:
    """Blackhole the link for `seconds` while a read of `key` is in flight: the read waits
    out the outage (attempt after attempt timing out) and returns the right bytes once the
    link is back."""
    proxy = mount.proxy
    proxy.clear()
    held_before = proxy.faults["blackhole"]
    result: list[bytes | OSError] = []
    reader = threading.Thread(
        target=lambda: result.append(read_direct(mount.path / key, 0, len(FILES[key]))))
    proxy.outage("blackhole")
    began = time.monotonic()
    reader.start()
    try:
        # The outage lasts `seconds`; meanwhile the read must try more than once.
        wait_for(lambda: proxy.faults["blackhole"] - held_before >= 2, seconds + 30,
                 "attempts during the outage")
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))
        assert reader.is_alive() and not result, f"the read gave up during the outage: {result}"
    finally:
        proxy.restore()
    reader.join(timeout=30)
    assert result == [FILES[key]]
    assert key not in mount.failures()
    return {"outage_s": seconds, "attempts_held": proxy.faults["blackhole"] - held_before,
            "read_s": round(time.monotonic() - began, 1)}


def test_a_read_waits_out_a_short_outage(mount: Mount) -> None:
    """Attempts time out at --read-timeout 1 s, ten of them: 6 s of outage fit in the budget."""
    record = survive_outage(mount, "outage/0.bin", 6.0)
    report({"test": "outage_blackhole", **record})
    assert record["attempts_held"] >= 4


def test_the_same_mount_serves_again_after_an_outage_longer_than_the_budget(
        mount: Mount) -> None:
    """While the port refuses connections every attempt fails at once: the read gets EIO
    after the whole budget, then the link comes back and the same mount reads the same
    file (errors are not cached), on the handle that failed and on new ones."""
    proxy = mount.proxy
    proxy.clear()
    key = "outage/1.bin"
    failures_before = len(mount.failures())
    fd = os.open(mount.path / key, os.O_RDONLY | os.O_DIRECT)
    try:
        proxy.outage("refuse")
        began = time.monotonic()
        try:
            with pytest.raises(OSError) as caught:
                os.pread(fd, len(FILES[key]), 0)
            failed_after = time.monotonic() - began
            assert caught.value.errno == errno.EIO
            assert mount.failures()[failures_before:] == [key]  # after the whole budget
        finally:
            proxy.restore()
        assert os.pread(fd, len(FILES[key]), 0) == FILES[key]
    finally:
        os.close(fd)
    assert read_direct(mount.path / "outage/2.bin", 0, 150 * KiB) == FILES["outage/2.bin"]
    report({"test": "outage_refuse", "eio_after_s": round(failed_after, 2),
            "attempts": ATTEMPTS, "connections_cut": proxy.faults["cut"]})


@pytest.mark.soak
def test_a_read_waits_out_a_one_minute_outage(s3_server: S3Server, bucket: str,
                                              tmp_path: Path) -> None:
    """The link comes back after a minute: with 10 attempts of up to 10 s each, the read
    in flight outlasts it."""
    with proxied_mount(s3_server, tmp_path / "mnt", read_timeout=10.0) as m:
        record = survive_outage(m, "outage/2.bin", 60.0)
        assert record["attempts_held"] >= 6
        assert read_direct(m.path / "large/0.bin", 0, MiB) == FILES["large/0.bin"][:MiB]
    report({"test": "outage_blackhole_soak", **record})
