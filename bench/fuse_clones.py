"""What more than one serving process on one FUSE connection could give bucketfs:

    python -m bench.fuse_clones [--files 2000] [--file-kb 100] [--readers 16]
                                [--procs 1,2] [--sources cold,...] [--out DIR]

One event loop serves all of a bucketfs mount's requests under one GIL: at ~0.43 ms of
it per cold file (docs/BENCHMARKS.md), one daemon serves at most ~2,300 cold files/s
however many cores a node has. The kernel can hand one connection's requests to several
processes, each reading its own clone of the connection's /dev/fuse descriptor; this
measures, before bucketfs is built that way, what that gives and what a request costs
when it is answered without pyfuse3, trio and bucketfs's layers:
  - the GET client alone in this process (boto3, obstore, s3torchconnector: the
    reference the issue names), READERS threads;
  - bucketfs (RAM only): a cold pass, then a warm one from its RAM tier (page cache and
    names dropped), the daemon's CPU per file; and a cold pass with `--cache-dir`;
  - a minimal server of the benchmark's own (`bench/harness/raw_fuse.py`) with PROCS
    processes each serving the same connection, for every count in --procs: a cold
    pass (a GET per READ, no cache); a pass from memory (names dropped); and a cache
    split between the processes (`bench/harness/raw_shards.py`: each file kept by the
    process that owns it, the others asking it over a Unix socket), cold and then
    warm; and the pass from memory again through pyfuse3 in each process
    (`bench/harness/pyfuse3_clone.py`: whether bucketfs's own stack can serve a clone,
    and what libfuse's and pyfuse3's dispatch cost);
  - one pyfuse3 process dispatching every READ to the one of PROCS repliers that owns
    the file, which replies itself on the shared descriptor (no clones, nothing handed
    between processes; `bench/harness/dispatch_fuse.py`): cold, each file kept by its
    replier, then warm; and from memory; and bucketfs's own dispatcher and data
    processes (`bucketfs/dispatch.py`, `bucketfs/data_process.py`), cold and warm, and
    cold with an SSD tier each; each with the dispatcher's own CPU per file, the serial
    part;
their CPU per file (all of the server's processes) and files/s, how the kernel spread
the requests over the processes, and which requests it sent per file
(harness/fuse_census.py, where perf can count them). `--sources` runs only some of the
minimal servers.
The readers are READERS threads doing open/read/close in a shuffled order, as in
`bench.dataplane`; every file's length is checked, and a sample's bytes. Loopback
SeaweedFS, unshaped. Needs root (mount(2), drop_caches). Results: JSON and a markdown
table under --out (bench/results).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.dataplane import (
    BUCKET,
    GiB,
    Mount,
    clients,
    drop_page_cache,
    make_dataset,
    parallel,
    read_with_open,
)
from bench.harness import raw_fuse
from bench.harness.fuse_census import Census
from bench.harness.procstats import (
    cpu_seconds,
    descendants,
    own_cpu_seconds,
    self_cpu,
    thread_switches,
)
from bench.harness.saving import save_results
from tests.servers import S3Server

PREFIX = "train"
STARTUP_S = 60.0  # a server's start, at most
#: Each source's passes, in order (None: a pass whose figures are not reported: it
#: faults in the mappings that the next pass reads, as a warm tier has them).
SOURCE_PASSES: dict[str, tuple[str | None, ...]] = {
    "cold": ("cold, no cache",),
    "memory": (None, "from memory"),
    "owned": ("cold, each file kept by its owner", "warm, from its owner"),
    "pyfuse3": (None, "from memory, through pyfuse3"),
    "dispatch": ("cold, kept by its replier", "warm, from its replier"),
    "dispatch-memory": (None, "from memory, dispatched"),
    "dispatch-bucketfs": ("cold, bucketfs's data path", "warm, bucketfs's RAM tier"),
    "dispatch-bucketfs-ssd": ("cold, bucketfs's data path, SSD tier on",),
}


def server_name(source: str, procs: int, threads: int) -> str:
    """A row's server: pyfuse3 (its own trio tasks) or raw_fuse (`threads` threads)."""
    processes = f"{procs} process{'es' * (procs > 1)}"
    if source.startswith("dispatch-bucketfs"):
        return f"pyfuse3 dispatching to {procs} bucketfs data process{'es' * (procs > 1)}"
    if source.startswith("dispatch"):
        return f"pyfuse3 dispatching to {procs} replier{'s' * (procs > 1)} x {threads} threads"
    return (f"pyfuse3, {processes}" if source == "pyfuse3"
            else f"raw, {processes} x {threads} threads")


