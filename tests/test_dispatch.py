"""The dispatcher's bookkeeping of its data processes (dispatch.py) that needs no
process: the real ones are started, fed and killed in tests/test_bench_fuse_clones.py."""

from __future__ import annotations

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
