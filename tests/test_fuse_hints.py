"""Hints end to end: a DataLoader with HintSampler over a real S3 mount whose RAM cache
is smaller than the dataset reads exactly the samples it reads without hints, while the
daemon prefetches ahead of it (its metrics show prefetch hits)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler
from torchvision import datasets, transforms

from bucketfs.demo import make_image_dataset
from bucketfs.hints import HintSampler
from tests.mounting import bucketfs, drop_page_cache, metrics, mounted
from tests.servers import free_ports

pytestmark = pytest.mark.fuse


def epochs(dataset, sampler, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = DataLoader(dataset, sampler=sampler, batch_size=8, num_workers=2,
                        persistent_workers=True)
    return [batch for _ in range(count) for batch in loader]


@pytest.mark.root  # drops the page cache
def test_hint_sampler_prefetches_and_changes_no_sample(s3_server, tmp_path):
    local = tmp_path / "local"
    files = make_image_dataset(local, classes=4, per_class=40, seed=5, mean_kb=40)
    s3_server.create_bucket("hinted")
    for path in files:
        s3_server.put("hinted", "train/" + path.relative_to(local).as_posix(),
                      path.read_bytes())
    dataset_bytes = sum(path.stat().st_size for path in files)
    assert dataset_bytes > 4 * 1024**2  # the RAM cache below holds well under half
    port = free_ports(1)[0]
    transform = transforms.Compose([transforms.Resize(32), transforms.CenterCrop(32),
                                    transforms.ToTensor()])
    with mounted("s3://hinted/train", tmp_path / "mnt", "--addressing-style", "path",
                 "--ram-cache", "4MiB", "--metrics-port", str(port),
                 env=s3_server.env()) as mnt:
        dataset = datasets.ImageFolder(str(mnt), transform=transform)
        plain = epochs(dataset, RandomSampler(
            dataset, generator=torch.Generator().manual_seed(11)), 2)
        before = metrics(port)
        # The kernel opens files itself (kernel_opens) and would serve these epochs from
        # its page cache without asking the daemon; drop it, as a dataset larger than
        # the node's memory would, so that the first hinted epoch reads through the
        # daemon.
        drop_page_cache()
        hinted = epochs(dataset, HintSampler(RandomSampler(
            dataset, generator=torch.Generator().manual_seed(11)), dataset), 2)
        after = metrics(port)
    assert len(plain) == len(hinted) == 2 * 160 // 8
    for (images, labels), (want_images, want_labels) in zip(hinted, plain, strict=True):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)
    assert before["bucketfs_hints_orders_total"] == 0
    assert after["bucketfs_hints_orders_total"] == 2  # one order per epoch
    assert after["bucketfs_prefetch_started_total"] > 0
    assert after["bucketfs_prefetch_hits_total"] > 0
    assert after["bucketfs_prefetch_failed_total"] == 0
    # The window fits the RAM tier and hinted eviction keeps what is about to be read:
    # (almost) nothing prefetched is evicted unread. (Measured: 0 of 167.)
    assert after["bucketfs_prefetch_wasted_total"] <= after["bucketfs_prefetch_started_total"] / 10


def test_bucketfs_hint_command_sends_an_order_the_daemon_resolves(tmp_path):
    bucket = tmp_path / "bucket"
    for name in ("a/1.bin", "a/2.bin", "b/3.bin"):
        (bucket / name).parent.mkdir(parents=True, exist_ok=True)
        (bucket / name).write_bytes(name.encode() * 1000)
    port = free_ports(1)[0]
    order = tmp_path / "order.txt"
    order.write_text("b/3.bin\na/2.bin\nmissing/4.bin\na/1.bin\n")
    with mounted(f"file://{bucket}", tmp_path / "mnt", "--metrics-port", str(port)) as mnt:
        result = bucketfs("hint", str(mnt), str(order), "--epoch", "0")
        assert result.returncode == 0, result.stderr
        for _ in range(100):
            values = metrics(port)
            if values.get("bucketfs_prefetch_started_total", 0) >= 3:
                break
            time.sleep(0.05)
        assert values["bucketfs_hints_orders_total"] == 1
        assert values["bucketfs_prefetch_started_total"] == 3  # the missing path skipped
        assert (mnt / "a/1.bin").read_bytes() == b"a/1.bin" * 1000
        bad = bucketfs("hint", str(tmp_path), str(order))
    assert bad.returncode == 1 and "bucketfs" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
