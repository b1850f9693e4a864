"""Hinted eviction on the SSD tier against Belady's MIN, on a real mount:

    python -m bench.ssd_eviction [--files 1000] [--epochs 4] [--file-kb 40]

Makes a file:// bucket of FILES files, mounts it twice (with hints, and without: the
configured policy alone) with an SSD cache of half the dataset and a 1 MiB RAM cache,
and reads EPOCHS epochs, each in a new shuffled order (the same orders for both), one
file at a time; with hints the order is sent first (`send_order`, as HintSampler does).
The page cache is dropped between epochs, so every read reaches the daemon. It counts
the origin's GETs per epoch (the daemon's metrics) and compares the later epochs' hit
ratio (1 - GETs / files) with MIN's on the same trace, for a cache of the SSD's size and
of SSD + RAM. Needs root (FUSE, drop_caches).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from bench.simulate import Result, Trace, simulate_min
from bucketfs.hints import send_order
from tests.mounting import mounted
from tests.servers import free_ports
from tests.test_fuse_hints import metrics

GETS = 'bucketfs_origin_requests_total{kind="get"}'
SSD_HITS = 'bucketfs_cache_hits_total{tier="ssd"}'
RAM_BYTES = 1 << 20


def read_epochs(mnt: Path, names: list[str], orders: list[list[int]], port: int,
                hinted: bool) -> list[int]:
    gets = []
    for epoch, order in enumerate(orders):
        before = metrics(port)[GETS]
        if hinted:
            send_order([str(mnt / names[i]) for i in order], epoch=epoch, job="bench",
                       strict=True)
        for i in order:
            (mnt / names[i]).read_bytes()
        after = metrics(port)
        gets.append(int(after[GETS] - before))
        print(f"  {'hinted' if hinted else 'plain'} epoch {epoch}: {gets[-1]} GETs, "
              f"{after['bucketfs_cache_ssd_chunks']:.0f} chunks "
              f"({after['bucketfs_cache_ssd_packed_bytes'] / 1e6:.1f} MB packed), "
              f"SSD hits {after[SSD_HITS]:.0f}", flush=True)
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return gets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--file-kb", type=int, default=40)
    args = parser.parse_args()
    size = args.file_kb * 1000
    ssd_files = args.files // 2
    ram_files = RAM_BYTES // size
    rng = random.Random(1)
    orders = [rng.sample(range(args.files), args.files) for _ in range(args.epochs)]
    with tempfile.TemporaryDirectory(prefix="bench-ssd-") as tmp:
        base = Path(tmp)
        names = [f"c{i % 10}/{i:06d}.bin" for i in range(args.files)]
        for name in names:
            (base / "bucket" / name).parent.mkdir(parents=True, exist_ok=True)
            (base / "bucket" / name).write_bytes(os.urandom(size))
        gets = {}
        for mode in ("hinted", "plain"):
            port = free_ports(1)[0]
            with mounted(f"file://{base / 'bucket'}", base / f"mnt-{mode}",
                         "--cache-dir", str(base / f"cache-{mode}"),
                         "--disk-cache", str(ssd_files * size),
                         "--ram-cache", str(RAM_BYTES), "--disk-free-floor", "0",
                         "--metrics-port", str(port)) as mnt:
                gets[mode] = read_epochs(mnt, names, orders, port, mode == "hinted")
    later = args.files * (args.epochs - 1)
    trace = Trace("epochs", "shuffled epochs", [i for order in orders for i in order],
                  sizes=[1] * args.files, costs=[0.0] * args.files)

    def min_ratio(capacity: int) -> float:
        # The first epoch has no hits (every file is new), so MIN's hits are all later.
        return simulate_min(trace, capacity, Result("min", 0.0, capacity)).hits / later

    min_ssd, min_both = min_ratio(ssd_files), min_ratio(ssd_files + ram_files)
    print(f"{args.files} files of {args.file_kb} KB, SSD {ssd_files} files, "
          f"RAM {ram_files} files, {args.epochs} shuffled epochs")
    print("GETs per epoch:", ", ".join(f"{m} {g}" for m, g in gets.items()))
    print(f"MIN hit ratio, epochs 2-{args.epochs}: SSD-sized {min_ssd:.3f}, "
          f"SSD+RAM-sized {min_both:.3f}")
    for mode, counts in gets.items():
        ratio = 1 - sum(counts[1:]) / later
        print(f"{mode}: hit ratio {ratio:.3f} = {ratio / min_ssd:.3f} of MIN (SSD-sized), "
              f"{ratio / min_both:.3f} of MIN (SSD+RAM-sized)")


if __name__ == "__main__":
    main()
