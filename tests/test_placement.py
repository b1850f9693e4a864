"""The `cpus` option (bucketfs/placement.py): parsed, resolved against the cores the
daemon may use, and applied to every thread of a real daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bucketfs.config import ConfigError, load_config
from bucketfs.placement import chosen_cores, parse_cpus
from tests.mounting import bucketfs, daemon_pid, mounted


@pytest.mark.parametrize(("given", "kept"), [
    (None, None), ("", None), (4, "4"), ("04", "4"), (" 8-11,14 ", "8-11,14"), ("3", "3")])
def test_a_count_or_a_list_of_cores_is_kept_as_given(given, kept):
    assert parse_cpus(given) == kept


@pytest.mark.parametrize("given", [0, "0", True, "four", "3-1", "1-", "-2", "1,,2", 2.5])
def test_anything_else_is_refused(given):
    with pytest.raises(ValueError):
        parse_cpus(given)


def test_the_config_file_and_flag_take_it():
    assert load_config(None, {"cpus": "2"}).cpus == "2"
    assert load_config(None, {}).cpus is None
    with pytest.raises(ConfigError, match="cpus"):
        load_config(None, {"cpus": "x"})


def test_a_count_takes_the_last_allowed_cores_and_a_list_only_allowed_ones():
    allowed = {0, 1, 2, 3, 8, 9}
    assert chosen_cores("2", allowed) == {8, 9}
    assert chosen_cores("64", allowed) == allowed
    assert chosen_cores("1-2,8", allowed) == {1, 2, 8}
    with pytest.raises(ValueError, match=r"cores \[4, 5\] are not available"):
        chosen_cores("3-5", allowed)


@pytest.mark.fuse
def test_every_thread_of_the_daemon_runs_on_the_chosen_cores(tmp_path: Path):
    source = tmp_path / "bucket"
    (source / "d").mkdir(parents=True)
    (source / "d" / "f.bin").write_bytes(os.urandom(300_000))
    last = max(os.sched_getaffinity(0))
    with mounted(f"file://{source}", tmp_path / "mnt", "--cpus", "1") as mnt:
        assert (mnt / "d" / "f.bin").read_bytes() == (source / "d" / "f.bin").read_bytes()
        pid = daemon_pid(mnt)
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1  # its workers were started after the choice
        assert {tid: os.sched_getaffinity(int(tid)) for tid in threads} == \
            {tid: {last} for tid in threads}
        assert f"runs on cores {last}" in (tmp_path / "mnt.log").read_text()


@pytest.mark.fuse
def test_cores_the_daemon_may_not_use_are_a_clear_error(tmp_path: Path):
    (tmp_path / "bucket").mkdir()
    (tmp_path / "mnt").mkdir()
    result = bucketfs("mount", f"file://{tmp_path / 'bucket'}", str(tmp_path / "mnt"),
                      "--cpus", "4090-4095", "--log-file", str(tmp_path / "log2"))
    assert result.returncode != 0
    assert "cannot run on cores 4090-4095" in result.stderr
    assert "are not available to the daemon" in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")
