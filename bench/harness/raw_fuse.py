"""A minimal read-only FUSE server of the benchmark's own, for `bench.fuse_clones` only.

Why not pyfuse3: what `bench.fuse_clones` measures is what bucketfs cannot do through
pyfuse3 today, more than one process serving one FUSE connection (each reading its own
clone of the connection's /dev/fuse descriptor: `FUSE_DEV_IOC_CLONE`), and what a
request costs a process that answers it without libfuse's dispatch, pyfuse3's trio
tasks or bucketfs's layers. It serves a fixed tree (a table the driver writes: no
listing, no cache, no state shared between processes), answers what reading a file by
its path needs (INIT, LOOKUP, GETATTR, READ, STATFS; OPEN and everything else with
ENOSYS, so the kernel opens files itself as bucketfs's `kernel_opens` has it), and
takes a READ's bytes from one of three sources:
  - `memory`: a tmpfs file of every body back to back, mapped in each process (the
    floor of a warm read from RAM);
  - `cold`: one ranged GET per READ through libcurl (pycurl, a kept-alive handle per
    thread, SigV4-signed), no cache: the floor of a cold read;
  - `owned`: a cache split between the processes, each file kept by the one that owns
    it and handed to the others over a Unix socket (raw_shards.py).

A server process: `python -m bench.harness.raw_fuse --fd N --table F --source
memory|cold|owned --threads T --stats F [--index I --procs P --sockets DIR]`, with the
mount's descriptor N inherited; every thread blocks in
`readv` on the process's clone (the kernel hands each request to one waiting reader) and
answers on it, the GET with the GIL released. It exits when the connection ends
(unmount: ENODEV), writing the requests it answered, by kind, to --stats.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import pycurl

from bench.harness.raw_shards import OwnedBodies
from bucketfs.fuse_replies import OUT_HEADER, fail

#: _IOR(229, 0, uint32_t): a new descriptor reading the same connection.
FUSE_DEV_IOC_CLONE = 0x8004E500
BUFFER = (1 << 20) + 4096  # the kernel wants room for max_write and the header

LOOKUP, FORGET, GETATTR, READ, STATFS = 1, 2, 3, 15, 17
INIT, INTERRUPT, DESTROY, BATCH_FORGET = 26, 36, 38, 42
NAMES = {1: "LOOKUP", 3: "GETATTR", 14: "OPEN", 15: "READ", 17: "STATFS", 25: "FLUSH",
         26: "INIT", 27: "OPENDIR", 39: "IOCTL", 44: "READDIRPLUS"}
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}

# The kernel's structs (include/uapi/linux/fuse.h); "head": the fields before those
# that this server neither reads nor sends.
IN_HEADER = struct.Struct("<IIQQIIIHH")  # fuse_in_header
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
ENTRY_OUT = struct.Struct("<QQQQII")  # fuse_entry_out's head, its fuse_attr after
ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out's head, its fuse_attr after
READ_IN = struct.Struct("<QQI")  # fuse_read_in's head: fh, offset, size
INIT_IN = struct.Struct("<IIII")  # fuse_init_in's head
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # fuse_init_out: 64 bytes, as from minor 23
VALID_S = 3600

# FUSE_ASYNC_READ | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES: as libfuse asks for bucketfs.
INIT_FLAGS = (1 << 0) | (1 << 18) | (1 << 22)

ROOT = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MNT_DETACH = 1, 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


def mount(fd: int, mountpoint: Path) -> None:
    """Mount the FUSE connection of /dev/fuse descriptor `fd` (needs root)."""
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if _libc.mount(b"rawfuse", bytes(mountpoint), b"fuse.rawfuse",
                   MS_RDONLY | MS_NOSUID | MS_NODEV, options) != 0:
        raise OSError(ctypes.get_errno(), f"mount {mountpoint}")


def unmount(mountpoint: Path) -> None:
    if _libc.umount2(bytes(mountpoint), MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), f"umount {mountpoint}")


def clone(master: int) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("<I", master))
    return fd


def kind(size: int) -> tuple[int, int]:
    """Mode and link count of a table row: a directory where size is -1."""
    return (stat.S_IFDIR | 0o755, 2) if size < 0 else (stat.S_IFREG | 0o444, 1)


def attr(ino: int, size: int) -> bytes:
    mode, links = kind(size)
    size = max(size, 0)
    return ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, links, 0, 0, 0,
                     4096, 0)


class Tree:
    """The table's tree: inode 1 the root, then its rows in order ([parent, name, size,
    key], size -1 for a directory); every reply body made once, up front."""

    def __init__(self, rows: list[list[Any]]) -> None:
        self.children: dict[tuple[int, bytes], int] = {}
        self.entry: dict[int, bytes] = {}
        self.attr_reply: dict[int, bytes] = {ROOT: ATTR_OUT.pack(VALID_S, 0, 0) + attr(ROOT, -1)}
        self.size: dict[int, int] = {}
        self.key: dict[int, str] = {}
        for ino, (parent, name, size, key) in enumerate(rows, start=ROOT + 1):
            self.children[(parent, name.encode())] = ino
            body = attr(ino, size)
            self.entry[ino] = ENTRY_OUT.pack(ino, 0, VALID_S, VALID_S, 0, 0) + body
            self.attr_reply[ino] = ATTR_OUT.pack(VALID_S, 0, 0) + body
            if size >= 0:
                self.size[ino], self.key[ino] = size, key


class MemoryBodies:
    """Every body from one mapped file (the driver wrote them back to back)."""

    def __init__(self, path: Path, tree: Tree) -> None:
        with open(path, "rb") as f:
            self.view = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        self.start: dict[int, int] = {}
        position = 0
        for ino in sorted(tree.size):
            self.start[ino] = position
            position += tree.size[ino]
        self.tree = tree

    def read(self, ino: int, offset: int, size: int) -> memoryview | bytes:
        end = min(offset + size, self.tree.size[ino])
        start = self.start[ino]
        return self.view[start + offset:start + end]


class CurlBodies:
    """One ranged, signed GET per READ; a kept-alive handle per thread."""

    def __init__(self, source: dict[str, str], tree: Tree) -> None:
        self.base = f"{source['endpoint']}/{source['bucket']}/"
        self.source = source
        self.tree = tree
        self.local = threading.local()

    def _handle(self) -> Any:
        curl = getattr(self.local, "curl", None)
        if curl is None:
            curl = self.local.curl = pycurl.Curl()
            curl.setopt(pycurl.NOSIGNAL, 1)
            curl.setopt(pycurl.FAILONERROR, 1)
            curl.setopt(pycurl.AWS_SIGV4, f"aws:amz:{self.source['region']}:s3")
            curl.setopt(pycurl.USERNAME, self.source["access_key"])
            curl.setopt(pycurl.PASSWORD, self.source["secret_key"])
        return curl

    def read(self, ino: int, offset: int, size: int) -> memoryview | bytes:
        end = min(offset + size, self.tree.size[ino])
        if end <= offset:
            return b""
        curl, pieces = self._handle(), []
        curl.setopt(pycurl.URL, self.base + quote(self.tree.key[ino]))
        curl.setopt(pycurl.RANGE, f"{offset}-{end - 1}")
        curl.setopt(pycurl.WRITEFUNCTION, pieces.append)
        curl.perform()  # the GIL released while it runs
        body = b"".join(pieces)
        if len(body) != end - offset:
            raise OSError(errno.EIO, f"{len(body)} bytes for {end - offset}")
        return body


def init_reply(request: bytes | bytearray) -> bytes:
    """The answer to the kernel's INIT: protocol 7.31's, which kernels from 5.9 take."""
    unique = IN_HEADER.unpack_from(request)[2]
    readahead = INIT_IN.unpack_from(request, IN_HEADER.size)[2]
    body = INIT_OUT.pack(7, 31, readahead, INIT_FLAGS, 64, 48, 1 << 17, 1, 256, 0, 0)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body


def answer_failure(fd: int, unique: int, error: BaseException) -> str:
    """Answer request `unique` EIO after `error` (a reader waits for every request's
    answer): "answered"; "gone" when the connection has ended (ENODEV: the server should
    stop); "interrupted" for a request the kernel gave up on (ENOENT: nothing to send).
    An answer that cannot go (interrupted or unmounted meanwhile) is dropped."""
    code = error.errno if isinstance(error, OSError) else None
    if code == errno.ENODEV:
        return "gone"
    if code == errno.ENOENT:
        return "interrupted"
    fail(fd, unique)
    return "answered"


def ready(stats: Path) -> None:
    """Say that this server has started (the driver measures nothing before every
    server has: a process's start-up is not a request's cost)."""
    stats.with_name(stats.name + ".ready").touch()


def answer_init(fd: int) -> bytes:
    """Read the connection's INIT from `fd` and answer it; returns the request under a
    `unique` no request will have, for pyfuse3_clone's processes to take."""
    request = os.read(fd, BUFFER)
    if IN_HEADER.unpack_from(request)[1] != INIT:
        raise RuntimeError("the connection's first request was not INIT")
    os.write(fd, init_reply(request))
    return request[:8] + struct.pack("<Q", 1 << 62) + request[16:]


