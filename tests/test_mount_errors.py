"""Mount-time errors: exit non-zero with one line saying what is wrong, leave no mount;
and clean unmounts from `bucketfs umount` and from signals in the foreground."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bucketfs.runtime import mounted as mount_entry
from bucketfs.runtime import state_dir
from tests.mounting import bucketfs, force_unmount, mounted, wait_for_foreground_mount

pytestmark = pytest.mark.fuse


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_text("hello\n")
    return root


def assert_one_line_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bucketfs: error: ")
    assert needle in lines[0], lines[0]


def test_mountpoint_missing(source, tmp_path):
    result = bucketfs("mount", f"file://{source}", str(tmp_path / "absent"))
    assert_one_line_error(result, "does not exist")


def test_mountpoint_is_a_file(source, tmp_path):
    (tmp_path / "file").write_text("x")
    assert_one_line_error(bucketfs("mount", f"file://{source}", str(tmp_path / "file")),
                          "is not a directory")


def test_mountpoint_not_empty(source, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "something").write_text("x")
    assert_one_line_error(bucketfs("mount", f"file://{source}", str(mnt)), "is not empty")
    assert mount_entry(str(mnt)) is None


def test_mountpoint_already_mounted(source, tmp_path):
    with mounted(f"file://{source}", tmp_path / "mnt") as mnt:
        result = bucketfs("mount", f"file://{source}", str(mnt))
        assert_one_line_error(result, "already mounted")
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"  # the first mount still serves


def test_no_such_local_bucket(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert_one_line_error(bucketfs("mount", f"file://{tmp_path}/absent", str(mnt)),
                          "no such directory")
    assert mount_entry(str(mnt)) is None


def test_bad_config_and_url(source, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    conf = tmp_path / "bad.conf"
    conf.write_text("[cache]\nblock_sise = 1\n")
    assert_one_line_error(bucketfs("mount", f"file://{source}", str(mnt), "--config", str(conf)),
                          "unknown key cache.block_sise")
    assert_one_line_error(bucketfs("mount", f"file://{source}", str(mnt), "--block-size", "x"),
                          "bad value for cache.block_size")
    assert_one_line_error(bucketfs("mount", "ftp://host/x", str(mnt)), "unsupported URL")
    assert mount_entry(str(mnt)) is None


def test_no_fuse_device(source, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # A private mount namespace whose /dev has no fuse node.
    script = (f"mount -t tmpfs tmpfs /dev && exec {sys.executable} -m bucketfs mount "
              f"file://{source} {mnt} --foreground")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            capture_output=True, text=True, timeout=60)
    assert_one_line_error(result, "cannot open /dev/fuse")


def test_umount_clears_a_stale_mount(source, tmp_path):
    """(`bucketfs mount` recovers a stale mount itself: tests/test_crash.py.)"""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert bucketfs("mount", f"file://{source}", str(mnt)).returncode == 0
    try:
        pid = int((state_dir(str(mnt)) / "pid").read_text())
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"  # the kernel caches attributes
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        result = bucketfs("umount", str(mnt))
        assert result.returncode == 0, result.stderr
        assert mount_entry(str(mnt)) is None
    finally:
        force_unmount(mnt)


def test_umount_of_something_else(tmp_path):
    assert_one_line_error(bucketfs("umount", str(tmp_path)), "is not mounted")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_in_foreground_unmounts_cleanly(source, tmp_path, signum):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "bucketfs", "mount", f"file://{source}", str(mnt), "--foreground"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_foreground_mount(process, mnt)
        assert (mnt / "d" / "f.txt").read_text() == "hello\n"
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
        assert mount_entry(str(mnt)) is None
        assert not (state_dir(str(mnt)) / "pid").exists()
    finally:
        process.kill()
        force_unmount(mnt)


def test_version_and_help():
    result = bucketfs("--version")
    assert result.returncode == 0 and result.stdout.startswith("bucketfs ")
    for command in ([], ["mount"], ["umount"]):
        result = bucketfs(*command, "--help")
        assert result.returncode == 0 and "usage: bucketfs" in result.stdout


def test_empty_bucket_mounts_with_a_warning(tmp_path):
    (tmp_path / "empty").mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = bucketfs("mount", f"file://{tmp_path}/empty", str(mnt))
    try:
        assert result.returncode == 0, result.stderr
        assert "bucketfs: warning: " in result.stderr and "names no objects" in result.stderr
        assert os.listdir(mnt) == []
    finally:
        assert bucketfs("umount", str(mnt)).returncode == 0


def test_options_for_another_kind_of_bucket_are_named_in_one_warning(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_bytes(b"a")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = bucketfs("mount", f"file://{tmp_path}/data", str(mnt), "--billing-project",
                      "team", "--requester-pays", "--no-sign-request")
    try:
        assert result.returncode == 0, result.stderr
        (line,) = [w for w in result.stderr.splitlines() if "another kind of bucket" in w]
        assert line.startswith("bucketfs: warning: ")
        for named in ("gcs.billing_project (--billing-project)", "--requester-pays",
                      "s3.sign_request (--no-sign-request)"):
            assert named in line
        assert (mnt / "a.txt").read_bytes() == b"a"
    finally:
        assert bucketfs("umount", str(mnt)).returncode == 0


def test_only_options_for_other_buckets_are_named():
    from bucketfs.config import load_config, options_for_other_buckets

    config = load_config(None, {"billing_project": "p", "region": "eu-west-3"})
    assert options_for_other_buckets(config, "s3") == ["gcs.billing_project (--billing-project)"]
    assert options_for_other_buckets(config, "gs") == ["s3.region (--region)"]
    # The shared tier (s3://) follows the [s3] region and credentials whatever the origin.
    shared = load_config(None, {"region": "eu-west-3", "shared": "s3://team/cache"})
    assert options_for_other_buckets(shared, "gs") == []


def test_daemon_that_cannot_start_is_one_line_and_leaks_no_descriptor(
        source, tmp_path, monkeypatch, capsys):
    """The daemon's process cannot be started (the interpreter gone, out of processes):
    one line, a failing exit, and the pipes and the log closed."""
    from bucketfs import cli

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(cli.subprocess, "Popen", refuse)
    (tmp_path / "mnt").mkdir()
    before = set(os.listdir("/proc/self/fd"))
    code = cli.main(["mount", f"file://{source}", str(tmp_path / "mnt"),
                     "--log-file", str(tmp_path / "mount.log")])
    assert code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot start the daemon" in lines[0], lines
    assert "Resource temporarily unavailable" in lines[0]
    assert set(os.listdir("/proc/self/fd")) == before
