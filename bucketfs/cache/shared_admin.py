"""`bucketfs cache shared-list` and `bucketfs cache shared-clear`: what a shared tier
holds, dataset by dataset, and deleting one dataset's blocks.

The store's lifecycle rule is what keeps a shared tier's size in check (README, "A
cache shared by every node"); these commands are for looking, and for dropping a
dataset at once (a retired dataset, or a tier that should start over). A dataset is
named by its mount URL, as `dataset.json` in its folder records it, or by the folder's
id (for a folder whose descriptor is gone). Clearing while mounts use the dataset is
safe: a block deleted under a reader is a miss, fetched from the origin again.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.urls import BadUrl, parse_bucket_url
from bucketfs.cache.shared_names import BLOCKS, DESCRIPTOR, SharedNames
from bucketfs.cache.shared_store import SharedError, SharedStore
from bucketfs.status_view import size


@dataclass(slots=True)
class SharedDataset:
    id: str
    #: The mount URL from its descriptor; None if the descriptor is missing or unreadable.
    url: str | None
    source: str | None
    block_size: int | None
    blocks: int
    bytes: int


def _descriptor(store: Any, name: str) -> dict[str, Any]:
    found = store.get(name)
    if found is None:
        return {}
    try:
        value = json.loads(bytes(found.data))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def list_datasets(store: Any) -> list[SharedDataset]:
    """Every dataset folder under the store's prefix, with its blocks and bytes."""
    names = SharedNames(store.prefix)
    out = []
    for folder in store.folders(names.root):
        described = _descriptor(store, folder + DESCRIPTOR)
        sizes = [length for _, length in store.objects(folder + BLOCKS)]
        if not described and not sizes:
            continue  # emptied (stores with directories, such as SeaweedFS, keep them)
        url, source, block_size = (described.get(k) for k in ("url", "source", "block_size"))
        out.append(SharedDataset(
            id=folder.rstrip("/").rsplit("/", 1)[-1],
            url=url if isinstance(url, str) else None,
            source=source if isinstance(source, str) else None,
            block_size=block_size if isinstance(block_size, int) else None,
            blocks=len(sizes), bytes=sum(sizes)))
    return out


def _matches(dataset: SharedDataset, wanted: str) -> bool:
    if wanted == dataset.id:
        return True
    if dataset.url is None:
        return False
    try:
        return str(parse_bucket_url(wanted)) == dataset.url
    except BadUrl:
        return False


def clear_dataset(store: Any, wanted: str) -> list[SharedDataset]:
    """Delete every block (and the descriptor) of the datasets `wanted` names: a mount
    URL (every block size and origin endpoint it was mounted with) or a folder id."""
    names = SharedNames(store.prefix)
    cleared = [d for d in list_datasets(store) if _matches(d, wanted)]
    for dataset in cleared:
        folder = names.folder_of(dataset.id)
        store.delete([name for name, _ in store.objects(folder + BLOCKS)])
        store.delete([folder + DESCRIPTOR])
    return cleared


def format_datasets(datasets: list[SharedDataset]) -> str:
    if not datasets:
        return "no datasets in this shared tier"
    lines = []
    for d in datasets:
        what = d.url or "(no dataset.json: unknown dataset)"
        block = f", {size(d.block_size)} blocks" if d.block_size else ""
        lines.append(f"{d.id}  {what}{block}: {d.blocks} blocks, {size(d.bytes)}")
        if d.source:
            lines.append(f"{'':32}  origin {d.source}")
    total = sum(d.bytes for d in datasets)
    lines.append(f"{len(datasets)} dataset(s), {size(total)} in all")
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    listing = commands.add_parser(
        "shared-list", help="list the datasets a shared tier holds",
        description="List the datasets in the shared tier SHARED_URL (cache.shared): "
                    "their mount URL, origin, block size, blocks and bytes.")
    clear = commands.add_parser(
        "shared-clear", help="delete one dataset's blocks from a shared tier",
        description="Delete the blocks of DATASET (a mount URL such as s3://bucket/train, "
                    "or a dataset id that shared-list shows) from the shared tier "
                    "SHARED_URL. Mounts using it read the origin again.")
    for parser in (listing, clear):
        parser.add_argument("shared", metavar="SHARED_URL")
        parser.add_argument("--endpoint-url", help="the shared tier's S3 endpoint "
                            "(default: AWS_ENDPOINT_URL, else AWS)")
        parser.add_argument("--region", help="region (default: the AWS SDK's chain)")
        parser.add_argument("--profile", help="AWS profile (default: AWS_PROFILE)")
        parser.add_argument("--addressing-style", choices=("auto", "path", "virtual"),
                            default="auto")
        parser.add_argument("--timeout", type=float, default=30.0,
                            help="seconds per request (default 30)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    clear.add_argument("dataset", metavar="DATASET")


def run_command(args: argparse.Namespace) -> int:
    try:
        store = SharedStore(args.shared, BackendSettings(
            endpoint_url=args.endpoint_url, region=args.region, profile=args.profile,
            addressing_style=args.addressing_style), timeout=args.timeout)
        if args.cache_command == "shared-list":
            datasets = list_datasets(store)
            print(json.dumps([asdict(d) for d in datasets], indent=2) if args.json
                  else format_datasets(datasets))
            return 0
        cleared = clear_dataset(store, args.dataset)
    except (SharedError, BadUrl) as exc:
        print(f"bucketfs: error: {exc}", file=sys.stderr)
        return 1
    if not cleared:
        print(f"bucketfs: error: no dataset {args.dataset!r} in {store.url} (see "
              "`bucketfs cache shared-list`)", file=sys.stderr)
        return 1
    for dataset in cleared:
        print(f"cleared {dataset.url or dataset.id} ({dataset.id}): {dataset.blocks} "
              f"blocks, {size(dataset.bytes)}")
    return 0
