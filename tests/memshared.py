"""An in-memory shared tier with the interface of `SharedStore`, request counting and
fault injection, for unit tests of the tier's logic (the FUSE tests use a real bucket)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from bucketfs.backends.urls import parse_bucket_url
from bucketfs.cache.shared_store import Fetched, SharedError


class MemorySharedStore:
    endpoint = "mem://shared"

    def __init__(self, url: str = "s3://shared/") -> None:
        self.url = parse_bucket_url(url)
        self.stored: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.calls: Counter[str] = Counter()
        #: While set, every request fails with this SharedError message.
        self.failing: str | None = None
        #: While set, PUTs wait for it (a slow tier).
        self.put_gate: threading.Event | None = None
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return self.url.prefix

    def _count(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1
        if self.failing is not None:
            raise SharedError(self.failing)

    def get(self, name: str) -> Fetched | None:
        self._count("get")
        found = self.stored.get(name)
        return None if found is None else Fetched(dict(found[1]), found[0])

    def put(self, name: str, data: Any, metadata: dict[str, str]) -> None:
        self._count("put")
        if self.put_gate is not None:
            self.put_gate.wait(10)
        self.stored[name] = (bytes(data), dict(metadata))

    def folders(self, prefix: str) -> list[str]:
        self._count("list")
        return sorted({prefix + name[len(prefix):].split("/", 1)[0] + "/"
                       for name in self.stored
                       if name.startswith(prefix) and "/" in name[len(prefix):]})

    def objects(self, prefix: str) -> list[tuple[str, int]]:
        self._count("list")
        return [(name, len(body)) for name, (body, _) in sorted(self.stored.items())
                if name.startswith(prefix)]

    def delete(self, names: list[str]) -> None:
        self._count("delete")
        for name in names:
            self.stored.pop(name, None)
