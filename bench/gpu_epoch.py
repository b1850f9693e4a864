"""Real training through the mount: how long the GPU waits for data, local disk against
bucketfs, with the daemon's CPU per file on the same node.

    python -m bench.gpu_epoch [--images 16384] [--model resnet50] [--batch-size 256]
                              [--workers 12] [--epochs 2] [--arms local,bucketfs,bucketfs-hints]
                              [--bucketfs-flags "--cpus 4"] [--device cuda] [--out DIR]

Starts SeaweedFS on loopback, writes an ImageFolder of JPEGs of ImageNet-like sizes to
local disk (IMAGES files: a few hundred distinct pictures, each written under many
names, since decoding cost and bytes are what matter, not distinct pixels) and uploads
it. Then, for every arm, trains torchvision's MODEL from scratch for EPOCHS epochs with
the usual augmentation (RandomResizedCrop 224, flip, normalise), a DataLoader of WORKERS
processes, bf16 autocast and channels_last on the GPU:
  - local: the tree on local disk, its page cache dropped before the first epoch;
  - bucketfs: `bucketfs mount --cache-dir` of the bucket; the first epoch cold (every
    file a GET), the next ones as a job's next epochs find them;
  - bucketfs-hints: the same with a fresh cache, the sampler wrapped in HintSampler.
Every arm shuffles with the same seeds (DistributedSampler of one replica), so all read
the same files in the same order.

Per epoch: images/s, the time the training loop blocked on its next batch, and the GPU's
busy and idle time. Busy is the sum of CUDA event pairs around each step's work (the
host-to-device copy, forward, backward, optimiser); idle is the epoch's wall time less
busy, which is what a faster data path could give back. Before the arms, a run of
synthetic steps (the batch already on the GPU) gives the images/s the GPU alone allows.
The daemon's CPU (/proc/PID/stat) per file, the S3 server's (it shares the node's cores
here; a real bucket is remote), and the loader's (this process and its workers) per
image. Needs root (FUSE, drop_caches). Results: JSON and a markdown table
under --out (bench/results/gpu-epoch-<time>.json and .md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.procstats import cpu_seconds
from bench.harness.saving import save_results

ARMS = ("local", "bucketfs", "bucketfs-hints")
CLASSES = 100


def make_tree(root: Path, images: int, distinct: int, seed: int = 7) -> list[Path]:
    """IMAGES JPEGs as root/class_XX/img_NNNNNN.jpg, round-robin over CLASSES classes;
    image i holds the bytes of distinct picture i % DISTINCT (bucketfs.demo's pictures,
    lognormal sizes around 110 KB)."""
    from bucketfs.demo import make_image_dataset

    distinct = max(1, min(distinct, images))
    with tempfile.TemporaryDirectory(prefix="gpu-epoch-pictures-") as scratch:
        pictures = [p.read_bytes() for p in make_image_dataset(
            Path(scratch), classes=1, per_class=distinct, seed=seed)]
    paths = []
    for i in range(images):
        path = root / f"class_{i % CLASSES:02d}" / f"img_{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pictures[i % distinct])
        paths.append(path)
    return paths


def upload(server: Any, bucket: str, root: Path, prefix: str, threads: int = 32) -> int:
    """Every file under root as PREFIX/<its path under root>; bytes uploaded. obstore's
    PUT: boto3's costs ~2 ms of CPU per object under the GIL, a minute for 16k files."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=server.endpoint, region=server.region,
                    access_key_id=server.access_key, secret_access_key=server.secret_key,
                    virtual_hosted_style_request=False, client_options={"allow_http": True})
    files = sorted(p for p in root.rglob("*") if p.is_file())

    def put(path: Path) -> int:
        body = path.read_bytes()
        obstore.put(store, f"{prefix}/{path.relative_to(root).as_posix()}", body)
        return len(body)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(put, files))


