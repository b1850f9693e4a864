"""bench.index_gets times index reads with and without the daemon's Bloom filters."""

from __future__ import annotations

import json

from bench import index_gets


def test_both_indexes_are_timed_for_held_and_absent_keys(tmp_path, capsys):
    assert index_gets.main(["--entries", "3000", "--reads", "300", "--rounds", "2",
                            "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("index-gets-*.json")).read_text())["rows"]
    assert [row["index"] for row in rows] == ["Bloom filters (index_options)",
                                              "RocksDB defaults, no filters"]
    for row in rows:
        assert row["entries"] == 3000 and row["held_us"] > 0 and row["absent_us"] > 0
    assert "| Bloom filters (index_options) | 3,000 |" in capsys.readouterr().out


def test_record_keys_are_distinct_and_an_absent_key_is_not_a_held_one():
    held = {index_gets.record_key(i) for i in range(1000)}
    assert len(held) == 1000
    assert index_gets.record_key(5, "other") not in held
