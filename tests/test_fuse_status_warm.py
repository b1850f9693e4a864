"""`bucketfs status` and `bucketfs warm` on live mounts: the status agrees with /metrics
and with the requests a counting proxy saw; warming makes the next epoch go without a
GET; Ctrl-C stops a warm job and the mount serves on; data that does not fit the cache
is said so in one line; a mount with hints off still answers status and warm; another
user gets neither (unless in --hints-group)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bucketfs import runtime
from bucketfs.hints.client import Target
from bucketfs.hints.control import start_warm, status
from bucketfs.status import REQUEST_PRICES
from tests.mounting import bucketfs, drop_page_cache, metrics, mounted, status_json
from tests.servers import free_ports

pytestmark = pytest.mark.fuse

KiB, MiB = 1024, 1024**2
FILES = {f"train/c{i % 3}/{i:03d}.jpg": random.Random(i).randbytes(40 * KiB + 37 * i)
         for i in range(40)}
FILES["big/blob.bin"] = random.Random(99).randbytes(3 * MiB + 11)
BLOCKS = 40 + 4  # one GET per image; three 1 MiB blocks and a tail for the big one


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.create_bucket("status-warm")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3_server.put("status-warm", *kv), FILES.items()))
    return "status-warm"


@pytest.fixture
def counted(s3_server, bucket, fault_proxy):
    proxy = fault_proxy(s3_server.endpoint)
    return proxy, {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}


def origin_seen(proxy) -> dict[str, int]:
    """What the bucket was asked, by the daemon's names for it."""
    lists = proxy.count("GET", "list-type=2")
    return {"get": proxy.count("GET") - lists, "head": proxy.count("HEAD"), "list": lists}


def read_everything(mnt: Path) -> None:
    for name, data in FILES.items():
        assert (mnt / name).read_bytes() == data, name


def target(mnt: Path) -> Target:
    return Target(str(mnt.resolve()), os.getuid())


def settle(mnt: Path) -> dict:
    """The status once nothing moves: no write-through, read-ahead or prefetch under way."""
    for _ in range(200):
        report = status(target(mnt))
        ssd = [t for t in report["cache"]["tiers"] if t["name"] == "ssd"]
        prefetch = report["prefetch"]
        if (not ssd or not ssd[0]["write_queue_bytes"]) \
                and not prefetch["readahead"]["inflight_bytes"] \
                and not prefetch.get("inflight_bytes"):
            return report
        time.sleep(0.05)
    raise AssertionError("the mount did not settle")


