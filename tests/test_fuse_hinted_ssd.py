"""Hinted eviction on the SSD tier, end to end: a real mount whose SSD cache holds half
the dataset, read in a new shuffled order each epoch with the order sent first, goes
back to the origin about as little as Belady's MIN allows."""

from __future__ import annotations

import random

import pytest

from bucketfs.hints import send_order
from tests.mounting import drop_page_cache, metrics, mounted
from tests.servers import free_ports

pytestmark = [pytest.mark.fuse, pytest.mark.root]

FILES = 160
FILE_BYTES = 40_000
SSD_FILES = FILES // 2


def gets(port: int) -> float:
    return metrics(port)['bucketfs_origin_requests_total{kind="get"}']


def read_epochs(mnt, names: list[str], port: int, *, hinted: bool) -> list[float]:
    rng = random.Random(5)
    per_epoch = []
    for epoch in range(4):
        order = rng.sample(names, len(names))
        before = gets(port)
        if hinted:
            assert send_order([str(mnt / name) for name in order], epoch=epoch,
                              job="ssd-test", strict=True)
        for name in order:
            data = (mnt / name).read_bytes()
            assert data == name.encode().ljust(FILE_BYTES, b"#")
        per_epoch.append(gets(port) - before)
        drop_page_cache()
    return per_epoch


def test_ssd_at_half_the_dataset_keeps_what_min_keeps(tmp_path):
    bucket = tmp_path / "bucket"
    names = [f"d{i % 4}/{i:04d}.bin" for i in range(FILES)]
    for name in names:
        (bucket / name).parent.mkdir(parents=True, exist_ok=True)
        (bucket / name).write_bytes(name.encode().ljust(FILE_BYTES, b"#"))
    results = {}
    for mode in ("hinted", "plain"):
        port = free_ports(1)[0]
        args = ["--cache-dir", str(tmp_path / f"cache-{mode}"),
                "--disk-cache", str(SSD_FILES * FILE_BYTES), "--ram-cache", "512KiB",
                "--metrics-port", str(port)]
        with mounted(f"file://{bucket}", tmp_path / f"mnt-{mode}", *args) as mnt:
            results[mode] = read_epochs(mnt, names, port, hinted=mode == "hinted")
    hinted, plain = results["hinted"], results["plain"]
    print(f"GETs per epoch: hinted {hinted}, plain {plain}")
    assert plain[0] == FILES  # cold: every file once
    # Cold with hints: a few files fetched for the window, not kept on SSD (full of files
    # still to be read) and let go by the small RAM before their read, are fetched again
    # (measured: 0-5 on a quiet machine, up to 18 with the other core busy).
    assert FILES <= hinted[0] <= FILES + 20
    # Each later epoch can hit at most what the caches hold when it starts: MIN gets
    # SSD_FILES hits per epoch plus a few from RAM (about 67 GETs). Hinted eviction keeps
    # what the epoch has yet to read (measured: 59-78 GETs per epoch); the configured
    # policy alone rotates it out (measured: 127-140 GETs when the SSD tier kept a file
    # per block; 91-111 since the write-through packs chunks, whose members age and go
    # together: 1.32-1.47x the hinted epochs' GETs in twelve runs on a quiet machine,
    # the same before and after 6891836, and 1.24x once in CI with the other core busy,
    # where the hinted epochs fetched more for their windows). If hints did nothing the
    # two would be about equal.
    for count in hinted[1:]:
        assert count <= FILES - 0.9 * SSD_FILES
    assert sum(plain[1:]) > 1.15 * sum(hinted[1:])