class StepClock:
    """The GPU's busy time, step by step: CUDA event pairs on its stream, read once at the
    end (reading them earlier would stall the host); on the CPU, the host's own clock."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []
        self.host_busy = 0.0
        self._began = 0.0

    def start(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs.append((event, None))
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.pairs[-1] = (self.pairs[-1][0], event)
        else:
            self.host_busy += time.perf_counter() - self._began

    def busy_seconds(self) -> float:
        if not self.cuda:
            return self.host_busy
        self.torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / 1000


@dataclass
class Trainer:
    """A model, its optimiser and how one step runs on DEVICE."""

    model: Any
    optimizer: Any
    device: Any

    @classmethod
    def build(cls, name: str, classes: int, device_name: str) -> Trainer:
        import torch
        import torchvision

        device = torch.device(device_name)
        model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
        model = model.to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        return cls(model, optimizer, device)

    def step(self, images: Any, labels: Any) -> None:
        import torch

        images = images.to(self.device, non_blocking=True, memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def gpu_bound(self, batch_size: int, image_size: int, steps: int) -> dict[str, float]:
        """Images/s with the batch already on the device: what the GPU alone allows."""
        import torch

        images = torch.randn(batch_size, 3, image_size, image_size, device=self.device)
        labels = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        for _ in range(3):  # cuDNN picks its kernels on the first steps
            self.step(images, labels)
        clock = StepClock(self.device)
        began = time.perf_counter()
        for _ in range(steps):
            clock.start()
            self.step(images, labels)
            clock.stop()
        busy = clock.busy_seconds()
        wall = time.perf_counter() - began
        return {"steps": steps, "wall_s": wall, "gpu_busy_s": busy,
                "images_per_s": steps * batch_size / wall}


def train_epoch(trainer: Trainer, batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """One pass over BATCHES: images, wall time, the host's wait for each next batch, and
    the device's busy and idle time (idle = wall - busy)."""
    clock = StepClock(trainer.device)
    images = steps = 0
    waited = 0.0
    began = time.perf_counter()
    iterator = iter(batches)
    while True:
        asked = time.perf_counter()
        try:
            batch_images, labels = next(iterator)
        except StopIteration:
            break
        waited += time.perf_counter() - asked
        clock.start()
        trainer.step(batch_images, labels)
        clock.stop()
        images += len(labels)
        steps += 1
    busy = clock.busy_seconds()  # waits for the last step's work
    wall = time.perf_counter() - began
    return {"images": images, "steps": steps, "wall_s": wall, "images_per_s": images / wall,
            "data_wait_s": waited, "gpu_busy_s": busy, "gpu_idle_s": max(0.0, wall - busy),
            "gpu_idle_pct": 100 * max(0.0, wall - busy) / wall}


def loader_for(root: Path, args: argparse.Namespace, hinted: bool) -> tuple[Any, Any]:
    """(DataLoader, its sampler) over the ImageFolder at root."""
    import torch
    import torchvision
    from torchvision import transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    dataset = torchvision.datasets.ImageFolder(str(root), transform=transform)
    sampler: Any = torch.utils.data.DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True)
    if hinted:
        from bucketfs.hints import HintSampler

        sampler = HintSampler(sampler, dataset)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
        pin_memory=args.device == "cuda", drop_last=True, persistent_workers=args.workers > 0,
        prefetch_factor=4 if args.workers else None)
    return loader, sampler


def run_arm(trainer: Trainer, root: Path, args: argparse.Namespace, *, hinted: bool,
            daemon_pid: int | None, server_pid: int | None) -> list[dict[str, Any]]:
    from bench.dataplane import drop_page_cache

    loader, sampler = loader_for(root, args, hinted)
    rows = []
    drop_page_cache()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        daemon_before = cpu_seconds(daemon_pid) if daemon_pid else 0.0
        server_before = cpu_seconds(server_pid) if server_pid else 0.0
        loader_before = cpu_seconds(os.getpid())
        row = train_epoch(trainer, loader)
        row["epoch"] = epoch + 1
        row["loader_cpu_ms_per_image"] = \
            1000 * (cpu_seconds(os.getpid()) - loader_before) / row["images"]
        if daemon_pid:
            used = cpu_seconds(daemon_pid) - daemon_before
            row["daemon_cpu_s"] = used
            row["daemon_cpu_ms_per_file"] = 1000 * used / row["images"]
            # The S3 server shares this node's cores here; on a real one it is remote.
            row["server_cpu_ms_per_file"] = \
                1000 * (cpu_seconds(server_pid) - server_before) / row["images"]
        rows.append(row)
        print(f"  epoch {epoch + 1}: {row['images_per_s']:,.0f} images/s, GPU idle "
              f"{row['gpu_idle_pct']:.1f}%", flush=True)
    del loader  # its persistent workers hold files open under the mount
    return rows


