"""The benchmark harness's pure parts: request counting, costs, size spread, medians,
the report. No network shaping, no mounts, no root."""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.dataplane_report import by_thread_text, report, requests_text, switches_text
from bench.harness import costs, fuse_census, procstats, tree
from bench.harness.contenders import CONTENDERS, parse_contenders
from bench.harness.dataset import size_summary
from bench.harness.httpcount import RequestStream, classify
from bench.harness.netlab import htb_commands
from bench.harness.report import markdown, with_costs
from bench.harness.runner import sequential_total
from bench.harness.scenarios import LINKS, SCENARIOS
from bench.harness.stats import aggregate, format_summary, summarize

# --- counting requests -----------------------------------------------------------------


@pytest.mark.parametrize(("method", "target", "kind"), [
    ("GET", "/bench/train/class_00/img_00000.jpg", "GET"),
    ("GET", "/bench/large/large-0.bin?partNumber=1", "GET"),
    ("HEAD", "/bench/train/a.jpg", "HEAD"),
    ("HEAD", "/bench", "HEAD"),
    ("GET", "/bench?list-type=2&prefix=train%2F&delimiter=%2F", "LIST"),
    ("GET", "/bench/?delimiter=/&max-keys=1000&prefix=", "LIST"),  # s3fs: ListObjects v1
    ("GET", "/bench/", "LIST"),
    ("GET", "/bench?location", "OTHER"),
    ("GET", "/", "OTHER"),  # ListBuckets
    ("PUT", "/bench/a", "OTHER"),
])
def test_requests_are_classified_as_s3_bills_them(method: str, target: str, kind: str) -> None:
    assert classify(method, target) == kind


def _request(method: str, target: str, body: bytes = b"", chunked: bool = False) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: 10.201.0.1:9000\r\n"
    if chunked:
        data = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:3], body[3:]))
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + data + b"0\r\n\r\n"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def test_a_stream_split_anywhere_counts_every_pipelined_request() -> None:
    stream = b"".join([
        _request("GET", "/bench/train/a.jpg"),
        _request("PUT", "/bench/b", body=b"GET /bench/x HTTP/1.1\r\n\r\n"),  # a body, not a request
        _request("HEAD", "/bench/c"),
        _request("PUT", "/bench/d", body=b"HEAD /bench/y HTTP/1.1\r\n\r\n", chunked=True),
        _request("GET", "/bench?list-type=2&prefix="),
    ])
    rng = random.Random(0)
    for _ in range(50):
        counter = RequestStream()
        position = 0
        while position < len(stream):
            step = rng.randint(1, 40)
            counter.feed(stream[position:position + step])
            position += step
        assert not counter.broken
        assert counter.counts == {"GET": 1, "HEAD": 1, "LIST": 1, "OTHER": 2}


def test_garbage_stops_counting_that_connection_only() -> None:
    counter = RequestStream()
    counter.feed(b"\x16\x03\x01 not http at all\r\n\r\n")
    counter.feed(_request("GET", "/bench/a"))
    assert counter.broken
    assert sum(counter.counts.values()) == 0


# --- costs -----------------------------------------------------------------------------


def test_request_costs_follow_the_published_prices() -> None:
    one_epoch = {"GET": 3000, "HEAD": 3000, "LIST": 4, "OTHER": 0}
    assert costs.s3_cost(one_epoch) == pytest.approx((6000 * 0.0004 + 4 * 0.005) / 1000)
    assert costs.gcs_cost(one_epoch) == pytest.approx((6000 * 0.0004 + 4 * 0.005) / 1000)
    # A million files read with one GET each: $0.40 at S3 Standard.
    assert costs.per_million_files(costs.s3_cost({"GET": 3000}), 3000) == pytest.approx(0.4)
    assert costs.s3_cost({}) == 0


