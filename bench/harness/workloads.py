"""The workloads, run by the harness as a subprocess in the client namespace:

    python -m bench.harness.workloads SPEC.json OUT.json

SPEC says how the data is reached (`access`: local, mount, boto3, s3torch) and which
phases to run, in order:
  metadata    (SDK contenders) the first byte of one object from a fresh client, then a
              listing of the whole bucket (what `find` is to a mount)
  train       epochs of a training-like loop: ImageFolder-style dataset, a shuffled
              DataLoader with W workers, decode + RandomResizedCrop(224) + ToTensor,
              optionally `gpu_ms` of simulated GPU time per batch; per epoch the wall
              time, images/s, and the stall: time the loop waited for its next batch
              (and how much of it was the wait for the first batch)
  raw         every image read in a shuffled order by T threads, no decode; cold, then
              warm (a second pass)
  sequential  each large file read front to back in 1 MiB reads
Each phase's record carries the probe's deltas: origin requests and bytes, the mount
daemon's CPU time, this process's CPU time (DataLoader workers included).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.probe import Probe, delta

READ_SIZE = 1024**2


# --- how the data is reached -----------------------------------------------------------


def _boto3_client(spec: dict[str, Any], connections: int = 10) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=spec["endpoint"], region_name=spec["region"],
                        config=Config(s3={"addressing_style": "path"},
                                      max_pool_connections=connections))


def _s3torch_client(spec: dict[str, Any]) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(spec["region"], endpoint=spec["endpoint"],
                    s3client_config=S3ClientConfig(force_path_style=True))


def _train_transform() -> Any:
    from torchvision import transforms

    return transforms.Compose([transforms.RandomResizedCrop(224),
                               transforms.RandomHorizontalFlip(), transforms.ToTensor()])


def _decode(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class Boto3ImageFolder:
    """The naive baseline: ImageFolder's samples, each fetched by its own GET. One boto3
    client per DataLoader worker (made lazily: clients do not survive fork)."""

    def __init__(self, spec: dict[str, Any], transform: Any) -> None:
        self.spec = spec
        self.transform = transform
        self.classes = spec["classes"]
        class_index = {name: i for i, name in enumerate(self.classes)}
        client = _boto3_client(spec)
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=spec["bucket"], Prefix=spec["prefix"]):
            keys += [item["Key"] for item in page.get("Contents", [])]
        self.samples = [(key, class_index[key.split("/")[-2]]) for key in sorted(keys)
                        if key.endswith(".jpg")]
        self._client: Any = None
        self._pid = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self._client is None or self._pid != os.getpid():
            self._client, self._pid = _boto3_client(self.spec), os.getpid()
        key, label = self.samples[index]
        body = self._client.get_object(Bucket=self.spec["bucket"], Key=key)["Body"].read()
        return self.transform(_decode(body)), label


class S3ReaderToSample:
    """s3torchconnector's transform: an S3Reader in, (tensor, label) out."""

    def __init__(self, classes: list[str], transform: Any) -> None:
        self.class_index = {name: i for i, name in enumerate(classes)}
        self.transform = transform

    def __call__(self, reader: Any) -> tuple[Any, int]:
        label = self.class_index[reader.key.split("/")[-2]]
        return self.transform(_decode(reader.read())), label


def _training_dataset(spec: dict[str, Any]) -> Any:
    transform = _train_transform()
    if spec["access"] in ("local", "mount"):
        from torchvision import datasets

        return datasets.ImageFolder(spec["root"], transform=transform)
    if spec["access"] == "boto3":
        return Boto3ImageFolder(spec, transform)
    if spec["access"] == "s3torch":
        from s3torchconnector import S3ClientConfig, S3MapDataset

        return S3MapDataset.from_prefix(
            f"s3://{spec['bucket']}/{spec['prefix']}", region=spec["region"],
            endpoint=spec["endpoint"], transform=S3ReaderToSample(spec["classes"], transform),
            s3client_config=S3ClientConfig(force_path_style=True))
    raise ValueError(spec["access"])


