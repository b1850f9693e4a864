"""Upload the dataset to the origin (run inside the origin namespace by `Origin.upload`).

    python -m bench.harness.upload --endpoint URL --bucket B --train DIR [--large FILE ...]

Waits for the server to accept signed requests, creates the bucket, and uploads DIR's
files as train/<relative path> and each large file as large/<name> (multipart, as a
real upload of a big file would be).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time
from pathlib import Path

import boto3
from botocore.config import Config

READY_TIMEOUT = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--train", required=True, type=Path)
    parser.add_argument("--large", action="append", default=[], type=Path)
    args = parser.parse_args()

    client = boto3.client("s3", endpoint_url=args.endpoint, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"},
                                        max_pool_connections=16,
                                        retries={"total_max_attempts": 5}))
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            client.list_buckets()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    client.create_bucket(Bucket=args.bucket)

    files = sorted(p for p in args.train.rglob("*") if p.is_file())

    def put(path: Path) -> None:
        key = "train/" + path.relative_to(args.train).as_posix()
        client.put_object(Bucket=args.bucket, Key=key, Body=path.read_bytes())

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    for path in args.large:
        client.upload_file(str(path), args.bucket, f"large/{path.name}")
    print(f"uploaded {len(files)} files and {len(args.large)} large files")


if __name__ == "__main__":
    main()
