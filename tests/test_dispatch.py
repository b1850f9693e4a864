"""The dispatcher's bookkeeping of its data processes (dispatch.py) that needs no
process, and a real one taken for hung; the real ones are started, fed and killed with a
mount in tests/test_bench_fuse_clones.py and tests/test_fuse_data_processes.py."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from bucketfs.data_jobs import Setup
from bucketfs.dispatch import DataProcesses


def _two() -> DataProcesses:
    setups = [Setup("s3://b/", {}, index, 2, None, "s3 b") for index in range(2)]
    return DataProcesses(setups, -1, on_changed=lambda key: None)


def test_counters_sum_over_processes_and_keep_what_a_dead_one_counted():
    data = _two()
    first, second = data.slots
    first.counts = {"reads": 10, "cache_misses": 4}
    second.counts = {"reads": 5, "origin_get": 2}
    assert data.counts() == {"reads": 15, "cache_misses": 4, "origin_get": 2}
    assert data._gone(first) == 0  # nothing was waiting on it
    first.counts = {"reads": 3}  # started again: it counts from zero
    assert data.counts() == {"reads": 18, "cache_misses": 4, "origin_get": 2}
    data._gone(first)
    data._gone(second)
    assert data.counts() == {"reads": 18, "cache_misses": 4, "origin_get": 2}


def test_a_report_of_counters_replaces_the_last_and_a_bad_one_is_ignored():
    data = _two()
    slot = data.slots[0]
    data._notice(slot, b'N{"reads": 7}')
    data._notice(slot, b'N{"reads": 9}')
    assert data.counts() == {"reads": 9}
    data._notice(slot, b"N[1, 2]")
    data._notice(slot, b'N{"reads": "x"}')
    assert data.counts() == {"reads": 9}


def test_a_changed_object_is_told_and_a_log_record_logged(caplog):
    changed: list[str] = []
    data = DataProcesses([Setup("s3://b/", {}, 0, 1, None, "s3 b")], -1,
                         on_changed=changed.append)
    data._notice(data.slots[0], b"Ctrain/a.jpg")
    data._notice(data.slots[0], b"L30\tdata process 0: read of 'x' failed")
    assert changed == ["train/a.jpg"]
    assert "data process 0: read of 'x' failed" in caplog.text


def test_a_data_process_that_falls_silent_is_killed_and_started_again():
    """A real data process (no mount: its descriptor is /dev/null, its bucket never
    asked) stopped with SIGSTOP sends no counters; past `silent_s` the dispatcher kills
    it, and starts it again."""
    fuse_fd = os.open(os.devnull, os.O_WRONLY)
    data = DataProcesses([Setup("s3://b/", {"endpoint_url": "http://127.0.0.1:9"}, 0, 1,
                                None, "s3 b")], fuse_fd)
    data.silent_s = 1.0
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(data.run)
            with trio.fail_after(60):
                await data.wait_ready()
                first = data.slots[0].child.pid
                await trio.sleep(2.5)  # serving and reporting: never taken for hung
                assert data.hung == 0
                os.kill(first, signal.SIGSTOP)
                while data.restarts == 0:
                    await trio.sleep(0.1)
                await data.wait_ready()
            out["pids"] = (first, data.slots[0].child.pid)
            await data.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        os.close(fuse_fd)
    first, second = out["pids"]
    assert data.hung == 1 and first != second


def test_a_mount_with_data_processes_on_a_stock_pyfuse3_is_refused_before_any_setup(
        monkeypatch, tmp_path):
    """One line saying what to install, before the shards or anything else are made."""
    from bucketfs import fs_dispatch, mount
    from bucketfs.backends.urls import parse_bucket_url
    from bucketfs.config import Config
    from tests.membackend import MemoryBackend

    monkeypatch.setattr(fs_dispatch, "supported", lambda: False)
    cache_dir = tmp_path / "cache"
    info = mount.MountInfo(parse_bucket_url("s3://b"), str(tmp_path / "mnt"),
                           Config({"data_processes": 2, "cache_dir": str(cache_dir)}))
    with pytest.raises(mount.MountError, match="needs the pyfuse3 that `make venv`"):
        trio.run(mount._serve, info, MemoryBackend({"a": b"x"}), lambda warnings: None)
    assert not cache_dir.exists()