def test_records_get_costs_only_where_requests_were_counted() -> None:
    records = with_costs([
        {"status": "ok", "origin_GET": 1000, "origin_HEAD": 0, "origin_LIST": 1000},
        {"status": "n/a: nothing"},
    ], files=1000)
    assert records[0]["cost_s3_usd"] == pytest.approx(0.0004 + 0.005)
    assert "cost_s3_usd" not in records[1]


# --- the dataset's size spread ---------------------------------------------------------


def test_size_summary_of_a_lognormal_spread() -> None:
    rng = random.Random(1)
    mu = math.log(110_000) - 0.5**2 / 2
    sizes = [int(rng.lognormvariate(mu, 0.5)) for _ in range(20_000)]
    summary = size_summary(sizes)
    assert summary["count"] == 20_000
    assert summary["mean"] == pytest.approx(110_000, rel=0.02)
    assert summary["log_sd"] == pytest.approx(0.5, rel=0.03)
    assert summary["p10"] < summary["median"] < summary["mean"] < summary["p90"]
    assert size_summary([]) == {"count": 0, "total": 0}


def test_scenarios_and_links_are_what_the_issue_asks_for() -> None:
    assert 2000 <= SCENARIOS["imagenet-small"].images <= 4000
    assert SCENARIOS["tiny"].images <= 250
    assert LINKS["far"].mbit == 200 and 20 <= LINKS["far"].rtt_ms <= 40
    assert LINKS["near"].mbit == 1000 and LINKS["near"].rtt_ms == 2
    assert LINKS["far"].transfer_seconds(25_000_000) == pytest.approx(1.0)


def test_htb_shapes_the_named_device_at_the_named_rate() -> None:
    commands = htb_commands("bfsb-origin", "bfsb-o", 200)
    assert all(c[:3] == ["tc", "-n", "bfsb-origin"] and "bfsb-o" in c for c in commands)
    assert "200mbit" in commands[1]


def test_contenders_are_parsed_by_name() -> None:
    assert [c.name for c in parse_contenders("local,bucketfs-cache")] == [
        "local", "bucketfs-cache"]
    assert len(parse_contenders(None)) == len(CONTENDERS)
    with pytest.raises(ValueError, match="unknown"):
        parse_contenders("local,nfs")


# --- medians and the report ------------------------------------------------------------


def test_summaries_are_medians_with_ranges() -> None:
    summary = summarize([3.0, 1.0, 2.0, float("nan")])
    assert summary is not None
    assert (summary.median, summary.low, summary.high, summary.n) == (2.0, 1.0, 3.0, 3)
    assert format_summary(summary) == "2.0 (1.0\u20133.0)"
    assert format_summary(summarize([2.0])) == "2.0"
    assert summarize([]) is None
    assert format_summary(None) == "—"


def _records() -> list[dict[str, object]]:
    records: list[dict[str, object]] = []
    for repeat, seconds in enumerate((10.0, 12.0, 11.0)):
        for contender in ("local", "bucketfs-cache"):
            for epoch in (1, 2):
                records.append({"repeat": repeat, "contender": contender, "workload": "train",
                                "item": f"epoch {epoch}", "status": "ok",
                                "seconds": seconds * epoch, "stall_s": 1.0,
                                "images_per_s": 300 / seconds, "origin_GET": 300.0,
                                "origin_HEAD": 0.0, "origin_LIST": 1.0})
        records.append({"repeat": repeat, "contender": "local", "workload": "daemon",
                        "item": "training session", "status": "n/a: no daemon"})
    records.append({"repeat": 0, "contender": "bucketfs-cache", "workload": "raw",
                    "item": "cold", "status": "error: boom"})
    return records


def test_aggregate_keeps_every_repeat_and_the_reasons() -> None:
    summary = aggregate(_records())
    epoch1 = summary[("local", "train", "epoch 1")]
    assert epoch1["metrics"]["seconds"].median == 11.0
    assert (epoch1["metrics"]["seconds"].low, epoch1["metrics"]["seconds"].high) == (10.0, 12.0)
    assert "repeat" not in epoch1["metrics"]
    assert summary[("local", "daemon", "training session")]["problems"] == ["n/a: no daemon"]


