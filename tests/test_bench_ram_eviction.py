"""bench.ram_eviction fills a RAM tier past its capacity and reports what each put costs."""

from __future__ import annotations

import json

from bench import ram_eviction


def test_a_full_tier_evicts_one_block_per_put_and_a_large_one_none(tmp_path, capsys):
    assert ram_eviction.main(["--puts", "2000", "--rounds", "1", "--capacities", "100",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("ram-eviction-*.json")).read_text())["rows"]
    assert [(r["capacity_blocks"], r["hinted"]) for r in rows] == [
        (100, False), (100, True), (2001, False), (2001, True)]
    for row in rows:
        assert row["us_per_put_min"] > 0
        if row["capacity_blocks"] == 100:
            assert row["evictions"] == 1900
            assert 0.5 < row["ranks_per_put"] < 2  # each entry ranked as its cool-down ends
        else:
            assert row["evictions"] == 0 and row["ranks_per_put"] == 0
    assert "| 100 | cost-lrfu in HintedPolicy, no plan | 1,900 |" in capsys.readouterr().out