def markdown(result: dict[str, Any]) -> str:
    bound = result["gpu_bound"]
    lines = [
        f"{result['model']}, batch {result['batch_size']}, {result['workers']} loader "
        f"workers, {result['images']:,} images ({result['dataset_bytes'] / 1e9:.2f} GB); "
        f"{result['machine']}. GPU alone: {bound['images_per_s']:,.0f} images/s."
        + (f" Mount flags: `{result['bucketfs_flags']}`." if result["bucketfs_flags"] else ""),
        "",
        "| arm | epoch | images/s | GPU idle | data wait | loader CPU per image | "
        "daemon CPU per file | S3 server CPU per file |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm, rows in result["arms"].items():
        for row in rows:
            daemon, server = ((f"{row['daemon_cpu_ms_per_file']:.2f} ms",
                               f"{row['server_cpu_ms_per_file']:.2f} ms")
                              if "daemon_cpu_ms_per_file" in row else ("", ""))
            lines.append(
                f"| {arm} | {row['epoch']} | {row['images_per_s']:,.0f} | "
                f"{row['gpu_idle_s']:.1f} s ({row['gpu_idle_pct']:.1f}%) | "
                f"{row['data_wait_s']:.1f} s | {row['loader_cpu_ms_per_image']:.2f} ms | "
                f"{daemon} | {server} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    text = f"{os.cpu_count()} cores ({cpu}), Linux {platform.release()}"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name()}, torch {torch.__version__}"
    except ImportError:
        pass
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_epoch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16384)
    parser.add_argument("--distinct", type=int, default=500,
                        help="distinct pictures the images repeat")
    parser.add_argument("--model", default="resnet50", help="a torchvision.models name")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=12, help="DataLoader workers")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated subset of: {', '.join(ARMS)}")
    parser.add_argument("--bucketfs-flags", default="",
                        help='more `bucketfs mount` flags for the bucketfs arms, e.g. '
                             '"--cpus 4"')
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-bound-steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")

    from bench.dataplane import BUCKET, Mount
    from tests.servers import S3Server

    work = Path(tempfile.mkdtemp(prefix="bucketfs-gpu-epoch-"))
    try:
        began = time.monotonic()
        local = work / "local"
        make_tree(local, args.images, args.distinct)
        dataset_bytes = sum(p.stat().st_size for p in local.rglob("*.jpg"))
        print(f"dataset: {args.images:,} images, {dataset_bytes / 1e9:.2f} GB "
              f"({time.monotonic() - began:.0f} s)", flush=True)
        trainer = Trainer.build(args.model, CLASSES, args.device)
        bound = trainer.gpu_bound(args.batch_size, args.image_size, args.gpu_bound_steps)
        print(f"GPU alone: {bound['images_per_s']:,.0f} images/s", flush=True)
        result: dict[str, Any] = {
            "command": "python -m bench.gpu_epoch " + " ".join(argv or []),
            "machine": machine(), "model": args.model, "batch_size": args.batch_size,
            "workers": args.workers, "images": args.images, "dataset_bytes": dataset_bytes,
            "bucketfs_flags": args.bucketfs_flags,
            "gpu_bound": bound, "arms": {}}
        with S3Server() as server:
            if any(a.startswith("bucketfs") for a in arms):
                server.create_bucket(BUCKET)
                began = time.monotonic()
                upload(server, BUCKET, local, "train")
                print(f"uploaded ({time.monotonic() - began:.0f} s)", flush=True)
            for arm in arms:
                print(f"{arm}:", flush=True)
                if arm == "local":
                    result["arms"][arm] = run_arm(trainer, local, args, hinted=False,
                                                  daemon_pid=None, server_pid=None)
                    continue
                flags = ["--cache-dir", str(work / f"cache-{arm}"),
                         *shlex.split(args.bucketfs_flags)]
                with Mount(server, work / f"mnt-{arm}", flags) as mount:
                    result["arms"][arm] = run_arm(
                        trainer, mount.mountpoint, args, hinted=arm == "bucketfs-hints",
                        daemon_pid=mount.pid, server_pid=server.pid)
        path = save_results(args.out, "gpu-epoch", result, markdown(result))
        print(markdown(result))
        print(f"results: {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
