"""raw_fuse's `owned` source: a cache split between the processes that serve one FUSE
connection, each file owned by one of them.

The kernel hands any request to any process, so a cache kept per process would miss
wherever another process fetched the file. Here the owner of a file (its inode modulo
the process count) fetches it whole once, by one ranged GET (raw_fuse.CurlBodies), and
keeps it; a process asked to read a file it does not own asks the owner over a Unix
socket (an 8-byte inode; the length and the body back) and replies with what comes. A
cold pass measures a GET and a hand-off per file (but where the reader's request went to
the owner); a second pass, the hand-offs alone. No eviction, no single flight: two
readers of one cold file at once may both fetch it, which costs a GET and nothing else.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.harness.raw_fuse import CurlBodies, Tree

INODE = struct.Struct("<Q")
CONNECT_S = 10.0  # the other processes bind their sockets as they start


class KeptBodies:
    """Each file fetched whole by one GET the first time it is read, then kept. No
    single flight: two threads reading one cold file at once may both fetch it (a GET
    more, nothing else)."""

    def __init__(self, fetch: CurlBodies, tree: Tree) -> None:
        self.fetch, self.tree = fetch, tree
        self.kept: dict[int, bytes] = {}

    def body(self, ino: int) -> bytes:
        body = self.kept.get(ino)
        if body is None:
            body = self.kept[ino] = bytes(self.fetch.read(ino, 0, self.tree.size[ino]))
        return body

    def read(self, ino: int, offset: int, size: int) -> memoryview:
        body = self.body(ino)
        return memoryview(body)[offset:min(offset + size, len(body))]


class OwnedBodies:
    def __init__(self, tree: Tree, fetch: CurlBodies, index: int, procs: int,
                 sockets: Path) -> None:
        self.index, self.procs, self.sockets = index, procs, sockets
        self.own = KeptBodies(fetch, tree)
        self.local = threading.local()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self._path(index)))
        self.listener.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()

    def _path(self, owner: int) -> Path:
        return self.sockets / f"owner-{owner}.sock"

    def read(self, ino: int, offset: int, size: int) -> memoryview:
        owner = ino % self.procs
        body = self.own.body(ino) if owner == self.index else self._ask(owner, ino)
        return memoryview(body)[offset:min(offset + size, len(body))]

    def _accept(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        """One asking thread's requests, one at a time, until it goes."""
        with connection:
            asked = bytearray(INODE.size)
            while _receive(connection, memoryview(asked)):
                body = self.own.body(INODE.unpack(asked)[0])
                connection.sendmsg([INODE.pack(len(body)), body])

    def _ask(self, owner: int, ino: int) -> bytearray:
        connections: dict[int, socket.socket] = self.local.__dict__.setdefault("to", {})
        connection = connections.get(owner)
        if connection is None:
            connection = connections[owner] = self._connect(owner)
        connection.sendall(INODE.pack(ino))
        length = bytearray(INODE.size)
        if not _receive(connection, memoryview(length)):
            raise ConnectionError(f"owner {owner} went away")
        body = bytearray(INODE.unpack(length)[0])
        if not _receive(connection, memoryview(body)):
            raise ConnectionError(f"owner {owner} went away")
        return body

    def _connect(self, owner: int) -> socket.socket:
        deadline = time.monotonic() + CONNECT_S
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(str(self._path(owner)))
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def _receive(connection: socket.socket, into: memoryview) -> bool:
    """Fill `into` from the socket; False if the other side closed first."""
    got = 0
    while got < len(into):
        n = connection.recv_into(into[got:])
        if n == 0:
            return False
        got += n
    return True
