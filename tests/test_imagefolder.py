"""Unmodified torchvision training input code over the mount: ImageFolder through a
multi-worker DataLoader sees exactly what it sees on local disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision import datasets, transforms

from bucketfs.demo import make_image_dataset
from tests.mounting import mounted

pytestmark = pytest.mark.fuse


def load_all(root: Path) -> tuple[list[str], list[tuple[torch.Tensor, int]]]:
    dataset = datasets.ImageFolder(
        str(root),
        transform=transforms.Compose([transforms.Resize(48), transforms.CenterCrop(48),
                                      transforms.ToTensor()]),
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=False, num_workers=2)
    samples = []
    for images, labels in loader:
        samples.extend(zip(images, labels.tolist(), strict=True))
    return dataset.classes, samples


def test_imagefolder_over_s3_mount_matches_local_disk(s3_server, tmp_path):
    local = tmp_path / "local"
    files = make_image_dataset(local, classes=4, per_class=30, seed=3, mean_kb=40)
    s3_server.create_bucket("images")
    for path in files:
        s3_server.put("images", "train/" + path.relative_to(local).as_posix(), path.read_bytes())

    classes, expected = load_all(local)
    with mounted("s3://images/train", tmp_path / "mnt", "--addressing-style", "path",
                 env=s3_server.env()) as mnt:
        mounted_classes, samples = load_all(mnt)
    assert mounted_classes == classes and len(classes) == 4
    assert len(samples) == len(expected) == 120
    for (image, label), (want_image, want_label) in zip(samples, expected, strict=True):
        assert label == want_label
        assert torch.equal(image, want_image)