def write_table(server: S3Server, keys: list[str], directory: Path,
                ) -> tuple[Path, dict[str, bytes]]:
    """The tree under PREFIX as raw_fuse's table, and the bodies back to back in a file
    in /dev/shm (memory the server processes map). Returns the table and the bodies."""
    client = server.client()
    bodies, etags = {}, {}
    for key in keys:
        response = client.get_object(Bucket=BUCKET, Key=key)
        bodies[key], etags[key] = response["Body"].read(), response["ETag"].strip('"')
    rows: list[list[Any]] = []
    inode_of = {"": raw_fuse.ROOT}
    for key in keys:
        rel = key.removeprefix(f"{PREFIX}/")
        parent = ""
        for part in rel.split("/")[:-1]:
            path = f"{parent}/{part}" if parent else part
            if path not in inode_of:
                rows.append([inode_of[parent], part, -1, ""])
                inode_of[path] = raw_fuse.ROOT + len(rows)
            parent = path
        rows.append([inode_of[parent], rel.rsplit("/", 1)[-1], len(bodies[key]), key])
        inode_of[rel] = raw_fuse.ROOT + len(rows)
    # raw_fuse.MemoryBodies lays the files out by inode.
    data = Path(tempfile.mkstemp(prefix="raw-fuse-bodies-", dir="/dev/shm")[1])
    with open(data, "wb") as f:
        for key in sorted(keys, key=lambda k: inode_of[k.removeprefix(f"{PREFIX}/")]):
            f.write(bodies[key])
    table = directory / "table.json"
    table.write_text(json.dumps({
        "rows": rows, "bodies": str(data),
        # bucketfs's data processes pin each read to its object's version.
        "etags": {inode_of[k.removeprefix(f"{PREFIX}/")]: etags[k] for k in keys},
        "origin": {"endpoint": server.endpoint, "bucket": BUCKET, "region": server.region,
                   "access_key": server.access_key, "secret_key": server.secret_key}}))
    return table, bodies


class RawMount:
    """`procs` raw_fuse processes serving one connection mounted at `mountpoint` (each
    its own clone), or for a "dispatch" source a pyfuse3 dispatcher and `procs`
    repliers sharing the mount's descriptor (dispatch_fuse.py)."""

    def __init__(self, mountpoint: Path, table: Path, source: str, procs: int,
                 threads: int) -> None:
        self.sockets = mountpoint.with_name(f"{mountpoint.name}-sockets")
        self.mountpoint, self.table, self.source = mountpoint, table, source
        self.procs, self.threads = procs, threads
        self.servers: list[subprocess.Popen[bytes]] = []
        # The dispatcher first; bucketfs's dispatcher starts its data processes itself.
        count = (1 if source.startswith("dispatch-bucketfs")
                 else procs + source.startswith("dispatch"))
        self.stats = [mountpoint.with_name(f"{mountpoint.name}-{i}.json") for i in range(count)]

    def __enter__(self) -> RawMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(mode=0o700, exist_ok=True)
        for stats in self.stats:  # a mount here before: its servers' word is not theirs
            stats.with_name(stats.name + ".ready").unlink(missing_ok=True)
        fd = os.open("/dev/fuse", os.O_RDWR)
        held = [fd]  # closed here once the servers have them
        try:
            raw_fuse.mount(fd, self.mountpoint)
            for server, fds in self._servers(fd, held):
                self.servers.append(subprocess.Popen(
                    [sys.executable, "-m", *server, "--fd", str(fd),
                     "--table", str(self.table)], pass_fds=(fd, *fds)))
        except BaseException:
            self.__exit__()
            raise
        finally:
            for descriptor in held:  # the servers hold the connection now
                os.close(descriptor)
        try:
            # Answered once a server has taken INIT. Were every server gone, the
            # connection would have ended with its last descriptor: ENOTCONN.
            os.stat(self.mountpoint)
            self._wait_until_started()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_until_started(self) -> None:
        """Until every server has said it started (raw_fuse.ready), so that no pass is
        charged a process's imports and set-up (bucketfs's data path: ~0.5 s of CPU)."""
        deadline = time.monotonic() + STARTUP_S
        for stats, server in zip(self.stats, self.servers, strict=True):
            while not stats.with_name(stats.name + ".ready").exists():
                if server.poll() is not None:
                    raise RuntimeError(f"{server.args[2]} exited with {server.returncode} "
                                       "as it started")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server.args[2]} did not start in {STARTUP_S} s")
                time.sleep(0.01)

    def _servers(self, fd: int, held: list[int]) -> list[tuple[list[str], tuple[int, ...]]]:
        """Each server's module and arguments, and the descriptors it inherits beyond
        the connection's; those made here are added to `held`."""
        stats = [["--stats", str(path)] for path in self.stats]
        init = self.sockets / "init"
        if self.source == "pyfuse3" or self.source.startswith("dispatch"):
            init.write_bytes(raw_fuse.answer_init(fd))  # each takes the INIT answered here
        if self.source == "pyfuse3":
            return [(["bench.harness.pyfuse3_clone", "--init", str(init), *s], ())
                    for s in stats]
        if self.source.startswith("dispatch-bucketfs"):
            ssd = (["--cache-dir", str(self.sockets / "cache")]
                   if self.source.endswith("-ssd") else [])
            return [(["bench.harness.dispatch_fuse", "dispatcher", "--init", str(init),
                      "--data-processes", str(self.procs), *ssd, *stats[0]], ())]
        if self.source.startswith("dispatch"):
            pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                     for _ in range(self.procs)]
            ends = [(a.detach(), b.detach()) for a, b in pairs]
            held += [end for pair in ends for end in pair]
            dispatcher = (["bench.harness.dispatch_fuse", "dispatcher", "--init", str(init),
                           "--jobs", ",".join(str(a) for a, _ in ends), *stats[0]],
                          tuple(a for a, _ in ends))
            return [dispatcher, *[(self._replier(index, b) + s, (b,)) for index, ((_, b), s)
                                  in enumerate(zip(ends, stats[1:], strict=True))]]
        return [(["bench.harness.raw_fuse", "--source", self.source, "--threads",
                  str(self.threads), "--index", str(index), "--procs", str(self.procs),
                  "--sockets", str(self.sockets), *s], ())
                for index, s in enumerate(stats)]

    def _replier(self, index: int, jobs: int) -> list[str]:
        """A dispatch source's replier `index`: dispatch_fuse's threads."""
        return ["bench.harness.dispatch_fuse", "replier", "--jobs", str(jobs), "--source",
                "memory" if self.source == "dispatch-memory" else "kept",
                "--threads", str(self.threads)]

    @property
    def pids(self) -> list[int]:
        """The servers' processes (each counted with those it started: bucketfs's
        dispatcher with its data processes)."""
        return [server.pid for server in self.servers]

    def __exit__(self, *exc: object) -> None:
        try:
            raw_fuse.unmount(self.mountpoint)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: never mounted
                raise
        for server in self.servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

    def spread(self) -> list[dict[str, int]]:
        """The requests each process answered, by kind (after exit)."""
        return [json.loads(stats.read_text()) if stats.exists() else {} for stats in self.stats]