@pytest.mark.root
def test_status_agrees_with_metrics_and_with_what_the_origin_saw(counted, tmp_path):
    proxy, env = counted
    port = free_ports(1)[0]
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--block-size", "1MiB", "--ram-cache", "2MiB", "--disk-free-floor", "0",
            "--metrics-port", str(port), "--retry-base-delay", "0.01")
    with mounted("s3://status-warm", tmp_path / "mnt", *args, env=env) as mnt:
        before, scrape_before = status_json(mnt), metrics(port)
        proxy.clear()  # the mount's own LIST of the root and its access check are before
        proxy.add_rule(method="GET", path_contains="train/c1/001.jpg", action="status:503",
                       times=1)  # one retry, which the bucket sees and so must the status
        read_everything(mnt)
        drop_page_cache()
        read_everything(mnt)  # RAM holds 2 MiB: most of this comes from the SSD tier
        settle(mnt)
        report, scrape, again = status_json(mnt), metrics(port), status_json(mnt)
        text = bucketfs("status", str(mnt))
    seen = origin_seen(proxy)
    origin, cache = report["origin"], report["cache"]
    assert set(report) >= {"mount", "origin", "cache", "prefetch", "errors"}
    # Against the bucket: every request it saw, by kind, retries included.
    for kind in ("get", "head", "list"):
        assert origin["requests"][kind] - before["origin"]["requests"][kind] == seen[kind], kind
    assert seen["get"] == BLOCKS + 1 and origin["retries"] - before["origin"]["retries"] == 1
    assert origin["bytes"] - before["origin"]["bytes"] == sum(map(len, FILES.values()))
    # Against /metrics: the same counters, read a moment apart with nothing moving.
    for kind in ("get", "head", "list"):
        assert origin["requests"][kind] == \
            scrape[f'bucketfs_origin_requests_total{{kind="{kind}"}}']
    assert origin["retries"] == scrape["bucketfs_origin_retries_total"]
    assert origin["bytes"] == scrape["bucketfs_origin_bytes_total"]
    assert cache["misses"] == scrape["bucketfs_cache_misses_total"]
    assert {t["name"] for t in cache["tiers"]} == {"ram", "ssd"}
    for tier in cache["tiers"]:
        name = tier["name"]
        assert tier["hits"] == scrape[f'bucketfs_cache_hits_total{{tier="{name}"}}']
        assert tier["served_bytes"] == \
            scrape[f'bucketfs_cache_served_bytes_total{{tier="{name}"}}']
        assert tier["used"] == scrape[f'bucketfs_cache_used_bytes{{tier="{name}"}}']
        assert tier["capacity"] == scrape[f'bucketfs_cache_capacity_bytes{{tier="{name}"}}']
        assert tier["evictions"] == scrape[f'bucketfs_cache_evictions_total{{tier="{name}"}}']
    ram, ssd = cache["tiers"]
    assert ram["capacity"] == 2 * MiB and ram["evictions"] > 0 and ssd["hits"] > 0
    assert ssd["writable"] and ssd["writes"] == scrape["bucketfs_cache_ssd_writes_total"]
    assert ram["released"] == scrape["bucketfs_cache_ram_released_total"]
    assert report["prefetch"]["readahead"]["prefetches"] == \
        scrape["bucketfs_readahead_prefetches_total"]
    assert report["errors"]["background_failures"] == \
        scrape["bucketfs_background_failures_total"] == 0
    # The serving thread answered the reads; the daemon's CPU includes its.
    serving = "bucketfs_serving_thread_cpu_seconds_total"
    assert scrape[serving] > scrape_before[serving]
    assert scrape["bucketfs_daemon_cpu_seconds_total"] >= scrape[serving]
    load = report["load"]
    assert 0 <= load["serving_thread_busy"] <= 1.05 and load["interval_s"] > 0
    assert load["daemon_cores"] >= load["serving_thread_busy"] - 0.01
    assert report["prefetch"]["hits"] == scrape["bucketfs_prefetch_hits_total"]
    lookups = ram["hits"] + ssd["hits"] + cache["misses"]
    assert cache["hit_ratio"]["total"] == round((ram["hits"] + ssd["hits"]) / lookups, 4)
    # The estimate is the published prices times the requests.
    prices = REQUEST_PRICES["s3"]
    cost = origin["cost"]
    assert cost["estimate"] and cost["usd_per_1000"] == prices
    assert cost["usd"]["total"] == pytest.approx(
        sum(origin["requests"][k] * prices[k] / 1000 for k in prices), abs=1e-6)
    assert report["mount"]["url"] == "s3://status-warm/"
    assert report["mount"]["endpoint"] == proxy.endpoint
    assert report["mount"]["metrics"] == f"127.0.0.1:{port}"
    for section in ("origin", "cache"):  # nothing moved between the two reports
        assert again[section]["requests" if section == "origin" else "misses"] == \
            report[section]["requests" if section == "origin" else "misses"]
    # The text view shows the same figures, aligned.
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"mount     s3://status-warm/ on {mnt.resolve()}"
    assert any(line.startswith("origin    GET ") and
               f"GET {origin['requests']['get']:,} " in line for line in lines), lines
    header, ram_line, ssd_line = [line for line in lines
                                  if line[10:14] in ("tier", "ram ", "ssd ")]
    column = header.index("budget")  # columns line up under their heading
    assert ram_line[column:].startswith("2.0 MiB") and ssd_line[column:].startswith("16.0 GiB")
    assert any("estimated" in line and "AWS S3" in line for line in lines)
    assert any(line.startswith("errors    retries 1 ") for line in lines), lines
    assert any(line.startswith("load      serving thread ") for line in lines), lines


