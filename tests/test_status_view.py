"""What a person sees: the text view of a status report (aligned, every section, the
estimate labelled), the warm progress bar (redrawn in place on a terminal, a line every
few seconds otherwise, with bytes, files, rate and ETA), and which files `bucketfs warm`
sends for the paths it is given."""

from __future__ import annotations

import io
import os

import pytest

from bucketfs import warm_client
from bucketfs.hints.client import HintError, Target
from bucketfs.status import request_cost
from bucketfs.status_view import duration, render, size, usd
from bucketfs.warm_client import ProgressBar, collect

REPORT = {
    "schema": 1,
    "mount": {"url": "s3://imagenet/train/", "endpoint": "https://s3.us-east-1.amazonaws.com",
              "mountpoint": "/mnt/train", "pid": 4242, "version": "0.1.0",
              "started": "2026-11-24T05:00:00+00:00", "uptime_s": 3725.0,
              "block_size": 4 << 20, "hints": True, "metrics": "127.0.0.1:9100"},
    "load": {"interval_s": 10.0, "serving_thread_busy": 0.953, "daemon_cores": 1.42,
             "serving_ms_per_file": 0.431, "files_per_s_ceiling": 2_320},
    "cache": {
        "tiers": [
            {"name": "ram", "used": 2040 << 20, "capacity": 2 << 30, "evictions": 31_337,
             "hits": 1_204_000, "served_bytes": 130 << 30},
            {"name": "ssd", "used": 700 << 30, "capacity": 1 << 40, "evictions": 0,
             "hits": 480_000, "served_bytes": 51 << 30, "writable": True, "writes": 9,
             "write_queue_bytes": 0, "chunks": 1200, "packed_bytes": 4 << 30},
        ],
        "misses": 17_000, "single_flight_waits": 12, "lookups": 1_701_000,
        "hit_ratio": {"ram": 0.7078, "ssd": 0.2822, "total": 0.99},
    },
    "prefetch": {
        "enabled": True, "readahead": {"prefetches": 40, "inflight_bytes": 0,
                                       "budget_bytes": 512 << 20},
        "window_limit": 256 << 20, "budget_bytes": 512 << 20, "window_bytes": 120 << 20,
        "inflight_bytes": 12 << 20, "held_bytes": 60 << 20, "in_flight": 3,
        "connections": 8, "max_connections": 24, "hinted_files": 90_000, "started": 402,
        "hits": 398, "late": 3, "wasted": 0, "failed": 0, "orders": 2, "next_orders": 0,
        "refused_orders": 0, "failed_orders": 0, "unknown_paths": 0,
    },
    "origin": {
        "requests": {"get": 17_000, "head": 1, "list": 1_100}, "retries": 4,
        "bytes": 66 << 30, "throughput": {"interval_s": 10.0, "bytes_per_s": 85 << 20,
                                          "requests_per_s": 21.5},
        "cost": request_cost("s3", {"get": 17_000, "head": 1, "list": 1_100}),
    },
    "errors": {"retries": 4, "failed_orders": 0, "failed_prefetches": 0,
               "background_failures": 0, "warm_errors": 2},
    "warm": [{"id": 1, "state": "warming", "done": False, "reason": "", "paths": 10,
              "files_total": 10, "bytes_total": 10 << 20, "files_done": 4,
              "bytes_done": 4 << 20, "files_cached": 1, "bytes_cached": 1 << 20,
              "errors": 2, "first_error": "x", "missing": 0, "skipped_files": 0,
              "skipped_bytes": 0, "tier": "ssd", "budget": 1 << 40, "elapsed_s": 1.5}],
}