def test_sequential_total_adds_files_together() -> None:
    files = [{"workload": "sequential", "item": f"large-{i}.bin", "status": "ok",
              "seconds": 2.0, "bytes": 100_000_000, "origin_GET": 25} for i in range(2)]
    (total,) = sequential_total(files)
    assert total["MBps"] == pytest.approx(50.0)
    assert total["origin_GET"] == 50
    (missing,) = sequential_total([{"workload": "sequential", "status": "n/a: no"}])
    assert missing["status"] == "n/a: no"


def test_markdown_report_has_medians_ranges_and_footnotes(tmp_path: Path) -> None:
    meta = {
        "command": "python -m bench run", "started": "now", "repeats": 3,
        "machine": "test", "scenario": "tiny", "link": "far",
        "link_profile": {"rtt_ms": 30, "mbit": 200}, "contenders": ["local", "bucketfs-cache"],
        "contender_descriptions": {"local": "disk", "bucketfs-cache": "cache"},
        "epochs": 2, "workers": 4, "batch_size": 64, "gpu_ms": 50.0, "threads": 16,
        "dataset": {"images": 300, "classes": 3, "image_bytes": 33_000_000,
                    "sizes": {"mean": 110_000, "median": 97_000, "p10": 50_000,
                              "p90": 190_000},
                    "large": ["large-0.bin"], "large_bytes": 2**25},
        "link_bound_images_s": 1.3, "link_bound_large_s": 1.3,
    }
    text = markdown(meta, with_costs(_records(), files=300))
    assert "| local | 11.0 (10.0\u201312.0) | 22.0 (20.0\u201324.0) |" in text
    assert "300 / 0 / 1" in text
    assert "error [" in text and "n/a [" in text
    assert "n/a: no daemon" in text and "error: boom" in text
    json.dumps(meta)  # the meta the runner writes is plain JSON


# --- the FUSE request census -----------------------------------------------------------

#: `perf script` lines as this kernel (6.18) prints the tracepoint, leading columns cut.
PERF_SCRIPT = "\n".join(f"python 2251 [000] 59473.6: fuse:fuse_request_send: {event}" for event in (
    "connection 40 req 8 opcode 1 (FUSE_LOOKUP) len 44",
    "connection 40 req 12 opcode 14 (FUSE_OPEN) len 48",
    "connection 40 req 14 opcode 39 (FUSE_IOCTL) len 72",
    "connection 40 req 16 opcode 15 (FUSE_READ) len 80",
    "connection 41 req 16 opcode 15 (FUSE_READ) len 80",
    "connection 40 req 18 opcode 39 (FUSE_IOCTL) len 72",
))


def test_the_census_counts_the_requests_of_its_own_connection_by_kind() -> None:
    counts = fuse_census.count_requests(PERF_SCRIPT, connection=40)
    assert counts == {"LOOKUP": 1, "OPEN": 1, "IOCTL": 2, "READ": 1}
    assert fuse_census.count_requests(PERF_SCRIPT, connection=41) == {"READ": 1}
    assert fuse_census.count_requests("", connection=40) == {}


def test_the_data_path_report_says_which_requests_each_file_cost() -> None:
    assert requests_text({"IOCTL": 1.0, "READ": 1.0, "OPEN": 0.003}) == "1.00 IOCTL, 1.00 READ"
    assert requests_text({}) == "none"  # counted, and nothing was asked
    assert requests_text(None) == "not counted"  # no perf or no tracepoints here


# --- which tree a benchmark's daemon runs -----------------------------------------------


