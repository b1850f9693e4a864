"""kill -9 at seeded random moments of the daemon's work — cold fills with many readers,
hinted prefetch, chunk packing, continuous SSD eviction — then a remount on the same
cache directory serves every byte right, a second pass works, and the cache directory
is consistent (tests/crashing.py). A stale mountpoint left by a killed daemon is
recovered by `bucketfs mount`, or cleared by `bucketfs umount`.

A failing run names its seed in its test id and its messages; replay it with
`pytest tests/test_crash.py -k 'seed-17-'` (soak seeds: add `-m soak`).
BUCKETFS_CRASH_REPORT=FILE appends one JSON line per run (phase, kills, bytes, time).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketfs.runtime import mounted as mount_entry
from tests import crashing
from tests.crashing import Plan, Work
from tests.mounting import bucketfs, force_unmount, mounted

pytestmark = pytest.mark.fuse

BUCKET = "crashes"
CI_SEEDS = range(20)  # five runs of each phase
SOAK_SEEDS = range(1000, 1200)


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return crashing.dataset()


@pytest.fixture(scope="module")
def bucket(s3_server, files) -> tuple[str, dict[str, str]]:
    """The module's one bucket: its URL and the environment that reaches it."""
    s3_server.create_bucket(BUCKET)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3_server.put(BUCKET, *kv), files.items()))
    return f"s3://{BUCKET}", s3_server.env()


def crash_run(seed: int, bucket: tuple[str, dict[str, str]], files: dict[str, bytes],
              tmp_path: Path) -> None:
    url, env = bucket
    p = crashing.plan(seed)
    began = time.monotonic()
    cache, mnt = tmp_path / "cache", tmp_path / "mnt"
    mnt.mkdir()
    args = crashing.mount_args(p, cache)
    rng = random.Random(seed)
    logs = [tmp_path / "first.log"]
    crashing.mount(url, mnt, args, env, logs[0])
    work = Work(mnt, files)
    left = crashing.run_then_kill(work, p, crashing.WORKLOADS[p.phase], rng, p.delay, cache)
    assert not work.wrong, f"{p.describe()}: wrong bytes before the kill: {work.wrong[:5]}"
    kills = 1
    if p.second_kill is not None:  # a crash of the daemon that recovered from one
        logs.append(tmp_path / "second.log")
        crashing.mount(url, mnt, args, env, logs[-1])
        again = Work(mnt, files)
        crashing.run_then_kill(again, p, crashing.cold, rng, p.second_kill, cache)
        assert not again.wrong, f"{p.describe()}: wrong bytes after the first remount"
        kills += 1
    logs.append(tmp_path / "remount.log")
    crashing.mount(url, mnt, args, env, logs[-1])
    try:
        verified = crashing.verify(mnt, files)
        crashing.second_pass(mnt, files)
    except AssertionError as exc:
        raise AssertionError(f"{p.describe()}: {exc}") from None
    finally:
        unmounted = bucketfs("umount", str(mnt))
        force_unmount(mnt)
    assert unmounted.returncode == 0, f"{p.describe()}: umount: {unmounted.stderr}"
    for log in logs[1:]:  # each opened a cache a kill -9 left
        found = crashing.suspicious_lines(log)
        assert not found, f"{p.describe()}: {log.name}: {found[:5]}"
    try:
        facts = crashing.check_cache(cache, p.budget)
    except AssertionError as exc:
        raise AssertionError(f"{p.describe()}: cache directory: {exc}") from None
    report(p, kills, verified, time.monotonic() - began, facts, left)


def report(p: Plan, kills: int, verified: int, seconds: float,
           facts: crashing.CacheFacts, left: dict[str, int]) -> None:
    path = os.environ.get("BUCKETFS_CRASH_REPORT")
    if not path:
        return
    line = {"seed": p.seed, "phase": p.phase, "delay": round(p.delay, 3), "kills": kills,
            "hinted": p.hinted, "page_size": p.page_size, "budget": p.budget,
            "bytes_verified": verified,
            "seconds": round(seconds, 2), "used": facts.used, "blocks": facts.block_entries,
            "packed": facts.packed_entries, "chunks": facts.chunks,
            "left_by_kill": left}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def seed_id(seed: int) -> str:
    return f"seed-{seed}-{crashing.plan(seed).phase}"


@pytest.mark.parametrize("seed", CI_SEEDS, ids=seed_id)
def test_kill_9_then_remount_serves_every_byte(seed, bucket, files, tmp_path):
    crash_run(seed, bucket, files, tmp_path)


@pytest.mark.soak
@pytest.mark.parametrize("seed", SOAK_SEEDS, ids=seed_id)
def test_soak_kill_9_then_remount_serves_every_byte(seed, bucket, files, tmp_path):
    crash_run(seed, bucket, files, tmp_path)