def _reader(spec: dict[str, Any], threads: int) -> Callable[[str], int]:
    """A function that reads one image (by its path relative to the tree) whole and
    returns its length; safe to call from many threads."""
    if spec["access"] in ("local", "mount"):
        root = Path(spec["root"])

        def read_path(name: str) -> int:
            with open(root / name, "rb") as f:
                return len(f.read())
        return read_path
    if spec["access"] == "boto3":
        client = _boto3_client(spec, threads)

        def read_boto3(name: str) -> int:
            obj = client.get_object(Bucket=spec["bucket"], Key=spec["prefix"] + name)
            return len(obj["Body"].read())
        return read_boto3
    if spec["access"] == "s3torch":
        s3client = _s3torch_client(spec)

        def read_s3torch(name: str) -> int:
            return len(s3client.get_object(spec["bucket"], spec["prefix"] + name).read())
        return read_s3torch
    raise ValueError(spec["access"])


# --- the phases ------------------------------------------------------------------------


def _measured(probe: Probe, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    before = probe.snapshot()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, **result, **delta(before, probe.snapshot())}


def phase_train(spec: dict[str, Any], probe: Probe) -> list[dict[str, Any]]:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    started = time.perf_counter()
    dataset = _training_dataset(spec)
    count = len(dataset)
    init_seconds = time.perf_counter() - started
    sampler: Any = RandomSampler(dataset, generator=torch.Generator().manual_seed(spec["seed"]))
    if spec.get("hints"):
        from bucketfs.hints import HintSampler

        sampler = HintSampler(sampler, dataset)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], sampler=sampler,
                        num_workers=spec["workers"])
    gpu_seconds = spec["gpu_ms"] / 1000
    records = []
    for epoch in range(1, spec["epochs"] + 1):
        def one_epoch() -> dict[str, Any]:
            images = 0
            waited = time.perf_counter()
            batches = iter(loader)  # starts the workers: waiting for data too
            stall = time.perf_counter() - waited
            first_batch = None
            try:
                while True:
                    waited = time.perf_counter()
                    try:
                        batch, _labels = next(batches)
                    except StopIteration:
                        break
                    stall += time.perf_counter() - waited
                    if first_batch is None:
                        first_batch = stall  # start-up: workers, first files, decode
                    images += len(batch)
                    if gpu_seconds:
                        time.sleep(gpu_seconds)  # the GPU step: no CPU, no I/O
            finally:
                del batches  # stops the workers now, so their CPU time is counted
            return {"images": images, "stall_s": stall, "first_batch_s": first_batch or 0.0}

        record = _measured(probe, one_epoch)
        record.update(item=f"epoch {epoch}", images_per_s=record["images"] / record["seconds"],
                      stall_fraction=record["stall_s"] / record["seconds"])
        if epoch == 1:
            record.update(dataset_init_s=init_seconds, dataset_len=count)
        records.append(record)
    return records


def phase_raw(spec: dict[str, Any], probe: Probe) -> list[dict[str, Any]]:
    names = list(spec["images"])
    random.Random(spec["seed"]).shuffle(names)
    threads = spec["threads"]
    if spec.get("hints"):
        _send_hint(spec, names)
    read = _reader(spec, threads)
    records = []
    for item in ("cold", "warm"):
        def one_pass() -> dict[str, Any]:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                nbytes = sum(pool.map(read, names))
            return {"files": len(names), "bytes": nbytes}

        record = _measured(probe, one_pass)
        record.update(item=item, MBps=record["bytes"] / record["seconds"] / 1e6,
                      files_per_s=record["files"] / record["seconds"])
        records.append(record)
    return records


