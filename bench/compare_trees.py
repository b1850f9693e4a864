"""What a change does to the daemon's CPU per file, against another revision, on a mount:

    python -m bench.compare_trees REV [--rounds 10] [--files 2000] [--readers 16]
                                      [--ram-cache 2GiB] [--file-kb 100] [--out DIR]
    python -m bench.compare_trees REV --large-mib 1024 [--rounds 4]

A shared VM's speed drifts by tens of percent from one minute to the next, more than
most single changes move the daemon's CPU, so the two trees run in alternation (this
checkout, then REV, then REV, then this checkout, ...), ROUNDS rounds each, against one
loopback SeaweedFS. REV is checked out into a temporary git worktree with
`bucketfs/prefetch` and `bucketfs/hints` linked in as the package maps them, so that no
part of REV's daemon is imported from this checkout. Each round and tree mounts afresh
(`--cache-dir`, a RAM tier of RAM_CACHE, 2 GiB by default) and reads FILES objects of
~FILE_KB KB (100 by default; each within 20% of it, as `bench.dataplane` makes them:
`--file-kb 2048` for files of a few MiB, whose bodies take the large-GET path) with READERS
threads (16 by default; fewer readers keep fewer requests waiting,
which is where batching and queueing in the daemon can cost throughput rather than save
CPU). A RAM tier smaller than the files' bytes makes the cold passes evict a block for
nearly every one admitted, as a dataset larger than RAM does (the "warm, RAM tier"
passes then read most files from the SSD tier):
  - cold: every name looked up, every file fetched and written through to SSD;
  - warm, RAM tier: page cache and dentries dropped, so each file is a LOOKUP and a READ
    served from RAM;
  - warm, RAM tier, names listed: the tree listed first (the kernel knows every inode
    from READDIRPLUS), so READs only;
  - warm, page cache: the same again, every byte in the page cache, so each file costs
    the daemon only the IOCTL of Python's `open()` (its `isatty()`);
  - warm, SSD tier (remounted): the same cache directory mounted again, the page cache
    and dentries dropped, so each file is a LOOKUP and a read from the SSD tier, in the
    order the cold pass wrote them (a read that goes on through a chunk brings the
    members after it in the same pread, as a chunk packed in the announced order is
    read);
  - warm, SSD tier, another order: the same once more in another shuffled order, as an
    unhinted next epoch reads: each file its own read from the SSD tier;
  - cold, the order sent first: a second fresh mount, the readers' order sent before
    they read, as HintSampler sends it (prefetch ahead of them), the daemon's CPU taken
    once it is idle;
  - cold, names listed first: a third fresh mount whose tree is listed before the reads,
    as ImageFolder scans its classes: no LOOKUP comes, so each file's first READ finds
    its entry by inode in the index (the first pass's LOOKUPs hand it over instead).
For each: the daemon's CPU per file (/proc/PID/stat, all threads), its event loop's
share (the main thread), the files read per second (wall time: noisy on a small
machine, but what a queue that makes readers wait costs) and its voluntary context
switches per file (all live threads:
the hand-offs a node with many cores pays most for), medians over the rounds, each
round's figure kept.

With --large-mib, the large-object read instead: one object of that size, read cold
with `dd bs=4M` (fresh memory touched first, as bench.dataplane's row) through a 2 GiB
RAM tier and through one a quarter of the object's size (each block evicts one, as a
dataset larger than the RAM budget reads), then from the SSD tier (the first pass's
cache directory mounted again): MB/s and the daemon's CPU-s per GiB.

Needs root (FUSE, drop_caches). Results: JSON and a Markdown table under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.dataplane import Mount, back_memory, drop_page_cache, make_dataset
from bench.harness.saving import save_results
from bench.harness.stats import medians
from bench.harness.tree import ROOT
from tests.servers import S3Server

PASSES = ("cold", "warm, RAM tier", "warm, RAM tier, names listed", "warm, page cache",
          "warm, SSD tier (remounted)", "warm, SSD tier, another order",
          "cold, the order sent first", "cold, names listed first")
READERS = 16
RAM_CACHE = "2GiB"
MEASURES = ("cpu_ms_per_file", "loop_ms_per_file", "files_per_s", "switches_per_file")
LARGE_MEASURES = ("mb_per_s", "cpu_s_per_gib")


def large_passes(large_mib: int) -> tuple[str, ...]:
    return ("cold, RAM tier 2GiB", f"cold, RAM tier {max(64, large_mib // 4)}MiB",
            "from the SSD tier (remounted)")


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """REV checked out in a temporary worktree that imports nothing from this one."""
    with tempfile.TemporaryDirectory(prefix="bucketfs-rev-") as scratch:
        path = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force",
                        str(path), rev], check=True, capture_output=True)
        try:
            for package in ("prefetch", "hints"):  # pyproject maps them under bucketfs
                (path / "bucketfs" / package).symlink_to(f"../{package}")
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(path)], check=False, capture_output=True)


def one_round(server: S3Server, work: Path, tree: Path, relpaths: list[str],
              readers: int = READERS, ram_cache: str = RAM_CACHE,
              ) -> dict[str, dict[str, float]]:
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    args = ["--ram-cache", ram_cache, "--metadata-ttl", "forever", "--cache-dir", str(cache)]
    try:
        with Mount(server, work / "mnt", args, tree=tree) as mount:
            passes = {"cold": mount.read_all(relpaths, readers)}
            drop_page_cache()
            passes["warm, RAM tier"] = mount.read_all(relpaths, readers)
            drop_page_cache()
            mount.list_tree(relpaths)
            passes["warm, RAM tier, names listed"] = mount.read_all(relpaths, readers)
            passes["warm, page cache"] = mount.read_all(relpaths, readers)
        reshuffled = list(relpaths)
        random.Random(6).shuffle(reshuffled)
        for name, order in (("warm, SSD tier (remounted)", relpaths),
                            ("warm, SSD tier, another order", reshuffled)):
            with Mount(server, work / "mnt", args, tree=tree) as mount:  # the same cache
                drop_page_cache()
                passes[name] = mount.read_all(order, readers)
        shutil.rmtree(cache)  # every pass starts cold, on its own
        cache.mkdir()
        with Mount(server, work / "mnt", args, tree=tree) as mount:
            passes["cold, the order sent first"] = mount.read_all(
                relpaths, readers, begin=lambda: mount.send_order(relpaths), idle=True)
        shutil.rmtree(cache)
        cache.mkdir()
        with Mount(server, work / "mnt", args, tree=tree) as mount:
            # As ImageFolder does: the directories listed (READDIRPLUS) before any read,
            # so the kernel sends no LOOKUP and a file's first READ finds it by inode.
            mount.list_tree(relpaths)
            passes["cold, names listed first"] = mount.read_all(relpaths, readers)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {name: {"cpu_ms_per_file": row["cpu_ms_per_file"],
                   "loop_ms_per_file": row["cpu_ms_per_file_by_thread"]["loop"],
                   "files_per_s": row["files_per_s"],
                   "switches_per_file": sum(row["switches_per_file_by_thread"].values())}
            for name, row in passes.items()}


def large_round(server: S3Server, work: Path, tree: Path, key: str, large_mib: int,
                ) -> dict[str, dict[str, float]]:
    cold_2gib, cold_small, from_ssd = large_passes(large_mib)

    def dd(ram: str, cache: Path) -> dict[str, float]:
        args = ["--ram-cache", ram, "--metadata-ttl", "forever", "--cache-dir", str(cache)]
        with Mount(server, work / "large", args, prefix="large", tree=tree) as mount:
            drop_page_cache()
            back_memory(3 * -(-large_mib // 1024) + 1)
            row = mount.dd(key.removeprefix("large/"))
        return {measure: row[measure] for measure in LARGE_MEASURES}

    big, small = (Path(tempfile.mkdtemp(prefix="cache-", dir=work)) for _ in range(2))
    try:
        return {cold_2gib: dd("2GiB", big),
                cold_small: dd(cold_small.rpartition(" ")[2], small),
                from_ssd: dd("2GiB", big)}  # the first pass's cache, mounted again
    finally:
        shutil.rmtree(big, ignore_errors=True)
        shutil.rmtree(small, ignore_errors=True)


def compare(rev: str, rounds: int, files: int, large_mib: int = 0,
            readers: int = READERS, ram_cache: str = RAM_CACHE,
            file_kb: int = 100) -> dict[str, Any]:
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"this tree": [], rev: []}
    passes, measures = (large_passes(large_mib), LARGE_MEASURES) if large_mib \
        else (PASSES, MEASURES)
    with S3Server() as server, tempfile.TemporaryDirectory() as scratch, \
            worktree(rev) as other:
        keys, large = make_dataset(server, 0 if large_mib else files, file_kb, large_mib)
        relpaths = [key.removeprefix("train/") for key in keys]
        random.Random(5).shuffle(relpaths)
        trees = [("this tree", ROOT), (rev, other)]
        for round_ in range(rounds):
            for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
                runs[name].append(
                    large_round(server, Path(scratch), tree, large, large_mib) if large_mib
                    else one_round(server, Path(scratch), tree, relpaths, readers,
                                   ram_cache))
                print(f"round {round_ + 1}, {name}: " + ", ".join(
                    f"{p} {r[measures[-1]]:.3f}" for p, r in runs[name][-1].items()),
                    flush=True)
    summary = {name: {p: medians([r[p] for r in rows], measures) for p in passes}
               for name, rows in runs.items()}
    return {"rev": rev, "rounds": rounds, "files": files, "large_mib": large_mib,
            "readers": readers, "ram_cache": ram_cache, "file_kb": file_kb,
            "trees": summary}


def large_table(results: dict[str, Any]) -> str:
    rev = results["rev"]
    trees = results["trees"]
    lines = [f"| {results['large_mib']} MiB object, dd bs=4M | {rev}: MB/s | this tree: "
             f"MB/s | {rev}: CPU-s per GiB (rounds) | this tree: CPU-s per GiB (rounds) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for p in large_passes(results["large_mib"]):
        cells = [f"{t[p]['mb_per_s']['median']:.0f}" for t in (trees[rev], trees["this tree"])]
        cells += [f"{t[p]['cpu_s_per_gib']['median']:.2f} ("
                  + ", ".join(f"{x:.2f}" for x in t[p]['cpu_s_per_gib']['rounds']) + ")"
                  for t in (trees[rev], trees["this tree"])]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nMedians of {results['rounds']} interleaved rounds.\n"


def table(results: dict[str, Any]) -> str:
    if results.get("large_mib"):
        return large_table(results)
    rev = results["rev"]
    trees = results["trees"]
    lines = [f"| pass | {rev}: ms per file (loop) | this tree: ms per file (loop) "
             f"| {rev}: files/s | this tree: files/s "
             f"| {rev}: context switches per file | this tree: context switches per file |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    both = (trees[rev], trees["this tree"])
    for p in PASSES:
        cells = [f"{t[p]['cpu_ms_per_file']['median']:.3f} "
                 f"({t[p]['loop_ms_per_file']['median']:.3f})" for t in both]
        cells += [f"{t[p]['files_per_s']['median']:,.0f}" for t in both]
        cells += [f"{t[p]['switches_per_file']['median']:.2f}" for t in both]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (f"\n\nMedians of {results['rounds']} interleaved rounds, "
                               f"{results['readers']} readers, a "
                               f"{results['ram_cache']} RAM tier, {results['files']:,} "
                               f"files of ~{results.get('file_kb', 100):,} KB.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_trees",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--readers", type=int, default=READERS,
                        help="threads reading the small files at once")
    parser.add_argument("--ram-cache", default=RAM_CACHE,
                        help="the small-file passes' RAM tier (smaller than the files: "
                             "the cold passes evict)")
    parser.add_argument("--file-kb", type=int, default=100,
                        help="the files' mean size (each within 20%% of it)")
    parser.add_argument("--large-mib", type=int, default=0,
                        help="compare the cold read of one object this large instead")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = compare(args.rev, args.rounds, args.files, args.large_mib, args.readers,
                      args.ram_cache, args.file_kb)
    text = table(results)
    print(text, end="")
    save_results(args.out, "compare-trees", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
