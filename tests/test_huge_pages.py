"""Huge pages for the daemon's memory (huge_pages.py): the daemon, started by
`bucketfs mount` or in the foreground, runs with glibc's malloc asking for transparent
huge pages where the `huge_buffers` option gives large blocks huge pages (by default
unless the host takes freed memory back), and gets them for the blocks it reads; a
user's own choice is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bucketfs import huge_pages
from tests.mounting import (
    daemon_pid,
    drop_page_cache,
    force_unmount,
    mounted,
    wait_for_foreground_mount,
)

MiB = 1024 * 1024
ON = f"{huge_pages.TUNABLE}=1"


#: Whether this machine gives huge pages (its kernel and C library) where they are asked
#: for, and whether they are by default (not where the host takes freed memory back):
#: the mounts below check what the daemon gets either way.
GIVES = huge_pages.environment({}, "always") is not None
GIVES_BY_DEFAULT = huge_pages.environment({}) is not None


@pytest.fixture
def kernel_with_huge_pages(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP", setting)
    monkeypatch.setattr(huge_pages, "_glibc", lambda: True)
    monkeypatch.setattr(huge_pages, "host_takes_freed_memory", lambda sys_root=None: False)
    return setting


def test_the_tunable_is_added_to_the_environment(kernel_with_huge_pages):
    assert huge_pages.environment({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": ON}
    assert huge_pages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{ON}"}


def test_glibc_is_asked_only_where_large_buffers_get_huge_pages(kernel_with_huge_pages,
                                                               monkeypatch):
    assert huge_pages.environment({}, "never") is None
    assert huge_pages.environment({}, "always") == {"GLIBC_TUNABLES": ON}
    # A host that takes freed memory back hands out every fresh huge page unbacked.
    monkeypatch.setattr(huge_pages, "host_takes_freed_memory", lambda sys_root=None: True)
    assert huge_pages.environment({}, "auto") is None
    assert huge_pages.environment({}) is None
    assert huge_pages.environment({}, "always") == {"GLIBC_TUNABLES": ON}


def test_a_users_choice_and_a_kernel_without_huge_pages_change_nothing(
        kernel_with_huge_pages, tmp_path, monkeypatch):
    assert huge_pages.environment({"GLIBC_TUNABLES": f"{huge_pages.TUNABLE}=0"}) is None
    assert huge_pages.environment({"GLIBC_TUNABLES": ON}) is None
    kernel_with_huge_pages.write_text("always madvise [never]\n")
    assert huge_pages.environment({}) is None
    monkeypatch.setattr(huge_pages, "_THP", tmp_path / "missing")
    assert huge_pages.environment({}) is None
    kernel_with_huge_pages.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP", kernel_with_huge_pages)
    monkeypatch.setattr(huge_pages, "_glibc", lambda: False)  # musl, say
    assert huge_pages.environment({}) is None


def tunables(pid: int) -> str:
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"GLIBC_TUNABLES="):
            return entry.split(b"=", 1)[1].decode()
    return ""


def anon_huge_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "bucket"
    root.mkdir()
    (root / "large.bin").write_bytes(os.urandom(32 * MiB))
    return root


@pytest.mark.parametrize("option", ["always", "auto", "never"])
def test_the_daemon_gets_huge_pages_where_the_option_says(source, tmp_path, option):
    gives = {"always": GIVES, "auto": GIVES_BY_DEFAULT, "never": False}[option]
    with mounted(f"file://{source}", tmp_path / "mnt", "--ram-cache", "256MiB",
                 "--huge-buffers", option, env={"GLIBC_TUNABLES": ""}) as mnt:
        pid = daemon_pid(mnt.resolve())
        assert (ON in tunables(pid).split(":")) == gives
        drop_page_cache()
        assert (mnt / "large.bin").read_bytes() == (source / "large.bin").read_bytes()
        # The RAM tier holds the 32 MiB just read, in memory glibc mapped with huge pages
        # (none where the machine gives none, or the option says no).
        assert (anon_huge_bytes(pid) >= 4 * MiB) == gives


def test_a_user_who_turned_it_off_keeps_it_off(source, tmp_path):
    off = f"{huge_pages.TUNABLE}=0"
    with mounted(f"file://{source}", tmp_path / "mnt", env={"GLIBC_TUNABLES": off}) as mnt:
        assert tunables(daemon_pid(mnt.resolve())) == off


@pytest.mark.parametrize("option", ["always", "never"])
def test_a_foreground_mount_runs_itself_again_with_huge_pages(source, tmp_path, option):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    process = subprocess.Popen(
        [sys.executable, "-m", "bucketfs", "mount", f"file://{source}", str(mnt),
         "--foreground", "--huge-buffers", option, "--log-file", str(tmp_path / "mnt.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_foreground_mount(process, mnt)
        # The same process (its pid is what the state directory records), run again.
        assert daemon_pid(mnt) == process.pid
        assert (ON in tunables(process.pid).split(":")) == (GIVES and option == "always")
        assert (mnt / "large.bin").stat().st_size == 32 * MiB
    finally:
        process.terminate()
        process.wait(timeout=30)
        force_unmount(mnt)
