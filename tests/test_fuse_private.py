"""Nobody else's: what a mount writes (cache files, its index, the log, the state
directory, the hints socket) is private to the mount's user, and nothing another user
planted is written through.

The daemon runs as root here, as under the shipped systemd unit; "another user" is
uid/gid 65534 in a child process. Everything lives under a directory that anyone may
traverse, so only the mount's own permissions stand in the way."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bucketfs import runtime
from bucketfs.hints import location
from bucketfs.private import UnsafePath, create_private_file, open_private_log, private_directory
from tests.chunk_helpers import cache_files
from tests.mounting import bucketfs, mounted, read_log, written_through

pytestmark = [pytest.mark.fuse, pytest.mark.root]

NOBODY = 65534
FILES = {f"train/c{i % 2}/{i:03d}.jpg": random.Random(i).randbytes(40_000 + i)
         for i in range(24)}


@pytest.fixture
def open_base():
    """A directory every user may enter, holding the bucket, mountpoint, cache and log."""
    base = Path(tempfile.mkdtemp(prefix="bfs-private-", dir="/tmp"))
    base.chmod(0o755)
    bucket = base / "bucket"
    for key, data in FILES.items():
        path = bucket / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def as_nobody(paths: dict[str, str], socket_path: str | None = None, *,
              gid: int = NOBODY) -> dict[str, str]:
    """What uid 65534 (in group `gid`) gets trying to read each path ("ok" or the
    error's name), and to send on the hints socket."""
    script = f"""
import json, os, socket
os.setgroups([]); os.setgid({gid}); os.setuid({NOBODY})
out = {{}}
for name, path in {paths!r}.items():
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        out[name] = "ok"
    except OSError as exc:
        out[name] = type(exc).__name__
if {socket_path!r}:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect({socket_path!r})
        out["hints socket"] = "ok"
    except OSError as exc:
        out["hints socket"] = type(exc).__name__
print(json.dumps(out))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_another_user_reads_nothing_the_mount_wrote(open_base, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # as under systemd
    cache, log = open_base / "cache", open_base / "mnt.log"
    mountpoint = open_base / "mnt"
    with mounted(f"file://{open_base / 'bucket'}", mountpoint, "--cache-dir", str(cache),
                 "--disk-free-floor", "0") as mnt:
        for key, data in FILES.items():
            assert (mnt / key).read_bytes() == data
        written_through(mnt)
        state = runtime.state_dir(str(mnt.resolve()))
        sock = location.socket_path(str(mnt.resolve()))
        assert sock.exists()
        written = [p for p in cache.rglob("*") if p.is_file()]
        assert any(p.suffix in (".blk", ".chk") for p in written)  # block or chunk files
        assert any("index" in p.parts for p in written)
        # Modes: the directory the mount made and everything in it, the log, the state.
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        for path in cache.rglob("*"):
            assert stat.S_IMODE(path.lstat().st_mode) & 0o077 == 0, path
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert state.parent == location.ROOT_RUNTIME
        targets = {str(p.relative_to(open_base)): str(p) for p in written[:20]}
        targets |= {"cache": str(cache), "data": str(cache / "data"),
                    "index": str(cache / "index"), "log": str(log), "state": str(state),
                    "pid": str(state / "pid")}
        seen = as_nobody(targets, str(sock))
    assert seen and all(outcome == "PermissionError" for outcome in seen.values()), seen


def test_a_cache_group_may_read_the_cache_and_nobody_else(open_base):
    group = 4242  # a group no other test user is in
    cache = open_base / "cache"
    with mounted(f"file://{open_base / 'bucket'}", open_base / "mnt", "--cache-dir",
                 str(cache), "--cache-group", str(group), "--disk-free-floor", "0") as mnt:
        for key, data in FILES.items():
            assert (mnt / key).read_bytes() == data
        written_through(mnt)
        blocks = {p.name: str(p) for p in cache_files(cache)}
        assert blocks
        for path in cache.rglob("*"):
            info = path.lstat()
            assert info.st_gid == group and stat.S_IMODE(info.st_mode) & 0o007 == 0, path
        assert stat.S_IMODE((cache / "data").stat().st_mode) == 0o2750
        assert set(as_nobody(blocks, gid=group).values()) == {"ok"}
        assert set(as_nobody(blocks).values()) == {"PermissionError"}
        assert stat.S_IMODE((open_base / "mnt.log").stat().st_mode) == 0o600


def test_a_more_open_cache_directory_gets_a_warning_and_private_insides(open_base):
    cache = open_base / "cache"
    args = ("--cache-dir", str(cache), "--disk-free-floor", "0")
    with mounted(f"file://{open_base / 'bucket'}", open_base / "mnt", *args) as mnt:
        (mnt / "train/c0/000.jpg").read_bytes()
    # As an older bucketfs left it: everything readable by all.
    for path in [cache, *cache.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    mountpoint = open_base / "mnt"
    result = bucketfs("mount", f"file://{open_base / 'bucket'}", str(mountpoint), *args,
                      "--log-file", str(open_base / "again.log"))
    try:
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "open to other" in line]
        assert len(warnings) == 1 and "chmod 700" in warnings[0], result.stderr
        for sub in ("data", "index", "chunks"):
            assert stat.S_IMODE((cache / sub).stat().st_mode) == 0o700
        inside = {p.name: str(p) for p in cache_files(cache)}
        assert inside and set(as_nobody(inside).values()) == {"PermissionError"}
    finally:
        bucketfs("umount", str(mountpoint))


def test_a_pid_file_link_planted_in_the_state_directory_is_not_followed(open_base):
    mountpoint = open_base / "mnt"
    mountpoint.mkdir()
    state = runtime.prepare_state_dir(str(mountpoint.resolve()))
    victim = open_base / "victim"
    victim.write_text("precious\n")
    (state / "pid").symlink_to(victim)
    with mounted(f"file://{open_base / 'bucket'}", mountpoint):
        pid = state / "pid"
        assert not pid.is_symlink() and stat.S_IMODE(pid.stat().st_mode) == 0o600
    assert victim.read_text() == "precious\n"


def test_a_squatted_runtime_directory_is_refused(open_base, monkeypatch):
    # A non-root daemon without XDG_RUNTIME_DIR uses /tmp/bucketfs-UID: another user
    # may have made it first. Played here with the runtime root moved into open_base.
    squat = open_base / "bucketfs-1000"
    monkeypatch.setattr(location, "tmp_root", lambda uid: squat)
    monkeypatch.setattr(location.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert location.runtime_root() == squat
    monkeypatch.undo()
    for planted in ("link", "theirs", "open"):
        if planted == "link":
            squat.symlink_to(open_base)
        else:
            squat.mkdir(mode=0o777)
            squat.chmod(0o777)
            if planted == "theirs":
                os.chown(squat, NOBODY, NOBODY)
                squat.chmod(0o700)
        with pytest.raises(UnsafePath):
            private_directory(squat, 0o711)
        if squat.is_symlink():
            squat.unlink()
        else:
            shutil.rmtree(squat)
    # A state directory of ours, more open than it should be, is closed down.
    squat.mkdir(mode=0o755)
    assert stat.S_IMODE(private_directory(squat, 0o711).stat().st_mode) == 0o711


def test_mount_refuses_a_state_directory_another_user_owns(open_base):
    mountpoint = open_base / "mnt"
    mountpoint.mkdir()
    state = runtime.state_dir(str(mountpoint.resolve()))
    runtime.prepare_state_dir(str(mountpoint.resolve()))
    os.chown(state, NOBODY, NOBODY)
    try:
        result = bucketfs("mount", f"file://{open_base / 'bucket'}", str(mountpoint),
                          "--log-file", str(open_base / "m.log"))
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "belongs to uid 65534" in lines[0], result.stderr
        assert "Traceback" not in read_log(open_base / "m.log")
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_private_files_are_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "pid").symlink_to(victim)
    create_private_file(tmp_path / "pid", b"123\n")
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "pid").read_bytes() == b"123\n"
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(UnsafePath, match="link"):
        open_private_log(tmp_path / "log")
    theirs = tmp_path / "theirs.log"
    theirs.write_text("")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match="not a regular file of uid"):
        open_private_log(theirs)
    old = tmp_path / "old.log"
    old.write_text("from an older version\n")
    old.chmod(0o644)
    os.close(open_private_log(old))
    assert stat.S_IMODE(old.stat().st_mode) == 0o600


def test_the_hints_socket_refuses_another_user(open_base):
    with mounted(f"file://{open_base / 'bucket'}", open_base / "mnt") as mnt:
        sock = location.socket_path(str(mnt.resolve()))
        os.chmod(sock.parent, 0o755)  # past the directory: the socket's own checks
        os.chmod(sock, 0o666)
        # Everything imported first: the interpreter's files are not for uid 65534.
        script = f"""
import os
from bucketfs.hints.client import request, Target
from bucketfs.hints.protocol import End
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
print(request(Target({str(mnt)!r}, 0), End("job")).reason)
"""
        result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                text=True, timeout=30,
                                env={**os.environ, location.SOCKET_ENV: str(sock)})
        assert "permission denied: uid 65534" in result.stdout, result.stderr
