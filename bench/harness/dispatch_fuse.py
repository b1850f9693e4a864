"""One pyfuse3 process dispatching a connection's reads to others that hold the bytes,
for `bench.fuse_clones`: the other shape of more than one serving process.

Serving from clones (raw_fuse.py) makes every process able to answer any request, so
they must share the namespace and hand each other blocks. Here one process, pyfuse3 in
trio as bucketfs's daemon is, reads every request and answers the names itself
(pyfuse3_clone.TreeOperations); a READ it passes to the process that owns the file
(its inode modulo the count), as a 28-byte job over a socket, and returns at once
(`pyfuse3.REPLIED_ELSEWHERE`, a hunk of packaging/pyfuse3/build.py, which also gives
`read` the request's `unique`). The owner, holding the same /dev/fuse descriptor (the
same open file, so the kernel matches its reply to the request), writes the reply
itself. No process hands bytes to another, and the dispatcher's CPU per file is the
serial part: a mount's ceiling of files/s on any number of cores.

    python -m bench.harness.dispatch_fuse dispatcher --fd N --table F --init F
                                          --jobs J1,J2,... --stats F
    python -m bench.harness.dispatch_fuse replier --fd N --table F --jobs J
                                          --source memory|kept --threads T --stats F
    python -m bench.harness.dispatch_fuse dispatcher --fd N --table F --init F
                                          --data-processes P [--cache-dir D] --stats F

A replier's threads each take a job (one datagram of a SOCK_SEQPACKET socket goes to
one of them), read the bytes (`memory`: raw_fuse.MemoryBodies; `kept`: the whole file
by one ranged GET through libcurl the first time, then from what it kept) and write
the reply, the GIL released in the GET and the write. Both exit when the connection
ends; a replier also when the dispatcher's end of its socket closes. Should a replier
die, the reads waiting on it are answered EIO, and so are later reads of its files
(DispatchingOperations says how).

With `--data-processes P` the dispatcher is bucketfs's own (bucketfs/dispatch.py): it
starts P data processes (bucketfs/data_process.py, each with its share of the RAM tier
and, with `--cache-dir`, an SSD tier of its own), hands each READ to the owner of its
object, pinned to the object's ETag, and starts a data process again should it die.
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import socket
import struct
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from bench.harness.pyfuse3_clone import TreeOperations
from bench.harness.raw_fuse import (
    Bodies,
    CurlBodies,
    MemoryBodies,
    Tree,
    answer_failure,
    ready,
)
from bench.harness.raw_shards import KeptBodies
from bucketfs.data_jobs import Job, Setup
from bucketfs.dispatch import DataProcesses
from bucketfs.fuse_replies import fail_all, reply

JOB = struct.Struct("<QQQI")  # unique, inode, offset, size
#: Reads handed to a replier that are answered EIO if it dies: far more than can be in
#: flight (the kernel's background reads plus one per reading thread).
RECENT = 65536


class DispatchingOperations(TreeOperations):
    """TreeOperations whose reads go to their owners: `jobs[inode % len(jobs)]`.

    A read handed to a replier must be answered even if the replier dies, or its reader
    waits forever. Repliers send nothing back (an acknowledgement per read would cost the
    dispatcher a wakeup each); instead the dispatcher remembers the `unique` of the
    last RECENT reads it handed each replier, and when one dies (its socket's end
    closes) answers all of them EIO on the connection. The kernel never reuses a
    `unique` on a connection and refuses a reply to one already answered (ENOENT), so
    only the reads still waiting get the error. Later reads of that replier's files fail
    at once; everything else goes on."""

    read_unique = True  # pyfuse3 passes each READ's unique (hunk 6)

    def __init__(self, tree: Tree, jobs: list[socket.socket], fd: int) -> None:
        super().__init__(tree, bodies=None)  # type: ignore[arg-type]
        self.jobs, self.fd = jobs, fd
        self.recent = [collections.deque[int](maxlen=RECENT) for _ in jobs]
        self.alive = [True] * len(jobs)
        for job in jobs:
            job.setblocking(False)

    async def read(self, fh: int, off: int, size: int, unique: int = 0) -> Any:
        self.counts["READ"] += 1
        owner = fh % len(self.jobs)  # fh: the inode (no OPEN preceded)
        message = JOB.pack(unique, fh, off, size)
        while self.alive[owner]:
            try:
                self.jobs[owner].send(message)
            except BlockingIOError:  # the owner is behind: wait for room
                await trio.lowlevel.wait_writable(self.jobs[owner])
                continue
            except OSError:  # it died (EPIPE) before its end was seen to close
                self._gone(owner)
                break
            self.recent[owner].append(unique)
            return pyfuse3.REPLIED_ELSEWHERE
        raise pyfuse3.FUSEError(errno.EIO)

    async def watch(self, owner: int) -> None:
        """Wait for replier `owner`'s end to close (it sends nothing otherwise)."""
        await trio.lowlevel.wait_readable(self.jobs[owner])
        self._gone(owner)

    def _gone(self, owner: int) -> None:
        if not self.alive[owner]:
            return
        self.alive[owner] = False
        self.counts["REPLIER_LOST"] += 1
        answered = fail_all(self.fd, self.recent[owner])
        print(f"replier {owner} went away: {answered} reads waiting on it answered EIO, "
              "its files' reads fail from now on", file=sys.stderr, flush=True)


