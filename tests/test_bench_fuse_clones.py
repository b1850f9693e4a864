"""bench.fuse_clones runs end to end: bucketfs and its minimal server on SeaweedFS, the
connection served by one and by two processes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import fuse_clones
from bench.dataplane import BUCKET, make_dataset
from bench.harness import raw_fuse
from bench.harness.procstats import descendants
from bucketfs.data_jobs import owner_of
from tests.servers import S3Server

pytestmark = [pytest.mark.fuse, pytest.mark.root]  # mount(2), drop_caches


def test_two_processes_share_one_connection_and_every_pass_is_measured(tmp_path, capsys):
    assert fuse_clones.main(["--files", "60", "--readers", "4", "--procs", "1,2",
                             "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("fuse_clones-*.json")).read_text())
    assert [c["client"] for c in saved["clients"]][:1] == ["boto3 get_object"]
    rows = {(row["server"], row["pass"]): row for row in saved["rows"]}
    passes = [(fuse_clones.server_name(source, procs, threads), name)
              for procs, threads in ((1, 5), (2, 3))
              for source, names in fuse_clones.SOURCE_PASSES.items() for name in names if name]
    assert set(rows) == {("bucketfs (RAM only)", "cold"),
                         ("bucketfs (RAM only)", "warm, RAM tier"),
                         ("bucketfs (--cache-dir)", "cold"), *passes}
    assert ("pyfuse3, 2 processes", "from memory, through pyfuse3") in rows
    assert ("pyfuse3 dispatching to 2 bucketfs data processes",
            "cold, bucketfs's data path, SSD tier on") in rows
    for row in rows.values():
        assert row["files"] == 60 and row["files_per_s"] > 0
    # The kernel handed the one connection's requests to both processes; a dispatcher
    # answered the names and each of its repliers the reads of the files it owns
    # (bucketfs's dispatcher counts only its own: its data processes count none).
    serving = {fuse_clones.server_name(source, procs, threads): procs
               for procs, threads in ((1, 5), (2, 3)) for source in fuse_clones.SOURCE_PASSES}
    for server, name in passes:
        spread = rows[(server, name)]["requests_by_process"]
        assert len(spread) == (1 if "bucketfs data process" in server
                               else serving[server] + ("dispatching" in server))
        assert min(spread) > 0
        lead = rows[(server, name)]["lead_cpu_ms_per_file"]
        assert (lead is not None) == ("dispatching" in server)
        if lead is not None:
            # /proc counts in clock ticks: 60 files may cost the dispatcher none, or all
            # the ticks the processes were charged (the two sums then differ in rounding).
            assert 0 <= lead <= rows[(server, name)]["cpu_ms_per_file"] + 1e-9
    out = capsys.readouterr().out
    assert "| raw, 2 processes x 3 threads | cold, no cache |" in out
    assert "| pyfuse3 dispatching to 2 repliers x 3 threads | cold, kept by its replier |" in out
    assert "AWS_ENDPOINT_URL" not in os.environ  # s3torchconnector's, for it alone


@pytest.fixture(params=["memory", "pyfuse3", "dispatch-memory"])
def raw_mount(tmp_path, request):
    table = tmp_path / "table.json"
    bodies = tmp_path / "bodies"
    bodies.write_bytes(b"abc" + b"0123456789")
    table.write_text(json.dumps({"rows": [[1, "d", -1, ""], [2, "a", 3, "d/a"],
                                          [2, "b", 10, "d/b"]],
                                 "bodies": str(bodies), "origin": {}}))
    with fuse_clones.RawMount(tmp_path / "mnt", table, request.param, 2, 2) as mount:
        yield mount


def test_the_servers_serve_their_table_exactly(raw_mount):
    """Two processes on one connection, raw or pyfuse3 (which takes an INIT answered
    elsewhere: the patch's take_init); or pyfuse3 dispatching each read to the one of
    two repliers that owns the file, which writes the reply itself (the patch's
    read_unique and REPLIED_ELSEWHERE)."""
    where = raw_mount.mountpoint
    assert (where / "d" / "a").read_bytes() == b"abc"
    assert (where / "d" / "b").read_bytes() == b"0123456789"
    with open(where / "d" / "b", "rb") as f:
        f.seek(4)
        assert f.read(3) == b"456"
    assert sorted(os.stat(where / "d" / name).st_size for name in "ab") == [3, 10]
    with pytest.raises(FileNotFoundError):
        os.stat(where / "d" / "c")
    with pytest.raises(OSError):  # read-only
        os.open(where / "d" / "new", os.O_WRONLY | os.O_CREAT)


def test_the_clone_ioctl_is_the_kernels():
    # _IOR(229, 0, uint32_t), include/uapi/linux/fuse.h
    assert raw_fuse.FUSE_DEV_IOC_CLONE == (2 << 30) | (4 << 16) | (229 << 8) | 0


def test_servers_that_never_start_give_an_error_and_leave_no_mount(tmp_path):
    table = tmp_path / "table.json"
    table.write_text("{}")  # no rows: every server fails as it starts
    mount = fuse_clones.RawMount(tmp_path / "mnt", table, "memory", 2, 1)
    with pytest.raises(OSError):
        mount.__enter__()
    assert not os.path.ismount(tmp_path / "mnt")
    assert all(server.poll() is not None for server in mount.servers)


def test_a_replier_that_dies_fails_its_reads_and_nothing_else(tmp_path):
    """A read handed to a replier that dies is answered EIO, not left waiting; so are
    later reads of its files; the other replier's files and the names are served."""
    table = tmp_path / "table.json"
    bodies = tmp_path / "bodies"
    bodies.write_bytes(b"abc" + b"0123456789" + b"wxyz" + b"pq")  # inodes 3, 4, 5, 6
    table.write_text(json.dumps({"rows": [[1, "d", -1, ""], [2, "a", 3, "d/a"],
                                          [2, "b", 10, "d/b"], [2, "c", 4, "d/c"],
                                          [2, "e", 2, "d/e"]],
                                 "bodies": str(bodies), "origin": {}}))
    with fuse_clones.RawMount(tmp_path / "mnt", table, "dispatch-memory", 2, 2) as mount:
        where = mount.mountpoint / "d"
        assert (where / "b").read_bytes() == b"0123456789"  # replier 0: inodes 4, 6
        lost = mount.servers[2]  # after the dispatcher, replier 1: inodes 3 and 5
        assert _read_while_its_server_dies(where / "c", lost.pid) == {"errno": errno.EIO}
        with pytest.raises(OSError) as later:
            (where / "a").read_bytes()
        assert later.value.errno == errno.EIO
        assert (where / "e").read_bytes() == b"pq"
        assert os.stat(where / "a").st_size == 3
    assert mount.spread()[0]["REPLIER_LOST"] == 1


@contextlib.contextmanager
def _dispatching_bucketfs(tmp_path: Path, files: int, change: bool = False
                          ) -> Iterator[tuple[fuse_clones.RawMount, list[str], dict[str, bytes]]]:
    """A raw mount of `files` objects on SeaweedFS served by bucketfs's dispatcher and
    two data processes; with `change`, the first object is replaced in the bucket after
    its version went into the table."""
    with S3Server() as server:
        keys, _ = make_dataset(server, files, 4, 0)
        table, bodies = fuse_clones.write_table(server, keys, tmp_path)
        if change:
            server.client().put_object(Bucket=BUCKET, Key=keys[0], Body=b"a new version")
        try:
            with fuse_clones.RawMount(tmp_path / "mnt", table, "dispatch-bucketfs", 2,
                                      2) as mount:
                yield mount, keys, bodies
        finally:
            Path(json.loads(table.read_text())["bodies"]).unlink(missing_ok=True)


def test_bucketfs_data_processes_pin_each_read_to_its_version(tmp_path):
    """bucketfs's dispatcher and data processes serve exact bytes, each object from the
    data process that owns it; a read whose object no longer has the version in the
    table is answered EIO, not wrong bytes, and the dispatcher is told."""
    with _dispatching_bucketfs(tmp_path, 22, change=True) as (mount, keys, bodies):
        assert {owner_of(key, 2) for key in keys[1:]} == {0, 1}  # both serve some
        # the dispatcher and its two data processes
        assert len(descendants(mount.pids[0])) == 3
        for key in keys[1:]:
            assert (mount.mountpoint / key.removeprefix("train/")).read_bytes() == bodies[key]
        with pytest.raises(OSError) as stale:
            (mount.mountpoint / keys[0].removeprefix("train/")).read_bytes()
        assert stale.value.errno == errno.EIO
        time.sleep(1.5)  # a report of counters from each data process
    (answered,) = mount.spread()
    # (the kernel may ask again after an EIO: a notice each time)
    assert answered["CHANGED"] >= 1 and "RESTARTS" not in answered
    assert answered["READ"] >= len(keys)
    # Summed over both data processes: a miss and a GET for each file served (and a GET
    # for each read of the changed object, refused), and the failures.
    counts = json.loads(mount.stats[0].with_name(mount.stats[0].name + ".data").read_text())
    assert counts["cache_misses"] == len(keys) - 1
    assert counts["origin_get"] == len(keys) - 1 + answered["CHANGED"]
    assert counts["cache_origin_bytes"] >= sum(len(bodies[k]) for k in keys[1:])
    assert counts["failed_reads"] == answered["CHANGED"]
    assert counts["reads"] == answered["READ"]


def test_a_data_process_that_dies_fails_its_waiting_reads_and_is_started_again(tmp_path):
    """A read waiting on a data process that dies is answered EIO, not left waiting;
    the dispatcher starts the process again, and its objects are served again."""
    with _dispatching_bucketfs(tmp_path, 22) as (mount, keys, bodies):
        key = next(k for k in keys if owner_of(k, 2) == 1)
        other = next(k for k in keys if owner_of(k, 2) == 0)
        path = mount.mountpoint / key.removeprefix("train/")
        lost = _data_process(mount.pids[0], 1)
        assert _read_while_its_server_dies(path, lost) == {"errno": errno.EIO}
        other_path = mount.mountpoint / other.removeprefix("train/")
        assert other_path.read_bytes() == bodies[other]  # the other one serves
        deadline = time.monotonic() + 20
        while True:  # started again after a pause
            try:
                assert path.read_bytes() == bodies[key]
                break
            except OSError as error:
                assert error.errno == errno.EIO and time.monotonic() < deadline
                time.sleep(0.1)
        assert _data_process(mount.pids[0], 1) != lost
    (answered,) = mount.spread()
    assert answered["RESTARTS"] == 1


def _data_process(dispatcher: int, index: int) -> int:
    """The pid of the dispatcher's data process `index` (its command line says)."""
    for child in descendants(dispatcher)[1:]:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"bucketfs.data_process" in argv and argv[argv.index(b"--index") + 1] == \
                str(index).encode():
            return child
    raise LookupError(f"no data process {index} under {dispatcher}")


def test_data_processes_do_not_outlive_their_dispatcher(tmp_path):
    """A dispatcher killed outright takes its data processes with it (the kernel's
    parent-death signal), so none holds the mount's connection open: the mount's
    readers get an error, not a wait."""
    with _dispatching_bucketfs(tmp_path, 4) as (mount, keys, _):
        dispatcher, *data = descendants(mount.pids[0])
        assert len(data) == 2
        for pid in data:  # stuck: they would never see their socket close
            os.kill(pid, signal.SIGSTOP)
        os.kill(dispatcher, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in data):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(OSError) as gone:
            (mount.mountpoint / keys[0].removeprefix("train/")).read_bytes()
        assert gone.value.errno == errno.ENOTCONN


def _running(pid: int) -> bool:
    """Not yet exited (a zombie has: only its parent's wait is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_while_its_server_dies(path: Path, server: int) -> dict[str, object]:
    """Read `path` while process `server`, which serves it, is stopped; check that the
    read waits; kill the process; the read's outcome (its bytes or its errno)."""
    os.kill(server, signal.SIGSTOP)
    outcome: dict[str, object] = {}

    def read() -> None:
        try:
            outcome["bytes"] = path.read_bytes()
        except OSError as error:
            outcome["errno"] = error.errno

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive()  # its read waits on the stopped process
    os.kill(server, signal.SIGKILL)
    reader.join(10.0)
    assert not reader.is_alive()
    return outcome
