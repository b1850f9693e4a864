"""Daemon memory at rest with a large cache index:

    python -m bench.index_rss [--entries 1000000]

Writes N block records (the SSD tier's index entries, with eviction state, as a
format-1 cache wrote them) and a listing of N objects into a fresh cache directory's
RocksDB index, then mounts a small file:// bucket on that cache directory twice: the
first mount upgrades the index (it writes every entry's rank keys), the second opens
a cleanly closed cache. After the second mount it lists the big directory once through
the mount and reads the daemon's VmRSS and VmHWM. No block files are written: the
figure is the index's and the daemon's memory, not the data's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch

from bench.harness.tree import this_tree
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.listings import TreeIndex
from bucketfs.cache.schema import (
    ENTRY,
    FORMAT,
    FORMAT_KEY,
    POLICY_KEY,
    BlockRecord,
    DirEntry,
    encode_block,
    entry_name,
    tree_space,
)
from bucketfs.prefetch.eviction import make_policy
from bucketfs.runtime import state_dir


def rss_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bucket = work / "bucket"
        (bucket / "big").mkdir(parents=True)
        (bucket / "small.txt").write_text("x")
        cache = work / "cache"
        (cache / "data").mkdir(parents=True)
        namespace = f"file://{bucket}"
        started = time.perf_counter()
        index = Rdict(str(cache / "index"), Options(raw_mode=True))
        index[FORMAT_KEY] = FORMAT
        # A policy of another name: the open rebuilds every rank key from the records.
        index[POLICY_KEY] = b"rebuild"
        block_size = 4 * 1024**2
        policy = make_policy()
        batch = WriteBatch(raw_mode=True)
        for i in range(args.entries):
            entry = entry_name(namespace, BlockId(f"big/{i:09d}.jpg", f"{i:032x}", 0,
                                                  size=110_000), block_size)
            # Eviction state exactly as the default policy exports it.
            policy.admit(entry, 110_000, 0.01)
            batch.put(ENTRY + entry, encode_block(
                BlockRecord(110_000, i, 0.01, policy.export(entry))))
            policy.remove(entry)
            if len(batch) >= 50_000:
                index.write(batch)
                batch = WriteBatch(raw_mode=True)
        index.write(batch)
        tree = TreeIndex(index, tree_space(namespace, ""))
        tree.store(1, [DirEntry("big", True, "big/"), DirEntry("small.txt", False, "small.txt", 1)],
                   time.time())
        tree.store(2, [DirEntry(f"{i:09d}.jpg", False, f"big/{i:09d}.jpg", 110_000, 1,
                             f"{i:032x}") for i in range(args.entries)], time.time())
        index.close()
        built = time.perf_counter() - started

        mnt = work / "mnt"
        mnt.mkdir()
        mount = [sys.executable, "-m", "bucketfs", "mount", f"file://{bucket}", str(mnt),
                 "--cache-dir", str(cache), "--disk-free-floor", "0"]
        umount = [sys.executable, "-m", "bucketfs", "umount", str(mnt)]
        daemon_env = {**os.environ, **this_tree()}
        started = time.perf_counter()
        subprocess.run(mount, check=True, env=daemon_env)
        upgrade_s = time.perf_counter() - started
        pid = int((state_dir(str(mnt)) / "pid").read_text())
        after_upgrade = rss_kib(pid)
        subprocess.run(umount, check=True)
        started = time.perf_counter()
        subprocess.run(mount, check=True, env=daemon_env)
        mounted_s = time.perf_counter() - started
        pid = int((state_dir(str(mnt)) / "pid").read_text())
        after_mount = rss_kib(pid)
        started = time.perf_counter()
        names = os.listdir(mnt / "big")
        listed_s = time.perf_counter() - started
        time.sleep(1)
        after_listing = rss_kib(pid)
        subprocess.run(umount, check=True)
    result = {
        "command": "python -m bench.index_rss " + " ".join(sys.argv[1:]),
        "entries": args.entries, "names_listed": len(names),
        "index_build_s": round(built, 1),
        "first_mount_upgrading_index_s": round(upgrade_s, 1),
        "peak_rss_mib_upgrading": round(after_upgrade["VmHWM"] / 1024),
        "mount_s": round(mounted_s, 1),
        "list_big_dir_s": round(listed_s, 1),
        "rss_mib_after_mount": round(after_mount["VmRSS"] / 1024),
        "rss_mib_after_listing": round(after_listing["VmRSS"] / 1024),
        "peak_rss_mib": round(after_listing["VmHWM"] / 1024),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