@pytest.mark.root
def test_warm_then_an_epoch_makes_no_get(counted, tmp_path):
    proxy, env = counted
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--block-size", "1MiB", "--ram-cache", "2MiB", "--disk-free-floor", "0")
    with mounted("s3://status-warm", tmp_path / "mnt", *args, env=env) as mnt:
        proxy.clear()
        result = bucketfs("warm", str(mnt))
        assert result.returncode == 0, result.stderr
        total = sum(map(len, FILES.values()))
        assert result.stdout.startswith(f"warmed {len(FILES)} files ")
        assert f"{len(FILES)} fetched, 0 cached already; 0 errors" in result.stdout
        progress = [line for line in result.stderr.splitlines()
                    if line.startswith("bucketfs warm: [") or "finding" in line]
        assert progress, result.stderr  # not a terminal: a line every few seconds
        assert origin_seen(proxy)["get"] == BLOCKS
        (job,) = status(target(mnt))["warm"]
        assert (job["state"], job["files_done"], job["bytes_done"]) == \
            ("done", len(FILES), total)
        settle(mnt)
        proxy.clear()
        drop_page_cache()
        read_everything(mnt)  # RAM holds 2 MiB of it; the SSD tier the rest
        assert origin_seen(proxy) == {"get": 0, "head": 0, "list": 0}
        (tmp_path / "list.txt").write_text("big/blob.bin\ntrain/c1\n")
        again = bucketfs("warm", str(mnt), "train/c0", "--list", str(tmp_path / "list.txt"))
        assert again.returncode == 0, again.stderr
        assert "0 fetched" in again.stdout and origin_seen(proxy)["get"] == 0
        report = status(target(mnt))
        assert report["cache"]["tiers"][1]["hits"] > 0


