"""bench.large_options: every arm mounted with its own options, every round."""

from __future__ import annotations

import json

from bench import large_options


def test_each_arm_reads_the_object_with_its_options(tmp_path, capsys):
    assert large_options.main(["--arm", "never=--huge-buffers never",
                               "--arm", "always=--huge-buffers always",
                               "--large-mib", "16", "--rounds", "1",
                               "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("large-options-*.json")).read_text())
    assert saved["arms"] == {"never": "--huge-buffers never",
                             "always": "--huge-buffers always"}
    for name in ("never", "always"):
        by_pass = saved["rows"][name]
        assert list(by_pass) == ["cold", "from the SSD tier (remounted)"]
        for rows in by_pass.values():
            assert len(rows) == 1 and all(row["mb_per_s"] > 0 for row in rows)
            assert all(row["bytes"] == 16 * 1024 * 1024 for row in rows)
    out = capsys.readouterr().out
    assert "round 0 always, from the SSD tier (remounted):" in out
    assert "| always | `--huge-buffers always` | cold |" in out