def test_kill_9_between_two_pages_of_a_listing_then_remount(s3_server, bucket, files,
                                                            fault_proxy, tmp_path):
    """A listing is stored page by page; the daemon killed between two pages left
    entries whose inode numbers the next mount handed out again, so reading a file of
    that directory served another directory's file (fixed in cache/listings.py)."""
    url, env = bucket
    proxy = fault_proxy(s3_server.endpoint)
    proxy.add_rule("GET", "prefix=train%2Fc0%2F", "delay:0.3")  # ten pages of four keys
    env = {**env, "AWS_ENDPOINT_URL": proxy.endpoint}
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    args = ["--addressing-style", "path", "--cache-dir", str(cache), "--list-page-size", "4"]
    crashing.mount(f"{url}/train", mnt, args, env, tmp_path / "first.log")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        listing = pool.submit(os.listdir, mnt / "c0")
        time.sleep(1.0)
        crashing.kill_daemon(mnt)
        with pytest.raises(OSError):
            listing.result()
    force_unmount(mnt)
    proxy.clear()
    with mounted(f"{url}/train", mnt, *args, env=env) as again:
        assert len(os.listdir(again / "c1")) == 40  # listed first: new inodes handed out
        for name, data in files.items():
            if name.startswith(("train/c0/", "train/c1/")):
                path = again / name.removeprefix("train/")
                assert path.read_bytes() == data, name


# --- a stale mountpoint -------------------------------------------------------------------


@contextlib.contextmanager
def stale_mount(url: str, mnt: Path, env: dict[str, str], files: dict[str, bytes],
                ) -> Iterator[None]:
    """Mount, read a little, kill -9 the daemon and leave its mount behind, in use (a
    descriptor of its root, opened before the kill, stays open); cleared at the end."""
    mnt.mkdir(exist_ok=True)
    result = bucketfs("mount", url, str(mnt), "--addressing-style", "path", env=env)
    assert result.returncode == 0, result.stderr
    holder = os.open(mnt, os.O_RDONLY)
    try:
        name = next(iter(files))
        assert (mnt / name).read_bytes() == files[name]
        crashing.kill_daemon(mnt)
        with pytest.raises(OSError) as stale:
            os.statvfs(mnt)
        assert stale.value.strerror == "Transport endpoint is not connected"
        yield
    finally:
        os.close(holder)
        force_unmount(mnt)


def test_mount_on_a_stale_mountpoint_recovers_it(bucket, files, tmp_path):
    url, env = bucket
    mnt = tmp_path / "mnt"
    log = tmp_path / "recovered.log"
    with stale_mount(url, mnt, env, files):
        result = bucketfs("mount", url, str(mnt), "--addressing-style", "path",
                          "--log-file", str(log), env=env)
        assert result.returncode == 0, result.stderr
        assert log.read_text().count("was a stale bucketfs mount") == 1
        name = sorted(files)[-1]
        assert (mnt / name).read_bytes() == files[name]
        entries = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if f" {mnt} " in line]
        assert len(entries) == 1, entries  # the stale one is gone, not stacked under
        assert bucketfs("umount", str(mnt)).returncode == 0
        assert mount_entry(str(mnt)) is None


def test_umount_clears_a_stale_mount_someone_still_uses(bucket, files, tmp_path):
    """A process left inside a stale mount (a shell's working directory, an open file)
    makes a plain unmount fail with EBUSY; `bucketfs umount` still clears it."""
    url, env = bucket
    mnt = tmp_path / "mnt"
    with stale_mount(url, mnt, env, files):
        result = bucketfs("umount", str(mnt))
        assert result.returncode == 0, result.stderr
        assert mount_entry(str(mnt)) is None
        assert os.listdir(mnt) == []  # the directory underneath, empty again


#: Another FUSE filesystem (fstype fuse.otherfs) that serves nothing until killed.
OTHER_FS = """
import sys, pyfuse3, trio
pyfuse3.init(pyfuse3.Operations(), sys.argv[1], {"fsname=other", "subtype=otherfs", "ro"})
print("ready", flush=True)
trio.run(pyfuse3.main)
"""


def test_a_stale_mount_of_another_filesystem_gets_one_line_saying_what_to_run(
        bucket, tmp_path):
    url, env = bucket
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    other = subprocess.Popen([sys.executable, "-c", OTHER_FS, str(mnt)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "ready\n"
        other.kill()
        other.wait()
        result = bucketfs("mount", url, str(mnt), "--addressing-style", "path", env=env)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert lines == [f"bucketfs: error: mountpoint {mnt} is a stale fuse.otherfs mount "
                         f"whose daemon is gone; run: fusermount3 -uz {mnt}"], lines
        fix = lines[0].rsplit("run: ", 1)[1].split()
        assert subprocess.run(fix).returncode == 0
        assert mount_entry(str(mnt)) is None
    finally:
        other.kill()
        force_unmount(mnt)
