"""Read-path figures for the plain mount (no cache tier yet), on loopback:

    python -m bench.mount_reads [--images 2000] [--large-mib 1024] [--workers 4] [--out DIR]

Starts a real S3 server (SeaweedFS) behind a counting proxy, uploads a generated JPEG
ImageFolder and one large object, then measures, each against its baseline:
  - an ImageFolder epoch (decode + resize, DataLoader with W workers, shuffled) through
    the mount, cold then warm, against the same loop on local disk;
  - raw reads of every image (8 threads, shuffled) through the mount against boto3 GETs;
  - a sequential read of the large object through the mount against one boto3 GET;
  - requests the origin saw (GET / LIST / HEAD, counted by the proxy, not self-reported),
    and the daemon's peak RSS.
The link is not shaped (that is the comparison harness's job); these figures measure
the mount's own overhead. Results: JSON under bench/results/, a table on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.tree import this_tree
from bucketfs.demo import make_image_dataset
from bucketfs.runtime import state_dir
from tests.faultproxy import FaultProxy
from tests.servers import S3Server

MiB = 1024**2


def bucketfs(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "bucketfs", *args], check=True,
                   env={**os.environ, **env})


def read_files(paths: list[Path], threads: int = 8) -> int:
    def one(path: Path) -> int:
        with open(path, "rb") as f:
            return len(f.read())

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, paths))


def imagefolder_epoch(root: Path, workers: int) -> dict[str, float]:
    import torch
    from torchvision import datasets, transforms

    dataset = datasets.ImageFolder(str(root), transform=transforms.Compose([
        transforms.Resize(64), transforms.CenterCrop(64), transforms.ToTensor()]))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=64, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    count = sum(len(images) for images, _ in loader)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "images_per_s": count / seconds}


def drop_page_cache() -> None:
    """So the next pass reaches the daemon (or the disk) instead of the kernel page cache."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--large-mib", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    results: dict[str, object] = {
        "command": "python -m bench.mount_reads " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.platform()}",
    }
    with tempfile.TemporaryDirectory() as tmp, S3Server() as server:
        work = Path(tmp)
        local = work / "local"
        files = make_image_dataset(local, classes=10, per_class=args.images // 10, seed=1)
        dataset_bytes = sum(p.stat().st_size for p in files)
        large = os.urandom(args.large_mib * MiB)
        server.create_bucket("bench")
        client = server.client()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: server.put("bench", "train/" + p.relative_to(local)
                                                .as_posix(), p.read_bytes()), files))
        server.put("bench", "large.bin", large)
        results["dataset"] = {"images": len(files), "bytes": dataset_bytes,
                              "mean_kb": dataset_bytes / len(files) / 1000,
                              "large_bytes": len(large)}
        del large

        keys = ["train/" + p.relative_to(local).as_posix() for p in files]
        random.Random(2).shuffle(keys)

        def boto_get_all() -> int:
            def one(key: str) -> int:
                return len(client.get_object(Bucket="bench", Key=key)["Body"].read())
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                return sum(pool.map(one, keys))

        seconds, _ = timed(boto_get_all)
        results["raw_boto3_8_threads_s"] = seconds
        seconds, _ = timed(lambda: len(client.get_object(Bucket="bench", Key="large.bin")
                                       ["Body"].read()))
        results["large_boto3_single_get_MBps"] = args.large_mib * MiB / seconds / 1e6

        with FaultProxy("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])) as proxy:
            env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, **this_tree()}
            mnt = work / "mnt"
            mnt.mkdir()

            def mount(*extra: str) -> int:
                bucketfs("mount", "s3://bench", str(mnt), "--addressing-style", "path",
                         "--log-file", str(work / "mount.log"), *extra, env=env)
                return int((state_dir(str(mnt)) / "pid").read_text())

            def origin_requests() -> dict[str, int]:
                lists = proxy.count("GET", "list-type=2")
                return {"GET": proxy.count("GET") - lists, "HEAD": proxy.count("HEAD"),
                        "LIST": lists}

            # Raw reads, cold then warm (kernel page cache), on a fresh mount.
            proxy.clear()
            pid = mount()
            paths = [mnt / k for k in keys]
            results["raw_mount_cold_8_threads_s"], _ = timed(read_files, paths)
            results["raw_mount_warm_8_threads_s"], _ = timed(read_files, paths)
            results["large_mount_cold_MBps"] = (
                args.large_mib * MiB / timed(read_files, [mnt / "large.bin"], 1)[0] / 1e6)
            results["requests_raw_and_large"] = origin_requests()
            results["daemon_peak_rss_mib"] = peak_rss_mib(pid)
            bucketfs("umount", str(mnt), env=env)

            # The training-like loop: local disk (after one epoch that warms the page cache
            # and the interpreter's imports; then with the page cache dropped), then the
            # mount: cold, warm from the kernel page cache, warm from the daemon's RAM
            # tier (page cache dropped), and after a remount from the SSD tier.
            imagefolder_epoch(local, args.workers)
            results["epoch_local"] = imagefolder_epoch(local, args.workers)
            drop_page_cache()
            results["epoch_local_page_cache_dropped"] = imagefolder_epoch(local, args.workers)
            cache = ("--cache-dir", str(work / "cache"), "--disk-free-floor", "0")
            proxy.clear()
            mount(*cache)
            results["epoch_mount_cold"] = imagefolder_epoch(mnt / "train", args.workers)
            results["epoch_mount_page_cache"] = imagefolder_epoch(mnt / "train", args.workers)
            drop_page_cache()
            results["epoch_mount_ram_tier"] = imagefolder_epoch(mnt / "train", args.workers)
            results["requests_epochs"] = origin_requests()
            bucketfs("umount", str(mnt), env=env)
            drop_page_cache()
            proxy.clear()
            mount(*cache)
            results["epoch_mount_ssd_tier_after_remount"] = imagefolder_epoch(
                mnt / "train", args.workers)
            results["requests_epoch_after_remount"] = origin_requests()
            bucketfs("umount", str(mnt), env=env)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"mount_reads-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