def _send_hint(spec: dict[str, Any], names: list[str]) -> None:
    """Tell the daemon the raw pass's order, if bucketfs.hints offers a plain API."""
    try:
        from bucketfs.hints import send_order
    except ImportError:
        return
    send_order([str(Path(spec["root"]) / name) for name in names], epoch=0)


def phase_sequential(spec: dict[str, Any], probe: Probe) -> list[dict[str, Any]]:
    records = []
    for name in spec["large"]:
        def read_one(name: str = name) -> dict[str, Any]:
            return {"bytes": _read_sequentially(spec, name)}

        record = _measured(probe, read_one)
        record.update(item=name, MBps=record["bytes"] / record["seconds"] / 1e6)
        records.append(record)
    return records


def _read_sequentially(spec: dict[str, Any], name: str) -> int:
    total = 0
    if spec["access"] in ("local", "mount"):
        with open(Path(spec["large_root"]) / name, "rb", buffering=0) as f:
            buffer = bytearray(READ_SIZE)
            while count := f.readinto(buffer):
                total += count
        return total
    key = f"{spec['large_prefix']}{name}"
    if spec["access"] == "boto3":
        body = _boto3_client(spec).get_object(Bucket=spec["bucket"], Key=key)["Body"]
        for chunk in body.iter_chunks(READ_SIZE):
            total += len(chunk)
        return total
    reader = _s3torch_client(spec).get_object(spec["bucket"], key)
    while chunk := reader.read(READ_SIZE):
        total += len(chunk)
    return total


def phase_metadata(spec: dict[str, Any], probe: Probe) -> list[dict[str, Any]]:
    """For SDK contenders: a fresh client's first byte, and a listing of the bucket."""
    first_key = spec["prefix"] + spec["images"][0]
    # Imports are not the client's start-up cost (torch alone takes seconds): do them now.
    if spec["access"] == "boto3":
        import boto3  # noqa: F401
    else:
        import s3torchconnector._s3client  # noqa: F401

    def first_byte() -> dict[str, Any]:
        if spec["access"] == "boto3":
            body = _boto3_client(spec).get_object(Bucket=spec["bucket"], Key=first_key)["Body"]
            return {"bytes": len(body.read(1))}
        return {"bytes": len(_s3torch_client(spec).get_object(spec["bucket"], first_key)
                             .read(1))}

    def listing() -> dict[str, Any]:
        if spec["access"] == "boto3":
            keys = 0
            for page in _boto3_client(spec).get_paginator("list_objects_v2").paginate(
                    Bucket=spec["bucket"]):
                keys += len(page.get("Contents", []))
            return {"entries": keys}
        from s3torchconnector import S3ClientConfig, S3MapDataset

        dataset = S3MapDataset.from_prefix(
            f"s3://{spec['bucket']}/", region=spec["region"], endpoint=spec["endpoint"],
            s3client_config=S3ClientConfig(force_path_style=True))
        return {"entries": len(dataset)}

    return [{**_measured(probe, first_byte), "item": "first byte"},
            {**_measured(probe, listing), "item": "list"}]


PHASES = {"metadata": phase_metadata, "train": phase_train, "raw": phase_raw,
          "sequential": phase_sequential}


def main() -> int:
    # More workers than cores is the point here (they wait on I/O); no need to be told.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    control = Path(spec["control"]) if spec.get("control") else None
    probe = Probe(control, spec.get("daemon_pid"))
    results: list[dict[str, Any]] = []
    status = 0
    for phase in spec["phases"]:
        try:
            for record in PHASES[phase](spec, probe):
                results.append({"workload": phase, "status": "ok", **record})
        except Exception as exc:
            traceback.print_exc()
            lines = [line for line in str(exc).splitlines() if line.strip()]
            results.append({"workload": phase, "status": f"error: {type(exc).__name__}: "
                                                          f"{lines[-1] if lines else ''}"[:300]})
            status = 1
        # Written after every phase: a crash later keeps what was measured.
        out.write_text(json.dumps(results))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
