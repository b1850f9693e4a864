"""`make demo` (python -m bucketfs.demo) ends by showing what bucketfs is for: a cold
epoch, a cached one next to local disk, a remount served from the SSD tier without a
request to the bucket, what hints did, the requests each phase cost, and where to look
next (`bucketfs status`)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fuse


def test_the_demo_shows_cold_cached_and_remounted_epochs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bucketfs.demo", "--dir", str(tmp_path / "demo"),
         "--images", "40", "--workers", "0"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()

    def line(start: str) -> str:
        found = [entry for entry in lines if entry.startswith(start)]
        assert len(found) == 1, (start, lines)
        return found[0]

    # The cold epoch asked the bucket for every file, once.
    assert re.search(r"40 images in .* · bucket: 40 GET, \d+ LIST$", line("epoch 1, cold:"))
    assert line("epoch 2, cached:").endswith("· bucket: no request")
    assert "the baseline: epoch 2 took" in line("local disk:")
    assert line("check:").startswith("check: same 40 files and 10 classes")
    remount = line("epoch 3, after remount:")
    assert "· bucket: no request (40 blocks from the SSD tier" in remount
    assert re.search(r"the daemon fetched \d+ of them ahead", line("hints:"))
    assert "counted by the daemon itself" in line("requests:")
    assert "`bucketfs status MOUNT`" in lines[-1]
    # A second run starts cold again: the cache is emptied, the dataset reused.
    again = subprocess.run(
        [sys.executable, "-m", "bucketfs.demo", "--dir", str(tmp_path / "demo"),
         "--images", "40", "--workers", "0"],
        capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stdout and "bucket: 40 GET" in again.stdout