def test_the_text_view_has_every_section_aligned():
    lines = render(REPORT).splitlines()
    labels = [line[:10].strip() for line in lines if line[:10].strip()]
    assert labels == ["mount", "load", "cache", "prefetch", "origin", "errors", "warm"]
    assert all(line[:10].strip() == "" or line[9] == " " for line in lines)
    assert lines[0] == "mount     s3://imagenet/train/ on /mnt/train"
    assert "up 1h 02m" in lines[1] and "endpoint https://s3.us-east-1" in lines[1]
    header, ram, ssd = (line for line in lines if line[10:14] in ("tier", "ram ", "ssd "))
    for column, ram_cell, ssd_cell in (("used", "2.0 GiB", "700.0 GiB"),
                                       ("budget", "2.0 GiB", "1.0 TiB")):
        at = header.index(column)
        assert ram[at:].startswith(ram_cell) and ssd[at:].startswith(ssd_cell)
    # Counts are right-aligned under their heading.
    end = header.index("evictions") + len("evictions")
    assert ram[:end].endswith("31,337") and ssd[:end].endswith(" 0")
    assert "1,200 chunks (4.0 GiB packed)" in ssd
    text = "\n".join(lines)
    assert "hit ratio 99.0% of 1,701,000 lookups (ram 70.8%, ssd 28.2%; 17,000 from" in text
    assert "window 120.0 MiB of 256.0 MiB · in flight 3 files (12.0 MiB) on 8 of 24" in text
    assert "GET 17,000 · HEAD 1 · LIST 1,100 · 66.0 GiB fetched" in text
    assert "now 85.0 MiB/s, 21.5 requests/s (last 10 s)" in text
    assert "load      serving thread 95% busy · 0.43 ms per file: at most ~2,320 files/s · " \
           "daemon 1.42 cores (last 10 s) · at its ceiling: more readers will not read " \
           "faster" in text
    # 17,001 GET/HEAD at $0.0004 and 1,100 LIST at $0.005 per 1,000.
    assert "cost ~$0.0123 estimated, requests only (GET $0.0004, HEAD $0.0004, LIST " \
           "$0.005 per 1,000: AWS S3 Standard list prices (us-east-1))" in text
    assert "warm errors 2" in text
    assert "#1 warming: 4 of 10 files, 4.0 MiB of 10.0 MiB in 1.5 s (1 cached already) · " \
           "2 errors" in text


def test_a_report_with_hints_off_no_ssd_and_no_lookups():
    report = {**REPORT, "warm": []}
    report["cache"] = {"tiers": [REPORT["cache"]["tiers"][0]], "misses": 0, "lookups": 0,
                       "single_flight_waits": 0,
                       "hit_ratio": {"ram": None, "ssd": None, "total": None}}
    report["prefetch"] = {"enabled": False, "readahead": REPORT["prefetch"]["readahead"]}
    report["origin"] = {**REPORT["origin"], "cost": None}
    text = render(report)
    assert "no lookups yet" in text and "hints off (prefetch_window 0)" in text
    assert "cost: none (a local directory)" in text and "\nwarm" not in text


def test_a_serving_thread_below_its_ceiling_says_only_its_share():
    report = {**REPORT, "load": {"interval_s": 4.0, "serving_thread_busy": 0.31,
                                 "daemon_cores": 0.5, "serving_ms_per_file": None,
                                 "files_per_s_ceiling": None}}
    assert "load      serving thread 31% busy · daemon 0.50 cores (last 4 s)\n" in render(report)
    report.pop("load")  # a daemon from before the section: none shown
    assert "\nload " not in render(report)


def test_units():
    assert [size(v) for v in (0, 1023, 1024, 1536 * 1024, 5 << 30)] == \
        ["0 B", "1023 B", "1.0 KiB", "1.5 MiB", "5.0 GiB"]
    assert [usd(v) for v in (0, 0.0000004, 0.0004, 0.005, 0.012345, 0.54, 12.345)] == \
        ["$0", "<$0.000001", "$0.0004", "$0.005", "$0.0123", "$0.54", "$12.35"]
    assert [duration(v) for v in (0.25, 59.9, 61, 7322)] == ["0.2 s", "59.9 s", "1m 01s",
                                                              "2h 02m"]
    assert request_cost("file", {"get": 1, "head": 0, "list": 0}) is None
    assert request_cost("gs", {"get": 1000, "head": 0, "list": 1000})["usd"]["total"] == 0.0054


# --- the progress bar --------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def job(done_bytes: int, total: int = 100 << 20, files: int = 0, **extra):
    return {"state": "warming", "done": False, "paths": 50, "bytes_total": total,
            "bytes_done": done_bytes, "files_total": 50, "files_done": files} | extra