def test_a_spawned_daemon_imports_the_benchmarks_own_tree(tmp_path: Path) -> None:
    """The daemon starts as `python -P -m bucketfs`, which never imports from its current
    directory: a benchmark run from a second checkout measured the installed code in
    both arms until `this_tree()` named the checkout. A copy of the package stands in
    for that second tree."""
    other = tmp_path / "worktree"
    shutil.copytree(tree.ROOT / "bucketfs", other / "bucketfs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tree.ROOT / "bench", other / "bench",
                    ignore=shutil.ignore_patterns("__pycache__", "results"))
    probe = "from bench.harness.tree import this_tree; print(this_tree()['PYTHONPATH'])"
    named = subprocess.run([sys.executable, "-P", "-c", probe], cwd=other, env={
        "PYTHONPATH": str(other)}, capture_output=True, text=True, check=True).stdout.strip()
    assert named.split(":")[0] == str(other)
    imported = subprocess.run(
        [sys.executable, "-P", "-c", "import bucketfs; print(bucketfs.__file__)"],
        cwd=tmp_path, env={"PYTHONPATH": named}, capture_output=True, text=True,
        check=True).stdout.strip()
    assert imported == str(other / "bucketfs" / "__init__.py")


def _burn(seconds: float) -> None:
    """Spin until this thread has used `seconds` of CPU."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def _block(times: int) -> None:
    """Block `times` times (each a voluntary context switch: the thread sleeps and is
    woken)."""
    for _ in range(times):
        time.sleep(0.001)


def _threads_that_stay(works: list[tuple[Callable[[], None], bytes | None]],
                       release: threading.Event) -> list[threading.Thread]:
    """A thread per (work, name), started: each does its work, then stays alive until
    `release` (a thread that has exited is gone from /proc/PID/task). Returns once every
    work is done. `name`: the thread names itself, as native threads (tokio's,
    RocksDB's) do; otherwise it keeps Python's name, as trio names its workers."""
    def run(work: Callable[[], None], name: bytes | None, done: threading.Event) -> None:
        if name is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
        work()
        done.set()
        release.wait(30)

    threads, finished = [], []
    for work, name in works:
        done = threading.Event()
        # Named as trio names its workers: from Python 3.14 the OS sees that name.
        thread = threading.Thread(target=run, args=(work, name, done), name="Trio thread 99")
        thread.start()
        threads.append(thread)
        finished.append(done)
    for done in finished:
        assert done.wait(30)
    return threads


def test_the_daemons_cpu_is_split_into_its_loop_its_python_threads_and_the_rest() -> None:
    pid = os.getpid()
    assert threading.get_native_id() == pid  # the main thread, as the daemon's loop
    total_before, before = procstats.cpu_seconds(pid), procstats.thread_cpu(pid)
    release = threading.Event()
    try:
        _burn(0.2)
        burners = _threads_that_stay([(lambda: _burn(0.4), None),
                                      (lambda: _burn(0.3), b"native-burner")], release)
        after = procstats.thread_cpu(pid)
        total = procstats.cpu_seconds(pid) - total_before
    finally:
        release.set()
    for thread in burners:
        thread.join()
    split = procstats.split_by_thread(pid, before, after, total)
    # /proc counts in ticks of 10 ms; starting the threads adds a little.
    assert split["loop"] == pytest.approx(0.2, abs=0.06)
    assert split["workers"] == pytest.approx(0.4, abs=0.06)  # started after `before`
    assert split["other"] == pytest.approx(0.3, abs=0.06)
    assert sum(split.values()) == pytest.approx(total)
    # A thread gone by the second sample is counted with the rest, not lost.
    del after[burners[0].native_id]
    gone = procstats.split_by_thread(pid, before, after, total)
    assert gone["workers"] == pytest.approx(0.0, abs=0.02)
    assert gone["other"] == pytest.approx(0.7, abs=0.1)


def test_the_data_path_report_gives_the_loops_ceiling() -> None:
    row = {"cpu_ms_per_file_by_thread": {"loop": 0.25, "workers": 0.1, "other": 0.125}}
    assert by_thread_text(row) == "0.250 ms | 0.100 ms | 0.125 ms | 4,000"
    assert by_thread_text({}) == "— | — | — | —"


def test_the_data_path_report_names_each_large_read() -> None:
    def read(**row: object) -> dict[str, object]:
        return {"reader": "bucketfs, dd bs=4M", "mb_per_s": 500.0, "cpu_s_per_gib": 1.5, **row}

    rows = [read(), read(memory_backed_first=True),
            read(memory_backed_first=True, small_ram_tier="256MiB"),
            read(memory_backed_first=True, ram_only=True),
            read(ram_only=True, from_ram_tier=True),
            read(memory_backed_first=True, from_ssd_tier=True)]
    text = report({"machine": "m", "clients": [], "passes": {}, "large": rows, "scale": []})
    labels = [line.split(" | ")[0].removeprefix("| bucketfs, dd bs=4M") for line in
              text.splitlines() if line.startswith("| bucketfs, dd")]
    assert labels == ["", ", memory backed first", ", RAM tier 256MiB, memory backed first",
                      ", no SSD tier, memory backed first",
                      ", again from the RAM tier (page cache dropped)",
                      ", from the SSD tier (remounted), memory backed first"]


def test_voluntary_context_switches_are_split_like_the_cpu() -> None:
    pid = os.getpid()
    before = procstats.thread_switches(pid)
    release = threading.Event()
    try:
        blockers = _threads_that_stay([(lambda: _block(40), None),
                                       (lambda: _block(25), b"native-blocker")], release)
        after = procstats.thread_switches(pid)
    finally:
        release.set()
    for thread in blockers:
        thread.join()
    split = procstats.switches_by_thread(pid, before, after)
    # Each sleep blocks once; starting, the Event and the GIL may add a few more.
    assert 40 <= split["workers"] <= 60
    assert 25 <= split["other"] <= 45
    assert split["loop"] < 25  # this thread only waited on two Events
    assert procstats.switches_by_thread(pid + 10**7, before, after) == {
        "loop": 0, "workers": 0, "other": 0}  # a process that is gone
    row = {"switches_per_file_by_thread": {"loop": 0.95, "workers": 7.18, "other": 2.456}}
    assert switches_text(row) == "0.95 / 7.18 / 2.46"
    assert switches_text({}) == "—"


def test_placement_variants_name_cores_and_runtime_threads() -> None:
    from bench.placement import parse_variant, summary

    assert parse_variant("all") == (None, {})
    assert parse_variant("cpus4+tokio2") == (4, {"TOKIO_WORKER_THREADS": "2"})
    for bad in ("cpus0", "tokio", "cores4", "cpus4+x"):
        with pytest.raises(ValueError):
            parse_variant(bad)

    def row(name: str, cores: int, cold_ms: float) -> dict:
        cold = {"cpu_ms_per_file": cold_ms, "files_per_s": 2000.0,
                "cpu_ms_per_file_by_thread": {"loop": 0.3, "workers": cold_ms - 0.5,
                                              "other": 0.2}}
        return {"variant": name, "daemon_cores": cores, "cold": cold,
                "warm_ram": {"cpu_ms_per_file": 0.15, "files_per_s": 6000.0}}

    text = summary([row("all", 16, 1.1), row("cpus4", 4, 0.9), row("all", 16, 1.0)])
    assert "| all | 16 | 1.00-1.10 ms (0.30 / 0.55 / 0.20) | 2,000 |" in text
    assert "| cpus4 | 4 | 0.90 ms (0.30 / 0.40 / 0.20) |" in text


def test_the_hinted_cost_table_gives_each_arms_median_and_runs() -> None:
    from bench.hinted_cost import ARMS, table

    def row(arm: str, ms: float) -> dict:
        return {"arm": arm, "cpu_ms_per_file": ms, "files_per_s": 600.0,
                "cpu_ms_per_file_by_thread": {"loop": 0.5, "workers": ms - 0.8, "other": 0.3}}

    rows = [row(arm, ms + i) for i, arm in enumerate(ARMS) for ms in (1.2, 1.3, 1.25)]
    text = table(rows)
    assert "| no hints | 1.25 ms (1.20, 1.30, 1.25) | 0.50 / 0.45 / 0.30 | 600 |" in text
    assert "| the order and the next | 3.25 ms (3.20, 3.30, 3.25) |" in text
