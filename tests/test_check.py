"""`bucketfs check MOUNTPOINT`, the readiness probe of packaging/kubernetes/: 0 only while
a bucketfs daemon answers there; 1 with one line when nothing or something else is
mounted, when the daemon is stopped (no answer in time) or gone (a stale mount)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bucketfs.runtime import mounted as mount_entry
from tests.mounting import bucketfs, daemon_pid, force_unmount


def check(path: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return bucketfs("check", *args, str(path), timeout=30)


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_not_a_bucketfs_mount(tmp_path):
    result = check(tmp_path)
    assert result.returncode == 1 and "is not mounted" in one_line(result)
    result = check("/proc")
    assert result.returncode == 1 and "is a proc mount, not bucketfs" in one_line(result)


@pytest.mark.fuse
def test_healthy_stopped_and_stale(tmp_path):
    source = tmp_path / "bucket"
    source.mkdir()
    (source / "f").write_text("x")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = bucketfs("mount", f"file://{source}", str(mnt), "--log-file",
                      str(tmp_path / "log"))
    assert result.returncode == 0, result.stderr
    pid = daemon_pid(mnt)
    try:
        result = check(mnt)
        assert result.returncode == 0, result.stderr
        assert f"bucketfs mount of file://{source} answers" in one_line(result)

        os.kill(pid, signal.SIGSTOP)  # a daemon that never answers
        try:
            started = time.monotonic()
            result = check(mnt, "--timeout", "1")
            assert result.returncode == 1
            assert "did not answer within 1s" in one_line(result)
            assert time.monotonic() - started < 10
        finally:
            os.kill(pid, signal.SIGCONT)
        assert check(mnt).returncode == 0

        os.kill(pid, signal.SIGKILL)  # a daemon that is gone: the mount is stale
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        result = check(mnt)
        assert result.returncode == 1 and "is stale" in one_line(result)
    finally:
        if mount_entry(str(mnt)) is not None:
            bucketfs("umount", str(mnt))
        force_unmount(mnt)