class Bodies(Protocol):
    def read(self, ino: int, offset: int, size: int) -> memoryview | bytes: ...


def serve(fd: int, tree: Tree, bodies: Bodies, counts: Counter[str]) -> None:
    """Answer requests from `fd` until the connection ends."""
    buffer = bytearray(BUFFER)
    request = memoryview(buffer)
    header, reply = IN_HEADER.unpack_from, OUT_HEADER.pack
    while True:
        try:
            length = os.readv(fd, [buffer])
        except OSError as error:
            if error.errno in (errno.EINTR, errno.ENOENT):  # an interrupted request
                continue
            if error.errno == errno.ENODEV:  # unmounted
                return
            raise
        _, opcode, unique, ino, *_ = header(buffer)
        counts[NAMES.get(opcode, str(opcode))] += 1
        try:
            if opcode == READ:
                _, offset, size = READ_IN.unpack_from(buffer, IN_HEADER.size)
                data = bodies.read(ino, offset, size)
                os.writev(fd, [reply(16 + len(data), 0, unique), data])
            elif opcode == LOOKUP:
                child = tree.children.get((ino, bytes(request[IN_HEADER.size:length - 1])))
                if child is None:
                    os.write(fd, reply(16, -errno.ENOENT, unique))
                else:
                    body = tree.entry[child]
                    os.write(fd, reply(16 + len(body), 0, unique) + body)
            elif opcode == GETATTR:
                body = tree.attr_reply[ino]
                os.write(fd, reply(16 + len(body), 0, unique) + body)
            elif opcode in NO_REPLY:
                pass
            elif opcode == INIT:
                os.write(fd, init_reply(buffer))
            elif opcode == STATFS:
                os.write(fd, reply(16 + 80, 0, unique) + bytes(80))
            elif opcode == DESTROY:
                os.write(fd, reply(16, 0, unique))
                return
            else:
                os.write(fd, reply(16, -errno.ENOSYS, unique))
        except Exception as error:
            if answer_failure(fd, unique, error) == "gone":
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--source", choices=("memory", "cold", "owned"), required=True)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--index", type=int, default=0, help="this process's (owned)")
    parser.add_argument("--procs", type=int, default=1, help="processes serving (owned)")
    parser.add_argument("--sockets", type=Path, help="where owners listen (owned)")
    args = parser.parse_args(argv)
    table = json.loads(args.table.read_text())
    tree = Tree(table["rows"])
    bodies: Bodies
    if args.source == "memory":
        bodies = MemoryBodies(Path(table["bodies"]), tree)
    elif args.source == "cold":
        bodies = CurlBodies(table["origin"], tree)
    else:
        bodies = OwnedBodies(tree, CurlBodies(table["origin"], tree), args.index,
                             args.procs, args.sockets)
    fd = clone(args.fd)
    os.close(args.fd)
    counts: list[Counter[str]] = [Counter() for _ in range(args.threads)]
    threads = [threading.Thread(target=serve, args=(fd, tree, bodies, c), daemon=True)
               for c in counts]
    ready(args.stats)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    args.stats.write_text(json.dumps(sum(counts, Counter())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