def server_use(pids: list[int]) -> tuple[float, int]:
    """CPU seconds and voluntary context switches of the server's processes."""
    return (sum(cpu_seconds(pid) for pid in pids),
            sum(n for pid in pids for member in descendants(pid)
                for _, n in thread_switches(member).values()))


def timed_pass(mountpoint: Path, rels: list[str], readers: int, pids: list[int],
               bodies: dict[str, bytes], lead: int | None = None) -> dict[str, Any]:
    """One shuffled read of every file: the server's CPU and context switches and the
    readers' CPU (this process: the FUSE requests' kernel work is charged here), per
    file; and the CPU of process `lead` alone (a dispatcher: the serial part)."""
    drop_page_cache()
    order = rels[:]
    random.Random(len(order)).shuffle(order)
    with Census(mountpoint) as census:
        before, reader_before = server_use(pids), self_cpu()
        lead_before = own_cpu_seconds(lead) if lead else 0.0
        total, wall = parallel(order, readers, lambda rel: read_with_open(mountpoint / rel))
        # The readers' clock first: server_use's walk of /proc is not theirs.
        reader_used = self_cpu() - reader_before
        after = server_use(pids)
        lead_used = own_cpu_seconds(lead) - lead_before if lead else None
    expected = sum(len(bodies[f"{PREFIX}/{rel}"]) for rel in rels)
    if total != expected:
        raise RuntimeError(f"read {total} bytes of {expected}")
    for rel in order[:: max(1, len(order) // 50)]:
        if (mountpoint / rel).read_bytes() != bodies[f"{PREFIX}/{rel}"]:
            raise RuntimeError(f"{rel}: wrong bytes")
    used = after[0] - before[0]
    return {"files": len(rels), "wall_s": wall, "files_per_s": len(rels) / wall,
            "cpu_ms_per_file": 1000 * used / len(rels), "cpu_s_per_gib": used / (total / GiB),
            "switches_per_file": (after[1] - before[1]) / len(rels),
            "reader_cpu_ms_per_file": 1000 * reader_used / len(rels),
            "lead_cpu_ms_per_file": None if lead_used is None else 1000 * lead_used / len(rels),
            "requests_per_file": census.per_file(len(rels))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "files": args.files, "file_kb": args.file_kb, "readers": args.readers}
    with tempfile.TemporaryDirectory() as tmp, S3Server() as server:
        keys, _ = make_dataset(server, args.files, args.file_kb, 0)
        rels = [key.removeprefix(f"{PREFIX}/") for key in keys]
        table, bodies = write_table(server, keys, Path(tmp))
        try:
            results["clients"] = clients(server, keys, args.readers)
            rows = []
            with Mount(server, Path(tmp) / "bucketfs", []) as mount:
                mount.list_tree(rels)
                for name in ("cold", "warm, RAM tier"):
                    rows.append({"server": "bucketfs (RAM only)", "pass": name, **timed_pass(
                        mount.mountpoint, rels, args.readers, [mount.pid], bodies)})
            with Mount(server, Path(tmp) / "bucketfs-ssd",
                       ["--cache-dir", str(Path(tmp) / "bucketfs-cache")]) as mount:
                mount.list_tree(rels)
                rows.append({"server": "bucketfs (--cache-dir)", "pass": "cold", **timed_pass(
                    mount.mountpoint, rels, args.readers, [mount.pid], bodies)})
            for procs in args.procs:
                threads = -(-args.readers // procs) + 1
                for source in args.sources:
                    server = server_name(source, procs, threads)
                    where = Path(tmp) / f"raw-{source}-{procs}"
                    with RawMount(where, table, source, procs, threads) as raw:
                        passes = []
                        for name in SOURCE_PASSES[source]:
                            passes.append((name, timed_pass(
                                where, rels, args.readers, raw.pids, bodies,
                                raw.pids[0] if source.startswith("dispatch") else None)))
                    spread = [sum(s.values()) for s in raw.spread()]
                    for name, row in passes:
                        if name is None:  # a pass that only fills what the next reads
                            continue
                        rows.append({"server": server, "pass": name, **row,
                                     "requests_by_process": spread})
                        print(f"{server}, {name}: {row['files_per_s']:.0f} files/s, "
                              f"{row['cpu_ms_per_file']:.3f} ms/file", flush=True)
            results["rows"] = rows
        finally:
            Path(json.loads(table.read_text())["bodies"]).unlink(missing_ok=True)
    return results


def ceiling(ms_per_file: float) -> str:
    """Files/s that a serial part of `ms_per_file` allows ("—" below the clock's tick)."""
    return f"{1000 / ms_per_file:,.0f}" if ms_per_file > 0 else "—"


def report(results: dict[str, Any]) -> str:
    lines = [f"{results['files']} files of ~{results['file_kb']} KB, {results['readers']} "
             f"readers, {results['machine']['cpus']} CPUs, Python "
             f"{results['machine']['python']}", "",
             "| reader | files/s | CPU ms per file |", "| --- | --- | --- |"]
    lines += [f"| {c['client']} (in the reader) | {c['files_per_s']:,.0f} | "
              f"{c['cpu_ms_per_file']:.3f} |" for c in results["clients"]]
    lines += ["", "| server | pass | files/s | CPU ms per file: server / readers | "
              "server's context switches per file | requests per file | requests each "
              "process answered (the mount's life) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lead = []
    for row in results["rows"]:
        if row.get("lead_cpu_ms_per_file") is not None:
            lead.append(f"| {row['server']} | {row['pass']} | {row['files_per_s']:,.0f} | "
                        f"{row['lead_cpu_ms_per_file']:.3f} | {row['cpu_ms_per_file']:.3f} | "
                        f"{ceiling(row['lead_cpu_ms_per_file'])} |")
        asked = ", ".join(f"{n:.2f} {kind}" for kind, n in
                          sorted((row["requests_per_file"] or {}).items()) if n >= 0.01)
        spread = " / ".join(f"{n:,}" for n in row.get("requests_by_process", [])) or "—"
        lines.append(f"| {row['server']} | {row['pass']} | {row['files_per_s']:,.0f} | "
                     f"{row['cpu_ms_per_file']:.3f} / {row['reader_cpu_ms_per_file']:.3f} | "
                     f"{row['switches_per_file']:.1f} | {asked or '—'} | {spread} |")
    if lead:
        lines += ["", "The dispatcher's CPU per file is the serial part: one mount's ceiling "
                  "of files/s on enough cores.", "",
                  "| server | pass | files/s | dispatcher's CPU ms per file | all of the "
                  "server's | files/s at the dispatcher's ceiling |",
                  "| --- | --- | --- | --- | --- | --- |", *lead]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--file-kb", type=int, default=100)
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--procs", type=lambda s: [int(p) for p in s.split(",")],
                        default=[1, 2])
    parser.add_argument("--sources", type=lambda s: s.split(","), default=list(SOURCE_PASSES),
                        help=f"the minimal servers' (default all: {','.join(SOURCE_PASSES)})")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if unknown := set(args.sources) - set(SOURCE_PASSES):
        parser.error(f"unknown sources: {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        print("bench.fuse_clones needs root (mount(2), drop_caches)", file=sys.stderr)
        return 2
    results = run(args)
    text = report(results)
    print(text)
    save_results(args.out, "fuse_clones", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
