"""Finding the mount and its socket, send_order / end_job, and `bucketfs hint`."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketfs import runtime
from bucketfs.cli import main as bucketfs_main
from bucketfs.hints import (
    HintError,
    HintWarning,
    client,
    end_job,
    location,
    send_next_order,
    send_order,
)
from bucketfs.hints.cli import main as hint_main
from bucketfs.hints.location import FSTYPE, Mount, mount_of, read_mounts, socket_candidates
from tests.test_hints_server import daemon_thread

MOUNTINFO = "".join([
    "22 27 0:21 / /proc rw,relatime - proc proc rw\n",
    r"30 27 0:40 / /mnt/data\040set rw,nosuid,nodev,relatime shared:5 - fuse.bucketfs "
    "s3://b/p rw,user_id=1000,group_id=1000,allow_other\n",
    "31 27 0:41 / /mnt/b rw,relatime - fuse.bucketfs gs://x rw,user_id=0,group_id=0\n",
])


# --- Where things are -------------------------------------------------------------------


def test_mountinfo_is_parsed_with_escapes_and_owner(tmp_path):
    (tmp_path / "mountinfo").write_text(MOUNTINFO)
    proc, data, b = read_mounts(str(tmp_path / "mountinfo"))
    assert (proc.mountpoint, proc.fstype, proc.owner_uid) == ("/proc", "proc", None)
    assert (data.mountpoint, data.fstype, data.source, data.device, data.owner_uid) == (
        "/mnt/data set", FSTYPE, "s3://b/p", "0:40", 1000)
    assert b.owner_uid == 0


def test_the_longest_mountpoint_wins_component_wise():
    mounts = [Mount("/", "ext4"), Mount("/mnt/b", FSTYPE), Mount("/mnt/bb", "tmpfs"),
              Mount("/mnt/b/local", "tmpfs"), Mount("/mnt/b/deep", FSTYPE, options="user_id=7")]
    assert mount_of("/mnt/b/x.jpg", mounts).mountpoint == "/mnt/b"
    assert mount_of("/mnt/b", mounts).mountpoint == "/mnt/b"
    assert mount_of("/mnt/bb/x.jpg", mounts) is None, "a prefix of the name is not a parent"
    assert mount_of("/mnt/b/local/x", mounts) is None, "a mount on top hides bucketfs"
    assert mount_of("/mnt/b/deep/x", mounts).owner_uid == 7
    stacked = [*mounts, Mount("/mnt/b", "tmpfs")]
    assert mount_of("/mnt/b/x.jpg", stacked) is None, "the last mount stacked there wins"


def test_daemon_and_client_agree_on_the_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(location.SOCKET_ENV, raising=False)
    digest = location.mount_digest("/mnt/b")
    assert runtime.state_dir("/mnt/b") == tmp_path / "bucketfs" / digest
    assert location.socket_path("/mnt/b") == runtime.state_dir("/mnt/b") / "hints.sock"
    assert socket_candidates("/mnt/b", 1000) == [
        Path(f"/run/user/1000/bucketfs/{digest}/hints.sock"),
        tmp_path / "bucketfs" / digest / "hints.sock",
        Path(f"/tmp/bucketfs-1000/{digest}/hints.sock"),
    ]
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    # Without a runtime directory: /run/bucketfs for root, else /tmp/bucketfs-UID.
    fallback = "/run/bucketfs" if os.geteuid() == 0 else f"/tmp/bucketfs-{os.geteuid()}"
    assert runtime.state_dir("/mnt/b") == Path(f"{fallback}/{digest}")
    assert socket_candidates("/mnt/b", 0)[-1] == Path(f"/run/bucketfs/{digest}/hints.sock")
    monkeypatch.setenv(location.SOCKET_ENV, "/elsewhere/h.sock")
    assert socket_candidates("/mnt/b", 1000) == [Path("/elsewhere/h.sock")]


# --- send_order against a real server ------------------------------------------------------


@pytest.fixture
def mounts(monkeypatch) -> Iterator[tuple[Path, Path]]:
    """Two directories the mount table calls bucketfs mounts, owned by us; sockets are
    found the way a real client finds them (XDG_RUNTIME_DIR), not by override."""
    top = Path(tempfile.mkdtemp(prefix="bfh-"))
    one, two = top / "one", top / "two"
    for root in (one, two, top / "plain", top / "run"):
        root.mkdir()
    table = [Mount("/", "ext4"), Mount(str(one), FSTYPE, options=f"user_id={os.getuid()}"),
             Mount(str(two), FSTYPE, options=f"user_id={os.getuid()}")]
    monkeypatch.setattr(location, "read_mounts", lambda: table)
    monkeypatch.setattr(client, "_warned", set())
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(top / "run"))
    monkeypatch.delenv(location.SOCKET_ENV, raising=False)
    yield one, two
    shutil.rmtree(top, ignore_errors=True)


def test_paths_are_grouped_by_mount_and_made_relative(mounts, monkeypatch):
    one, two = mounts
    (one / "sub").mkdir()
    (one.parent / "link").symlink_to(one / "sub")
    monkeypatch.chdir(one)
    paths = ["a.jpg", one / "sub" / "b.jpg", str(two / "c" / "d.jpg"), "/etc/hostname",
             str(one.parent / "link" / "e.jpg"), "sub/../f.jpg", str(one.parent / "plain/x")]
    with daemon_thread(location.socket_path(str(one))) as d1, \
            daemon_thread(location.socket_path(str(two))) as d2:
        assert send_order(paths, epoch=4, job="j", rank=1, world_size=3)
        assert end_job("j")
    assert d1.orders[0].paths == ["a.jpg", "sub/b.jpg", "sub/e.jpg", "f.jpg"]
    assert (d1.orders[0].epoch, d1.orders[0].rank, d1.orders[0].world_size) == (4, 1, 3)
    assert d2.orders[0].paths == ["c/d.jpg"]
    assert d1.ends == d2.ends == ["j"]


def test_send_next_order_announces_the_next_epoch(mounts):
    one, _ = mounts
    with daemon_thread(location.socket_path(str(one))) as daemon:
        assert send_order([one / "a.jpg", one / "b.jpg"], epoch=4, job="j", next_follows=True)
        assert send_next_order(["b.jpg", "a.jpg"], epoch=5, job="j", mount=str(one))
        assert send_order([one / "c.jpg"], epoch=6, job="j", next_epoch=True)
    assert [(o.epoch, o.next_epoch, o.next_follows, o.paths) for o in daemon.orders] == [
        (4, False, True, ["a.jpg", "b.jpg"]), (5, True, False, ["b.jpg", "a.jpg"]),
        (6, True, False, ["c.jpg"])]


def test_end_job_waits_for_an_order_still_being_sent(mounts):
    one, _ = mounts
    seen: list[tuple[bool, int]] = []  # (next_epoch, ENDs received before it)
    ends: list[str] = []
    with daemon_thread(location.socket_path(str(one)),
                       on_order=lambda o: seen.append((o.next_epoch, len(ends)))) as daemon:
        ends = daemon.ends
        assert send_order([one / "a.jpg"], epoch=0, job="slow")
        gate = threading.Event()

        def later() -> None:
            gate.wait(10)
            send_next_order([one / "a.jpg"], epoch=1, job="slow")

        client.send_later(later)
        threading.Timer(0.2, gate.set).start()
        assert end_job("slow")
    assert seen == [(False, 0), (True, 0)], "the next order came before the END"
    assert daemon.ends == ["slow"]


def test_a_fork_waits_for_an_order_being_sent():
    """A child (a DataLoader worker) never starts while the sending thread, which does
    not exist in it, may hold a lock."""
    sent = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        sent.set()

    client.send_later(slow)
    pid = os.fork()
    if pid == 0:  # the child: the send finished before the fork
        os._exit(0 if sent.is_set() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_no_path_under_a_mount_warns_once(mounts):
    with pytest.warns(HintWarning) as caught:
        for _ in range(3):
            assert send_order(["/etc/hostname"], epoch=0) is False
    assert len(caught) == 1 and "no path is under a bucketfs mount" in str(caught[0].message)


def test_failures_warn_once_per_reason_and_never_raise(mounts, monkeypatch):
    one, _ = mounts

    def refuse(order):
        raise ValueError("epoch went backwards")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert send_order([one / "a"], epoch=0) is False  # nobody listens yet
        sock = location.socket_path(str(one))
        with daemon_thread(sock, on_order=refuse):
            for _ in range(2):
                assert send_order([one / "a"], epoch=0) is False
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "no hints socket" in messages[0]
    assert messages[1].endswith(f"the daemon of {one} refused: epoch went backwards")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a socket another user owns")
def test_a_socket_another_user_planted_is_not_trusted(mounts):
    one, _ = mounts
    sock = location.socket_path(str(one))
    with daemon_thread(sock) as daemon:
        os.chown(sock, 12345, -1)
        with pytest.warns(HintWarning, match="no hints socket"):
            assert not send_order([one / "a"], epoch=0)
    assert not daemon.orders


def test_strict_mode_raises(mounts):
    one, _ = mounts
    with pytest.raises(HintError, match="no hints socket"):
        send_order([one / "a"], epoch=0, strict=True)
    with pytest.raises(HintError, match="not under a bucketfs mount"):
        send_order(["a"], epoch=0, mount="/etc", strict=True)


def test_send_order_needs_neither_torch_nor_the_daemon_stack():
    code = ("import sys, warnings; warnings.simplefilter('ignore');"
            "from bucketfs.hints import send_order;"
            "assert send_order(['/nonexistent/x'], epoch=0) is False;"
            "heavy = {'torch', 'trio', 'pyfuse3', 'boto3', 'rocksdict', 'prometheus_client'};"
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# --- bucketfs hint -----------------------------------------------------------------------


def test_cli_sends_an_order_and_ends_it(mounts, tmp_path, capsys, monkeypatch):
    one, _ = mounts
    listing = tmp_path / "order.txt"
    listing.write_text(f"b/2.jpg\na with space.jpg\n\n{one}/c.jpg\n")
    with daemon_thread(location.socket_path(str(one))) as daemon:
        assert bucketfs_main(["hint", str(one), str(listing), "--epoch", "2",
                              "--job", "cli-job"]) == 0
        assert capsys.readouterr().out == "cli-job\n"
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(listing.read_bytes())))
        assert hint_main([str(one), "-"]) == 0
        job = capsys.readouterr().out.strip()
        assert hint_main([str(one), "--end", "--job", "cli-job"]) == 0
    assert daemon.orders[0].paths == ["b/2.jpg", "a with space.jpg", "c.jpg"]
    assert daemon.orders[0].epoch == 2 and daemon.orders[1].job == job != "cli-job"
    assert not daemon.orders[0].next_epoch
    assert daemon.ends == ["cli-job"]


def test_cli_announces_the_next_epoch(mounts, tmp_path, capsys):
    one, _ = mounts
    listing = tmp_path / "order.txt"
    listing.write_text("b/2.jpg\na.jpg\n")
    with daemon_thread(location.socket_path(str(one))) as daemon:
        assert hint_main([str(one), str(listing), "--epoch", "2", "--next-follows",
                          "--job", "cli-job"]) == 0
        assert hint_main([str(one), str(listing), "--epoch", "3", "--next",
                          "--job", "cli-job"]) == 0
    assert capsys.readouterr().out == "cli-job\ncli-job\n"
    assert [(o.epoch, o.next_follows, o.next_epoch, o.paths) for o in daemon.orders] == [
        (2, True, False, ["b/2.jpg", "a.jpg"]), (3, False, True, ["b/2.jpg", "a.jpg"])]


@pytest.mark.parametrize("args, error", [
    (["/etc", "{listing}"], "/etc is not under a bucketfs mount"),
    (["{one}", "{listing}"], "no hints socket for"),
    (["{one}", "/nonexistent"], "cannot read /nonexistent"),
    (["{one}"], "FILE_OF_PATHS is required"),
    (["{one}", "--end"], "--end needs --job"),
    (["{one}", "--end", "--next", "--job", "j"], "--end takes no --next"),
    (["{one}", "{listing}", "--next", "--next-follows"],
     "an order of the next epoch announces no other"),
])
def test_cli_errors_are_one_line(mounts, tmp_path, capsys, args, error):
    one, _ = mounts
    listing = tmp_path / "order.txt"
    listing.write_text("x.jpg\n")
    argv = [a.format(one=one, listing=listing) for a in args]
    assert hint_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("bucketfs hint: error: ") and error in err and err.count("\n") == 1


def test_cli_refuses_paths_outside_the_mount(mounts, tmp_path, capsys):
    one, _ = mounts
    listing = tmp_path / "order.txt"
    listing.write_text("x.jpg\n/etc/hostname\n")
    with daemon_thread(location.socket_path(str(one))) as daemon:
        assert hint_main([str(one), str(listing)]) == 1
    assert "1 of 2 paths are not files under" in capsys.readouterr().err
    assert not daemon.orders