def test_ctrl_c_stops_the_warm_job_and_the_mount_serves_on(counted, tmp_path):
    proxy, env = counted
    proxy.add_rule(method="GET", path_contains="/train/", action="delay:0.15")
    args = ("--addressing-style", "path", "--prefetch-connections", "2")
    with mounted("s3://status-warm", tmp_path / "mnt", *args, env=env) as mnt:
        os.listdir(mnt / "train")  # listed before the clock starts
        # Ctrl-C as at a terminal: a test run in the background (nohup, `&`) passes on
        # SIGINT ignored, as a shell does to a background job, and the client keeps that
        # (the job then ran to its end and exited 0, a failure that looked like a race).
        warm = subprocess.Popen([sys.executable, "-m", "bucketfs", "warm", str(mnt / "train")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            for _ in range(400):
                jobs = status(target(mnt))["warm"]
                if jobs and jobs[0]["files_done"] >= 4:
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(f"the warm job did not progress: {jobs}")
            warm.send_signal(signal.SIGINT)
            out, err = warm.communicate(timeout=30)
        finally:
            warm.kill()
        assert warm.returncode == 130, (out, err)
        assert "interrupted: stopping warm job 1" in err and "stopped:" in err, err
        (job,) = status(target(mnt))["warm"]
        assert job["state"] == "cancelled" and job["done"]
        assert 4 <= job["files_done"] < 40
        gets = origin_seen(proxy)["get"]
        time.sleep(0.5)
        assert origin_seen(proxy)["get"] == gets, "the job went on fetching"
        # What it fetched stays cached; the rest is read as usual.
        first = sorted(name for name in FILES if name.startswith("train/"))[0]
        assert (mnt / first).read_bytes() == FILES[first]
        assert origin_seen(proxy)["get"] == gets
        read_everything(mnt)
        assert os.listdir(mnt) and status(target(mnt))["errors"]["background_failures"] == 0


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_warm_says_in_one_line_when_the_data_will_not_fit(tmp_path, tier):
    bucket = tmp_path / "bucket"
    for i in range(30):
        (bucket / "d").mkdir(parents=True, exist_ok=True)
        (bucket / "d" / f"{i:02d}.bin").write_bytes(bytes([i]) * 100 * KiB)
    budget = ("--ram-cache", "1MiB") if tier == "ram" else (
        "--cache-dir", str(tmp_path / "cache"), "--disk-cache", "1MiB",
        "--disk-free-floor", "0")
    with mounted(f"file://{bucket}", tmp_path / "mnt", *budget) as mnt:
        result = bucketfs("warm", str(mnt))
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "warning" in line]
        assert warnings == [
            f"bucketfs warm: warning: 2.9 MiB in 30 files will not fit the {tier.upper()} "
            "cache's budget of 1.0 MiB: warming the first 10 files (1000.0 KiB)"], \
            result.stderr
        (job,) = status(target(mnt))["warm"]
        assert (job["files_done"], job["skipped_files"]) == (10, 20)
        assert result.stdout.startswith("warmed 10 files (1000.0 KiB)")


def test_with_hints_off_the_socket_still_answers_status_and_warm(tmp_path):
    bucket = tmp_path / "bucket"
    (bucket / "a").mkdir(parents=True)
    for i in range(5):
        (bucket / "a" / f"{i}.bin").write_bytes(bytes([i]) * 5000)
    (tmp_path / "order.txt").write_text("a/0.bin\n")
    with mounted(f"file://{bucket}", tmp_path / "mnt", "--prefetch-window", "0") as mnt:
        report = status_json(mnt)
        assert report["prefetch"]["enabled"] is False and report["origin"]["cost"] is None
        text = bucketfs("status", str(mnt))
        assert "hints off" in text.stdout and "cost: none" in text.stdout, text.stdout
        warm = bucketfs("warm", str(mnt), "a/1.bin", str(mnt / "a" / "2.bin"))
        assert warm.returncode == 0 and warm.stdout.startswith("warmed 2 files"), warm.stderr
        hint = bucketfs("hint", str(mnt), str(tmp_path / "order.txt"))
        assert hint.returncode == 1 and "hints are off on this mount" in hint.stderr
        outside = bucketfs("warm", str(mnt), "/etc")
        assert outside.returncode == 1 and "is not under the mount" in outside.stderr
    gone = bucketfs("status", str(tmp_path / "mnt"))
    assert gone.returncode == 1 and "not in a bucketfs mount" in gone.stderr


NOBODY, GROUP = 65534, 4242
# The CLI is imported before the privileges are dropped: the interpreter's own library
# may sit where uid 65534 cannot read (a Python under root's 0700 home, as pyenv puts it).
AS_NOBODY = """
import os, sys
from bucketfs.cli import main
os.setgroups([int(g) for g in sys.argv[1].split(",") if g])
os.setgid(65534)
os.setuid(65534)
sys.argv = ["bucketfs", *sys.argv[2:]]
sys.exit(main())
"""


def as_nobody(*args: str, groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", AS_NOBODY, ",".join(map(str, groups)), *args],
                          capture_output=True, text=True, timeout=60, cwd="/")


@pytest.fixture
def open_base():
    """A directory every user may enter (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="bfs-status-", dir="/tmp"))
    base.chmod(0o755)
    for i in range(4):
        (base / "bucket" / "d").mkdir(parents=True, exist_ok=True)
        (base / "bucket" / "d" / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.root
def test_another_user_gets_no_status_and_starts_no_warm(open_base, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # as under systemd
    url = f"file://{open_base / 'bucket'}"
    # allow_other: the other user may read the mount, so only the socket keeps it out.
    with mounted(url, open_base / "mnt", "--allow-other") as mnt:
        state = runtime.state_dir(str(mnt.resolve()))
        assert sorted(os.listdir(mnt / "d")) == ["0.bin", "1.bin", "2.bin", "3.bin"]
        # The state directory's modes keep it out first: it cannot even see the socket.
        for command in (("status", str(mnt)), ("warm", str(mnt))):
            result = as_nobody(*command)
            assert result.returncode == 1 and "no hints socket" in result.stderr, result
        # With the modes opened, the daemon refuses it by its credentials.
        state.chmod(0o755)
        (state / "hints.sock").chmod(0o666)
        refused = "refused: permission denied: uid 65534 is not the mount owner"
        for command in (("status", str(mnt), "--json"), ("warm", str(mnt))):
            result = as_nobody(*command)
            assert result.returncode == 1 and refused in result.stderr, result
            assert not result.stdout
        assert status(target(mnt))["warm"] == []  # no job was started
    with mounted(url, open_base / "mnt", "--hints-group", str(GROUP)) as mnt:
        member = as_nobody("status", str(mnt), "--json", groups=(GROUP,))
        assert member.returncode == 0, member.stderr
        assert json.loads(member.stdout)["mount"]["mountpoint"] == str(mnt.resolve())
        outsider = as_nobody("status", str(mnt), groups=(1,))
        assert outsider.returncode == 1 and "no hints socket" in outsider.stderr


def test_unmounting_stops_a_warm_job_at_once(counted, tmp_path):
    proxy, env = counted
    proxy.add_rule(method="GET", path_contains="/train/", action="delay:0.2")
    args = ("--addressing-style", "path", "--prefetch-connections", "2",
            "--cache-dir", str(tmp_path / "cache"), "--disk-free-floor", "0")
    mnt = tmp_path / "mnt"
    with mounted("s3://status-warm", mnt, *args, env=env):
        files = sorted(name for name in FILES if name.startswith("train/"))
        assert start_warm(target(mnt), files) == 1
        for _ in range(200):
            if status(target(mnt))["warm"][0]["files_done"] >= 2:
                break
            time.sleep(0.02)
        started = time.monotonic()
    # `mounted` unmounted and waited for the daemon: not for the 38 files left (~4 s).
    assert time.monotonic() - started < 2.5
    log = (tmp_path / "mnt.log").read_text()
    assert re.search(r"warm job 1 cancelled: \d+ of 40 files", log), log