def test_on_a_terminal_the_bar_is_redrawn_in_place():
    out = Terminal()
    bar = ProgressBar(out)
    bar.show(job(0, state="resolving"), now=0.0)
    bar.show(job(10 << 20, files=5), now=1.0)
    bar.show(job(30 << 20, files=15), now=2.0)
    bar.note("bucketfs warm: warning: something")
    bar.finish(job(100 << 20, files=50, done=True, state="done"))
    frames = out.getvalue().split("\r\x1b[K")
    assert frames[1] == "finding 50 files in the bucket..."
    assert frames[2] == "[##----------------------]  10%  10.0 MiB of 100.0 MiB  5/50 files  " \
                        "10.0 MiB/s  ETA 0:09"
    assert frames[3] == "[#######-----------------]  30%  30.0 MiB of 100.0 MiB  15/50 files  " \
                        "15.0 MiB/s  ETA 0:05"
    assert frames[4] == "bucketfs warm: warning: something\n"  # the bar's line cleared first
    assert frames[5].startswith("[########################] 100%  100.0 MiB of 100.0 MiB  "
                                "50/50 files") and frames[5].endswith("ETA done\n")


def test_without_a_terminal_a_line_every_few_seconds():
    out = io.StringIO()
    bar = ProgressBar(out)
    for second in range(12):
        bar.show(job(second << 20, files=second), now=float(second))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # at 0, 5 and 10 s
    assert lines[2].startswith("bucketfs warm: [##") and "10.0 MiB of 100.0 MiB" in lines[2]
    assert "1.0 MiB/s" in lines[2] and "ETA 1:30" in lines[2]
    assert "\r" not in out.getvalue()


# --- which files are sent ----------------------------------------------------------------


def test_paths_are_walked_in_name_order_each_once(tmp_path):
    mount = tmp_path / "mnt"
    for name in ("b/2", "b/1", "a/z/9", "a/0", "top"):
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_bytes(b"x")
    target = Target(str(mount), os.getuid())
    assert collect(target, str(mount), ["."]) == ["a/0", "a/z/9", "b/1", "b/2", "top"]
    assert collect(target, str(mount), ["b", "top", str(mount / "b" / "1"), "a/z"]) == \
        ["b/1", "b/2", "top", "a/z/9"]
    assert collect(target, str(mount / "a"), ["z"]) == ["a/z/9"]  # relative to MOUNT
    with pytest.raises(HintError, match="is not under the mount"):
        collect(target, str(mount), [str(tmp_path)])
    with pytest.raises(HintError, match="mnt/missing: no such file or directory"):
        collect(target, str(mount), ["missing"])


def test_a_list_file_names_paths_one_a_line(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("a b/c.jpg\n\nd/\n")
    assert warm_client.read_paths(str(listing)) == ["a b/c.jpg", "d/"]
    with pytest.raises(HintError, match="cannot read"):
        warm_client.read_paths(str(tmp_path / "nope"))


def test_the_shared_tier_has_its_section_and_its_share_of_the_hits():
    report = {**REPORT, "shared": {
        "url": "s3://cache/bucketfs/", "endpoint": "http://10.0.0.5:9000", "up": False,
        "max_object": 16 << 20, "lookups": 1_000, "hits": 900, "misses": 95, "invalid": 2,
        "errors": 3, "skipped": 40, "bytes_read": 90 << 20, "writes": 95,
        "bytes_written": 9 << 20, "dropped": 1, "write_queue_bytes": 1 << 20,
        "requests": {"get": 1_000, "put": 96, "list": 0, "delete": 0}}}
    report["cache"] = {**REPORT["cache"], "hit_ratio": {**REPORT["cache"]["hit_ratio"],
                                                        "shared": 0.0005}}
    lines = render(report).splitlines()
    labels = [line[:10].strip() for line in lines if line[:10].strip()]
    assert labels == ["mount", "load", "cache", "prefetch", "shared", "origin", "errors",
                      "warm"]
    text = "\n".join(lines)
    assert "(ram 70.8%, ssd 28.2%, shared 0.1%; 17,000 from the bucket)" in text
    assert "s3://cache/bucketfs/ via http://10.0.0.5:9000 · RESTING after a failure" in text
    assert "lookups 1,000 · hits 900 (90.0 MiB) · misses 95 · invalid 2 · errors 3 · " \
           "skipped 40" in text
    assert "written 95 blocks (9.0 MiB) · dropped 1 · 1.0 MiB queued · requests GET " \
           "1,000, PUT 96" in text
    assert "\nshared" not in render(REPORT)  # no shared tier, no section
