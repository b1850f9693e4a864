"""bench.gpu_epoch: its tree, its clock and a whole run, on the CPU (CI has no GPU)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

from bench import gpu_epoch  # noqa: E402


def test_the_tree_repeats_few_pictures_under_many_names(tmp_path: Path) -> None:
    paths = gpu_epoch.make_tree(tmp_path, images=10, distinct=3)
    assert len(paths) == 10 == len(list(tmp_path.rglob("*.jpg")))
    assert paths[0].parent.name == "class_00" and paths[1].parent.name == "class_01"
    assert paths[4].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()
    assert paths[0].read_bytes()[:2] == b"\xff\xd8"  # a JPEG


class SleepyTrainer:
    """A step that takes STEP_S of the (host) device; batches that take WAIT_S to come."""

    STEP_S, WAIT_S = 0.02, 0.03

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def step(self, images: Any, labels: Any) -> None:
        time.sleep(self.STEP_S)


def slow_batches(count: int, size: int) -> Iterator[tuple[Any, Any]]:
    for _ in range(count):
        time.sleep(SleepyTrainer.WAIT_S)
        yield torch.zeros(size, 1), torch.zeros(size, dtype=torch.long)


def test_an_epoch_splits_its_time_into_data_wait_busy_and_idle() -> None:
    row = gpu_epoch.train_epoch(SleepyTrainer(), slow_batches(5, 4))  # type: ignore[arg-type]
    assert (row["images"], row["steps"]) == (20, 5)
    # A sleep never ends early and may end late on a loaded machine (one ran 31 ms over
    # in five): bounds below, and the two disjoint within the epoch's wall time.
    assert row["gpu_busy_s"] >= 5 * SleepyTrainer.STEP_S - 0.005
    assert row["data_wait_s"] >= 5 * SleepyTrainer.WAIT_S - 0.005
    assert row["gpu_busy_s"] + row["data_wait_s"] <= row["wall_s"] + 0.005
    # Waiting for data is idle time of the device: here the two never overlap.
    assert row["gpu_idle_s"] == pytest.approx(row["wall_s"] - row["gpu_busy_s"])
    assert row["gpu_idle_s"] >= row["data_wait_s"] - 0.01
    assert row["gpu_idle_pct"] == pytest.approx(100 * row["gpu_idle_s"] / row["wall_s"])


@pytest.mark.fuse
@pytest.mark.root  # drop_caches
def test_a_whole_run_trains_through_the_mount_and_reports_every_arm(tmp_path: Path) -> None:
    code = gpu_epoch.main([
        "--images", "48", "--distinct", "4", "--model", "resnet18", "--image-size", "32",
        "--batch-size", "16", "--workers", "2", "--epochs", "2", "--device", "cpu",
        "--gpu-bound-steps", "1", "--out", str(tmp_path)])
    assert code == 0
    (saved,) = tmp_path.glob("gpu-epoch-*.json")
    result = json.loads(saved.read_text())
    assert list(result["arms"]) == list(gpu_epoch.ARMS)
    for arm, rows in result["arms"].items():
        assert [row["epoch"] for row in rows] == [1, 2]
        assert all(row["images"] == 48 for row in rows)  # 3 full batches
        assert ("daemon_cpu_ms_per_file" in rows[0]) == arm.startswith("bucketfs")
    # The first epoch through the mount made the daemon work; its rows are in the table.
    assert result["arms"]["bucketfs"][0]["daemon_cpu_s"] > 0
    assert "| bucketfs-hints | 2 |" in saved.with_suffix(".md").read_text()