class DataDispatchingOperations(TreeOperations):
    """TreeOperations whose reads go to bucketfs's data processes, by object key, each
    pinned to the object's version (the table's ETag)."""

    read_unique = True

    def __init__(self, tree: Tree, versions: dict[int, str], data: DataProcesses) -> None:
        super().__init__(tree, bodies=None)  # type: ignore[arg-type]
        self.versions, self.data = versions, data

    async def read(self, fh: int, off: int, size: int, unique: int = 0) -> Any:
        self.counts["READ"] += 1
        job = Job(unique, self.tree.key[fh], self.versions[fh], self.tree.size[fh], off, size)
        if await self.data.send(job):
            return pyfuse3.REPLIED_ELSEWHERE
        raise pyfuse3.FUSEError(errno.EIO)


def data_setups(table: dict[str, Any], count: int, cache_dir: str | None) -> list[Setup]:
    """Each data process's setup for the table's bucket, as a bucketfs mount of it with
    `count` data processes would make them."""
    origin = table["origin"]
    # The origin's credentials, where a bucketfs mount finds them; the data processes
    # inherit them.
    os.environ.update({"AWS_ACCESS_KEY_ID": origin["access_key"],
                       "AWS_SECRET_ACCESS_KEY": origin["secret_key"],
                       "AWS_EC2_METADATA_DISABLED": "true"})
    options = {"endpoint_url": origin["endpoint"], "region": origin["region"],
               "addressing_style": "path"}
    return [Setup(f"s3://{origin['bucket']}/", options, index, count,
                  None if cache_dir is None else f"{cache_dir}/data-{index}",
                  origin["endpoint"]) for index in range(count)]


def reply_to_jobs(fd: int, job: socket.socket, bodies: Bodies, counts: Counter[str]) -> None:
    """Answer the jobs that come to this thread until the dispatcher goes."""
    while True:
        message = job.recv(JOB.size)
        if not message:  # the dispatcher closed its end
            return
        unique, ino, offset, size = JOB.unpack(message)
        counts["READ"] += 1
        try:
            data = bodies.read(ino, offset, size)
            reply(fd, unique, data)
        except Exception as error:  # a GET that failed (pycurl.error) too: its reader waits
            outcome = answer_failure(fd, unique, error)
            if outcome == "gone":
                return
            counts["EIO"] += outcome == "answered"


def replier(args: argparse.Namespace, table: dict[str, Any], tree: Tree) -> Counter[str]:
    bodies: Bodies = (MemoryBodies(Path(table["bodies"]), tree) if args.source == "memory"
                      else KeptBodies(CurlBodies(table["origin"], tree), tree))
    (job_fd,) = args.jobs
    job = socket.socket(fileno=job_fd)
    counts: list[Counter[str]] = [Counter() for _ in range(args.threads)]
    threads = [threading.Thread(target=reply_to_jobs, args=(args.fd, job, bodies, c),
                                daemon=True) for c in counts]
    ready(args.stats)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts, Counter())


def dispatcher(args: argparse.Namespace, table: dict[str, Any], tree: Tree) -> Counter[str]:
    jobs = [socket.socket(fileno=fd) for fd in args.jobs]
    data, changed, data_counts = None, list[str](), dict[str, int]()
    if args.data_processes:
        data = DataProcesses(data_setups(table, args.data_processes, args.cache_dir),
                             args.fd, on_changed=changed.append)
        operations: TreeOperations = DataDispatchingOperations(
            tree, {int(ino): etag for ino, etag in table["etags"].items()}, data)
    else:
        operations = DispatchingOperations(tree, jobs, args.fd)
    pyfuse3.init(operations, f"/dev/fd/{args.fd}", set())
    pyfuse3.take_init(args.init.read_bytes())

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            if data is not None:
                await nursery.start(data.run)
                await data.wait_ready()
            else:
                for owner in range(len(jobs)):
                    nursery.start_soon(operations.watch, owner)  # type: ignore[attr-defined]
            ready(args.stats)
            await pyfuse3.main(args.tasks, args.tasks)
            if data is not None:
                data_counts.update(data.counts())  # as of the last report: before close
                await data.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        for job in jobs:  # the repliers see their socket end and exit
            job.close()
    if data is not None:  # events, not requests: only those that happened
        operations.counts.update({name: n for name, n in (("CHANGED", len(changed)),
                                                          ("RESTARTS", data.restarts)) if n})
        # The data processes' own counters, beside the requests (spread() sums those).
        args.stats.with_name(args.stats.name + ".data").write_text(json.dumps(data_counts))
    return operations.counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("dispatcher", "replier"))
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--jobs", type=lambda s: [int(fd) for fd in s.split(",")],
                        default=[])
    parser.add_argument("--data-processes", type=int, default=0,
                        help="bucketfs's data processes in place of repliers (dispatcher)")
    parser.add_argument("--cache-dir", help="their SSD tiers' parent (dispatcher)")
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--init", type=Path, help="the INIT answered (dispatcher)")
    parser.add_argument("--tasks", type=int, default=16, help="pyfuse3's (dispatcher)")
    parser.add_argument("--source", choices=("memory", "kept"), default="kept")
    parser.add_argument("--threads", type=int, default=8, help="(replier)")
    args = parser.parse_args(argv)
    table = json.loads(args.table.read_text())
    tree = Tree(table["rows"])
    counts = (dispatcher(args, table, tree) if args.role == "dispatcher"
              else replier(args, table, tree))
    args.stats.write_text(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
