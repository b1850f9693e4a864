"""bench.large_gets reads one object through the daemon's GET engine and through obstore,
in alternation, and reports each one's CPU per GiB."""

from __future__ import annotations

import json

from bench import large_gets
from bucketfs.spare_buffers import spare_buffers


def test_both_readers_read_the_whole_object_each_round(tmp_path, capsys):
    limit = spare_buffers.limit
    assert large_gets.main(["--mib", "24", "--rounds", "2", "--out", str(tmp_path)]) == 0
    # The process's pool is left as it was: its limit, and no buffer of the run in it.
    assert spare_buffers.limit == limit and spare_buffers.spare_bytes == 0
    results = json.loads(next(tmp_path.glob("large-gets-*.json")).read_text())
    readers = results["readers"]
    assert set(readers) == {large_gets.ENGINE, "obstore 8 x 8 MiB range GETs"}
    for row in readers.values():
        assert len(row["cpu_s_per_gib"]["rounds"]) == 2
        assert all(x > 0 for x in row["mb_per_s"]["rounds"])
    assert f"| {large_gets.ENGINE} |" in capsys.readouterr().out
