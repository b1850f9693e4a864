"""bench.compare_trees mounts this checkout and another revision in turn and reports
each pass for both; the other revision's daemon runs that revision's code."""

from __future__ import annotations

import json
import subprocess
import sys

from bench import compare_trees
from bench.harness.tree import ROOT


def test_both_trees_are_measured_for_every_pass_and_the_worktree_goes(tmp_path, capsys):
    # 100 files of ~100 KB through a 4 MiB RAM tier: the cold passes evict.
    assert compare_trees.main(["HEAD", "--files", "100", "--rounds", "1", "--readers", "4",
                               "--ram-cache", "4MiB", "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("compare-trees-*.json")).read_text())
    assert set(saved["trees"]) == {"this tree", "HEAD"}
    assert saved["readers"] == 4 and saved["ram_cache"] == "4MiB" and saved["file_kb"] == 100
    for tree in saved["trees"].values():
        assert list(tree) == list(compare_trees.PASSES)
        assert tree["cold"]["cpu_ms_per_file"]["median"] > 0  # 100 GETs: ticks counted
        assert tree["cold"]["switches_per_file"]["median"] > 1  # each GET a hand-off
        for row in tree.values():  # /proc counts 10 ms ticks: a warm pass may count none
            assert len(row["cpu_ms_per_file"]["rounds"]) == 1
            assert row["loop_ms_per_file"]["median"] >= 0
            assert row["files_per_s"]["median"] > 0
    printed = capsys.readouterr().out
    assert "| cold |" in printed and "4 readers, a 4MiB RAM tier, 100 files of ~100 KB" \
        in printed
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"],
                               capture_output=True, text=True, check=True).stdout
    assert "bucketfs-rev-" not in worktrees


def test_the_other_tree_imports_none_of_this_checkout():
    with compare_trees.worktree("HEAD") as tree:
        found = subprocess.run(
            [sys.executable, "-P", "-c", "import bucketfs.prefetch.eviction as e, bucketfs.fs as f;"
             " print(e.__file__); print(f.__file__)"],
            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, check=False)
    assert found.returncode == 0, found.stderr
    assert all(line.startswith(str(tree)) for line in found.stdout.split())


def test_the_large_object_read_is_compared_through_both_ram_tiers(tmp_path, capsys):
    assert compare_trees.main(["HEAD", "--large-mib", "32", "--rounds", "1",
                               "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("compare-trees-*.json")).read_text())
    passes = compare_trees.large_passes(32)
    assert passes == ("cold, RAM tier 2GiB", "cold, RAM tier 64MiB",
                      "from the SSD tier (remounted)")
    for tree in saved["trees"].values():
        assert list(tree) == list(passes)
        for row in tree.values():
            assert row["mb_per_s"]["median"] > 0
            assert len(row["cpu_s_per_gib"]["rounds"]) == 1
    assert "| cold, RAM tier 64MiB |" in capsys.readouterr().out
