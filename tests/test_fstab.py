"""fstab and mount(8): the -o list translated into `bucketfs mount` options, and real
mounts made by util-linux mount from an fstab line (`mount -T FILE MOUNTPOINT`) and from
`mount -t fuse.bucketfs`, through the helper mount(8) runs, then unmounted by umount(8)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketfs.fstab import (
    MountRequest,
    UsageError,
    parse_command_line,
    split_options,
    translate,
)
from bucketfs.runtime import mounted as mount_entry
from tests.mounting import daemon_pid, force_unmount, read_log

HELPER = Path("/sbin/mount.fuse.bucketfs")
#: Marks the helper this test installs, so a leftover one is replaced and a real
#: installation is never touched.
MARKER = "# installed by tests/test_fstab.py"


# --- The -o list ---------------------------------------------------------------------


def test_split_options_keeps_quoted_commas():
    assert split_options('ro,config="/etc/a,b.conf",,uid=1000') == [
        "ro", "config=/etc/a,b.conf", "uid=1000"]
    with pytest.raises(UsageError, match="unbalanced quote"):
        split_options('config="/etc/a')


def test_bucketfs_options_by_name_and_generic_ones_ignored():
    options = split_options(
        "rw,ro,defaults,_netdev,nofail,noauto,nosuid,nodev,noexec,relatime,user,"
        "x-systemd.automount,x-systemd.requires=network-online.target,X-mount.mkdir,"
        "comment=dataset,allow_other,refresh=false,endpoint_url=http://127.0.0.1:9000,"
        "cache_dir=/var/cache/bucketfs,ram_cache=4GiB,uid=1000,config=/etc/b.conf")
    request = translate("s3://b/train", "/mnt/train", options)
    assert request.overrides == {
        "allow_other": True, "refresh": "false", "endpoint_url": "http://127.0.0.1:9000",
        "cache_dir": "/var/cache/bucketfs", "ram_cache": "4GiB", "uid": "1000",
    }
    assert request.config == "/etc/b.conf"
    assert "rw" in request.ignored and "x-systemd.automount" in request.ignored
    assert request.argv() == [
        "bucketfs", "mount", "s3://b/train", "/mnt/train", "--config", "/etc/b.conf",
        "--allow-other", "--endpoint-url", "http://127.0.0.1:9000",
        "--cache-dir", "/var/cache/bucketfs", "--ram-cache", "4GiB", "--uid", "1000",
    ]


@pytest.mark.parametrize(("options", "needle"), [
    ("ro,cache_dri=/x", "unknown mount option 'cache_dri'"),
    ("ro,cache-dir=/x", "unknown mount option 'cache-dir'"),  # flags' dashes are not names
    ("fsname=x", "unknown mount option 'fsname'"),
    ("cache_dir", "mount option cache_dir needs a value"),
    ("endpoint_url=", "mount option endpoint_url needs a value"),
    ("remount,ro", "cannot be remounted"),
    ("config", "config needs a file"),
])
def test_bad_options_name_the_culprit(options, needle):
    with pytest.raises(UsageError, match=needle):
        translate("s3://b", "/mnt", split_options(options))


def test_sloppy_ignores_unknown_options():
    request = translate("s3://b", "/mnt", ["ro", "nonsense=1", "cache_dir=/c"], sloppy=True)
    assert request.overrides == {"cache_dir": "/c"}
    assert request.ignored == ["ro", "nonsense=1"]


def test_helper_command_line():
    request = parse_command_line(["s3://b/p", "/mnt/p", "-n", "-v", "-t", "fuse.bucketfs",
                                  "-o", "ro,cache_dir=/c", "-o", "uid=1"])
    assert request == MountRequest("s3://b/p", "/mnt/p", overrides={"cache_dir": "/c",
                                   "uid": "1"}, verbose=True, ignored=["ro"])
    assert parse_command_line(["s3://b", "/m", "-f"]).fake
    for argv, needle in [(["s3://b"], "usage"), (["s3://b", "/m", "-t", "fuse.sshfs"],
                         "not fuse.sshfs"), (["s3://b", "/m", "-N", "1"], "-N"),
                         (["s3://b", "/m", "-x"], "option -x not recognized")]:
        with pytest.raises(UsageError, match=needle):
            parse_command_line(argv)


def helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from bucketfs.fstab import "
                           "main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=60)


def test_helper_errors_are_one_line(tmp_path):
    for options, needle in [("ro,cache_dri=/x", "unknown mount option 'cache_dri'"),
                            ("ro,block_size=huge", "bad value for cache.block_size")]:
        result = helper(f"file://{tmp_path}", str(tmp_path), "-o", options)
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith("bucketfs: error: ") and needle in lines[0], lines[0]
    # mount -f (fake): everything but the mount.
    assert helper(f"file://{tmp_path}", str(tmp_path), "-f", "-o", "ro").returncode == 0
    assert mount_entry(str(tmp_path)) is None


# --- Real mounts through mount(8) ----------------------------------------------------


@pytest.fixture
def installed_helper() -> Iterator[Path]:
    """/sbin/mount.fuse.bucketfs, where mount(8) looks for it, running this checkout."""
    # util-linux is installed by .ci/run and the Makefile's sysdeps: its absence is a failure.
    assert shutil.which("mount") is not None, "mount(8) is missing: apt-get install util-linux"
    # A helper installed on this machine (a bucketfs package) is set aside for the test
    # and put back after it; one a killed run left aside is put back first.
    aside = HELPER.with_name(HELPER.name + ".set-aside-by-tests")
    if aside.exists() and (not HELPER.exists()
                           or MARKER in HELPER.read_text(errors="replace")):
        aside.replace(HELPER)
    if HELPER.exists() and MARKER not in HELPER.read_text(errors="replace"):
        HELPER.replace(aside)
    HELPER.write_text(f"#!/bin/sh\n{MARKER}\nexec {sys.executable} -c 'import sys; "
                      "from bucketfs.fstab import main; sys.exit(main())' \"$@\"\n")
    HELPER.chmod(0o755)
    try:
        yield HELPER
    finally:
        if aside.exists():
            aside.replace(HELPER)
        else:
            HELPER.unlink(missing_ok=True)


def umount_and_wait(mountpoint: Path, pid: int) -> None:
    """umount(8), as a user of fstab would; the daemon must exit by itself."""
    result = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the daemon outlived its mount"


@pytest.mark.fuse
@pytest.mark.root
def test_mount_from_an_fstab_line(installed_helper, tmp_path):
    source = tmp_path / "bucket"
    (source / "train" / "cat").mkdir(parents=True)
    (source / "train" / "cat" / "1.jpg").write_bytes(b"\xff\xd8" + os.urandom(5000))
    (source / "README").write_text("hello\n")
    mnt, cache, log = tmp_path / "data", tmp_path / "cache", tmp_path / "data.log"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(
        "# a comment, and a line for another mountpoint\n"
        f"file:///nowhere {tmp_path}/other fuse.bucketfs ro 0 0\n"
        f"file://{source} {mnt} fuse.bucketfs ro,_netdev,nofail,noauto,allow_other,"
        "x-systemd.automount,x-systemd.requires=network-online.target,"
        f"cache_dir={cache},log_file={log},log_format=json,block_size=1MiB,"
        "kernel_ttl=5 0 0\n")
    result = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, f"{result.stderr}\n{read_log(log)}"
    try:
        entry = mount_entry(str(mnt))
        assert entry is not None and entry.fstype == "fuse.bucketfs"
        assert entry.source == f"file://{source}"
        assert (mnt / "README").read_text() == "hello\n"
        assert (mnt / "train" / "cat" / "1.jpg").read_bytes() == \
            (source / "train" / "cat" / "1.jpg").read_bytes()
        options = subprocess.run(["findmnt", "-no", "OPTIONS", str(mnt)],
                                 capture_output=True, text=True).stdout
        assert "ro" in options.split(",") and "allow_other" in options, options
        assert any(cache.iterdir()), "cache_dir was not used"
        pid = daemon_pid(mnt)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert any(line["message"].startswith("mounted ") for line in lines), lines
    except BaseException:
        force_unmount(mnt)
        raise
    umount_and_wait(mnt, pid)
    assert mount_entry(str(mnt)) is None


@pytest.mark.fuse
@pytest.mark.root
def test_mount_t_fuse_bucketfs_from_s3(installed_helper, s3_server, tmp_path):
    """The issue's command line: no `ro` (mount(8) then passes `rw`, accepted: the
    mount is read-only all the same), the endpoint given as an option."""
    s3_server.create_bucket("fstab")
    s3_server.put("fstab", "train/a.bin", b"a" * 3000)
    s3_server.put("fstab", "train/sub/b.bin", b"b" * 5)
    mnt, log = tmp_path / "data", tmp_path / "data.log"
    mnt.mkdir()
    env = {k: v for k, v in {**os.environ, **s3_server.env()}.items()
           if k != "AWS_ENDPOINT_URL"}
    result = subprocess.run(
        ["mount", "-t", "fuse.bucketfs", "s3://fstab/train", str(mnt), "-o",
         f"endpoint_url={s3_server.endpoint},addressing_style=path,region=us-east-1,"
         f"cache_dir={tmp_path / 'cache'},log_file={log}"],
        capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, f"{result.stderr}\n{read_log(log)}"
    try:
        assert sorted(os.listdir(mnt)) == ["a.bin", "sub"]
        assert (mnt / "a.bin").read_bytes() == b"a" * 3000
        assert (mnt / "sub" / "b.bin").read_bytes() == b"b" * 5
        with pytest.raises(OSError):
            (mnt / "new").write_text("x")  # read-only whatever mount(8) said
        pid = daemon_pid(mnt)
    except BaseException:
        force_unmount(mnt)
        raise
    umount_and_wait(mnt, pid)
