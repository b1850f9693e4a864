"""What the daemon's GET engine alone costs per GiB of a large object, against obstore's:

    python -m bench.large_gets [--mib 512] [--rounds 4]

On loopback SeaweedFS, one object of MIB MiB is read whole in this process, ROUNDS
times by each of two clients in alternation (the order swapped every round):
  - the daemon's engine: the S3 backend's `async_get_range` (libcurl on the trio
    thread, bucketfs/backends/curl_multi.py), 4 MiB ranges (the default block size), 8
    in flight (the default read-ahead of 32 MiB), each body offered back to the spare
    buffers when done (as the RAM tier does when it lets a block go), so the next GET
    fills memory already faulted in;
  - obstore alone: 8 parallel 8 MiB range GETs from worker threads (bench.dataplane's
    large-object baseline).
For each: this process's CPU-s per GiB (`time.process_time`, every thread; SeaweedFS is
another process) and MB/s; medians over the rounds, each round's figure kept. No FUSE,
no cache: this is the GET side of a cold large read, which `bench.dataplane` sets
against the whole (its "again from the RAM tier" row is the reply side). Prints a
table; JSON under --out.
"""

from __future__ import annotations

import argparse
import os
import time
import unittest.mock
from pathlib import Path
from typing import Any

import trio

from bench.dataplane import BUCKET, obstore_large
from bench.harness.saving import save_results
from bench.harness.stats import medians
from bucketfs.backends import open_backend
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.urls import parse_bucket_url
from bucketfs.spare_buffers import spare_buffers
from tests.servers import S3Server

MiB = 1024 * 1024
GiB = 1024 * MiB
BLOCK = 4 * MiB
IN_FLIGHT = 8
KEY = "large/blob.bin"
ENGINE = "bucketfs GET engine, 8 x 4 MiB ranges"


def upload(server: S3Server, size: int) -> None:
    server.create_bucket(BUCKET)
    client = server.client()
    upload_id = client.create_multipart_upload(Bucket=BUCKET, Key=KEY)["UploadId"]
    parts = []
    for number, start in enumerate(range(0, size, 64 * MiB), start=1):
        answer = client.upload_part(Bucket=BUCKET, Key=KEY, UploadId=upload_id,
                                    PartNumber=number,
                                    Body=os.urandom(min(64 * MiB, size - start)))
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    client.complete_multipart_upload(Bucket=BUCKET, Key=KEY, UploadId=upload_id,
                                     MultipartUpload={"Parts": parts})


def read_with_engine(backend: Any, version: str, size: int) -> int:
    """The object through the backend's engine; the bytes read."""
    starts = iter(range(0, size, BLOCK))
    total = 0

    async def caller() -> None:
        nonlocal total
        for start in starts:
            length = min(BLOCK, size - start)
            body = await backend.async_get_range(KEY, version, start, length)
            if len(body) != length:
                raise RuntimeError(f"short body at {start}: {len(body)} of {length}")
            total += length
            spare_buffers.offer(body)
            del body

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(IN_FLIGHT):
                nursery.start_soon(caller)

    trio.run(main)
    return total


def engine_round(backend: Any, version: str, size: int) -> dict[str, Any]:
    cpu, began = time.process_time(), time.monotonic()
    total = read_with_engine(backend, version, size)
    wall, used = time.monotonic() - began, time.process_time() - cpu
    return {"reader": ENGINE, "bytes": total, "wall_s": wall,
            "mb_per_s": total / wall / 1e6, "cpu_s_per_gib": used / (total / GiB)}


def run(mib: int, rounds: int) -> dict[str, Any]:
    limit = spare_buffers.limit
    spare_buffers.limit = IN_FLIGHT * BLOCK  # as a mount sets it: its read-ahead
    try:
        return measure(mib, rounds)
    finally:  # the process's pool as it was, and none of this run's buffers in it
        spare_buffers.limit = limit
        spare_buffers.let_go_if_idle()
        spare_buffers.let_go_if_idle()


def measure(mib: int, rounds: int) -> dict[str, Any]:
    size = mib * MiB
    with S3Server() as server:
        upload(server, size)
        # The backend's credential chain reads the environment; it is put back after.
        with unittest.mock.patch.dict(os.environ, server.env()):
            backend = open_backend(parse_bucket_url(f"s3://{BUCKET}"),
                                   BackendSettings(addressing_style="path"))
            version = backend.head(KEY).version
            read_with_engine(backend, version, size)  # connections and buffers made
            rows: dict[str, list[dict[str, Any]]] = {}
            for round_ in range(rounds):
                arms = [("engine", lambda: engine_round(backend, version, size)),
                        ("obstore", lambda: obstore_large(server, KEY, size))]
                for _, measure in arms if round_ % 2 == 0 else arms[::-1]:
                    row = measure()
                    if row is None:  # obstore not installed
                        continue
                    rows.setdefault(row["reader"], []).append(row)
                    print(f"round {round_ + 1}, {row['reader']}: {row['mb_per_s']:,.0f} "
                          f"MB/s, {row['cpu_s_per_gib']:.3f} CPU-s per GiB", flush=True)
            backend.close()
    return {"mib": mib, "rounds": rounds, "machine": f"{os.uname().nodename}, "
            f"{os.cpu_count()} cores",
            "readers": {reader: medians(rs, ("mb_per_s", "cpu_s_per_gib"))
                        for reader, rs in rows.items()}}


def table(results: dict[str, Any]) -> str:
    lines = ["| reader | MB/s | CPU-s per GiB (rounds) |", "| --- | ---: | --- |"]
    for reader, row in results["readers"].items():
        rounds = ", ".join(f"{x:.3f}" for x in row["cpu_s_per_gib"]["rounds"])
        lines.append(f"| {reader} | {row['mb_per_s']['median']:,.0f} "
                     f"| {row['cpu_s_per_gib']['median']:.3f} ({rounds}) |")
    return ("\n".join(lines) + f"\n\nMedians of {results['rounds']} interleaved rounds, "
            f"a {results['mib']} MiB object; {results['machine']}.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.large_gets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = run(args.mib, args.rounds)
    text = table(results)
    print(text, end="")
    save_results(args.out, "large-gets", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
