"""bench.large_gets reads one object through the daemon's GET engine and through obstore,
in alternation, and reports each one's CPU per GiB."""

from __future__ import annotations

import json

from bench import large_gets


def test_both_readers_read_the_whole_object_each_round(tmp_path, capsys):
    assert large_gets.main(["--mib", "24", "--rounds", "2", "--out", str(tmp_path)]) == 0
    results = json.loads(next(tmp_path.glob("large-gets-*.json")).read_text())
    readers = results["readers"]
    assert set(readers) == {large_gets.ENGINE, "obstore 8 x 8 MiB range GETs"}
    for row in readers.values():
        assert len(row["cpu_s_per_gib"]["rounds"]) == 2
        assert all(x > 0 for x in row["mb_per_s"]["rounds"])
    assert f"| {large_gets.ENGINE} |" in capsys.readouterr().out
