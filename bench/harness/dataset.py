"""The benchmark's dataset on local disk: an ImageFolder tree of real JPEGs and a few large
files, generated once per scenario and kept (the local-disk contender reads it there).

    <root>/train/class_XX/img_YYYYY.jpg   bucketfs.demo.make_image_dataset (lognormal sizes)
    <root>/large/large-N.bin              random bytes, for sequential throughput
    <root>/manifest.json                  written last: a tree without it is regenerated
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.harness.scenarios import MiB, Scenario
from bucketfs.demo import make_image_dataset

DEFAULT_ROOT = Path("/var/tmp/bfsb-datasets")


@dataclass(frozen=True)
class Dataset:
    root: Path
    images: list[str]  # paths relative to root/train, sorted
    classes: list[str]
    image_bytes: int
    large: list[str]  # names under root/large
    large_bytes: int

    @property
    def train(self) -> Path:
        return self.root / "train"

    def large_paths(self) -> list[Path]:
        return [self.root / "large" / name for name in self.large]


def size_summary(sizes: list[int]) -> dict[str, float]:
    """How file sizes spread: count, total, mean, median, p10/p90, and the standard
    deviation of their logarithm (about 0.5 for the ImageNet-like lognormal)."""
    if not sizes:
        return {"count": 0, "total": 0}
    ordered = sorted(sizes)

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    logs = [math.log(s) for s in ordered if s > 0]
    return {
        "count": len(ordered),
        "total": sum(ordered),
        "mean": statistics.fmean(ordered),
        "median": float(statistics.median(ordered)),
        "p10": quantile(0.10),
        "p90": quantile(0.90),
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
        "log_sd": statistics.pstdev(logs) if len(logs) > 1 else 0.0,
    }


def _write_large(path: Path, size: int) -> None:
    # Random bytes: nothing on the way can compress them.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
    os.replace(tmp, path)


def ensure_dataset(scenario: Scenario, base: Path = DEFAULT_ROOT) -> Dataset:
    """The scenario's dataset under base, generated unless a complete one is there."""
    root = base / f"{scenario.name}-seed{scenario.seed}"
    manifest = root / "manifest.json"
    if manifest.exists():
        saved = json.loads(manifest.read_text())
        if saved.get("scenario") == asdict(scenario):
            return _load(root, saved)
    if root.exists():
        shutil.rmtree(root)
    train = root / "train"
    make_image_dataset(train, scenario.classes, scenario.per_class, scenario.seed,
                       mean_kb=scenario.mean_kb)
    (root / "large").mkdir(parents=True)
    for i in range(scenario.large_files):
        _write_large(root / "large" / f"large-{i}.bin", scenario.large_mib * MiB)
    images = sorted(p.relative_to(train).as_posix() for p in train.rglob("*.jpg"))
    saved = {"scenario": asdict(scenario), "images": images}
    manifest.write_text(json.dumps(saved))
    return _load(root, saved)


def _load(root: Path, saved: dict[str, object]) -> Dataset:
    images = list(saved["images"])  # type: ignore[call-overload]
    train = root / "train"
    large = sorted(p.name for p in (root / "large").iterdir() if p.suffix == ".bin")
    return Dataset(
        root=root,
        images=images,
        classes=sorted({name.split("/")[0] for name in images}),
        image_bytes=sum((train / name).stat().st_size for name in images),
        large=large,
        large_bytes=sum((root / "large" / name).stat().st_size for name in large),
    )


def image_sizes(dataset: Dataset) -> list[int]:
    return [(dataset.train / name).stat().st_size for name in dataset.images]
