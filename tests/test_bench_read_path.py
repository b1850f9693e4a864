"""bench.read_path runs end to end on a small bucket and reports every pass."""

from __future__ import annotations

import json

from bench import read_path


def test_the_read_path_bench_reports_calls_and_cpu_for_each_pass(tmp_path, capsys):
    assert read_path.main(["--files", "60", "--rounds", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("read-path-*.json")).read_text())
    passes = saved["passes"]
    assert list(passes) == list(read_path.PASSES)
    for row in passes.values():
        assert row["python_calls_per_read"] > 0
        assert 0 < row["cpu_us_min"] <= row["cpu_us_median"]
    # A RAM hit does less than a fetch, and less than a first read, which looks its
    # inode up in the index.
    calls = {name: row["python_calls_per_read"] for name, row in passes.items()}
    assert calls["warm"] < calls["warm, inode not seen before"] < calls["cold"]
    # A lookup first adds its own work, but the read then takes the entry it found.
    assert calls["warm, inode not seen before"] < calls["warm, name looked up first"] \
        < calls["cold"]
    # The hinted pass resolves its order and prefetches: more work than a cold read.
    assert calls["cold, the order sent first"] > calls["cold"]
    assert "| warm |" in capsys.readouterr().out
