"""An in-memory bucket with S3 listing semantics, request counting and fault injection,
for unit tests of the layers above the backend (never as proof that a backend works)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter

from bucketfs.backends.base import (
    ListPage,
    NotFound,
    ObjectInfo,
    TransientError,
    VersionChanged,
)


class MemoryBackend:
    url = "mem://bucket"

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects: dict[str, bytes] = dict(objects or {})
        self.calls: Counter[str] = Counter()
        self.get_ranges: list[tuple[str, int, int]] = []
        #: key -> number of upcoming GETs of it that fail with TransientError (-1: all).
        self.failures: dict[str, int] = {}
        #: key -> the modification time to list it with (else a fixed one).
        self.mtimes: dict[str, int] = {}
        self._lock = threading.Lock()

    def version(self, key: str) -> str:
        return hashlib.md5(self.objects[key]).hexdigest()

    def close(self) -> None:
        pass

    def check_access(self) -> None:
        self.calls["check"] += 1

    def _info(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.objects[key]),
                          self.mtimes.get(key, 1_700_000_000_000_000_000), self.version(key))

    def list_page(self, prefix: str, delimiter: str | None, token: str | None,
                  page_size: int) -> ListPage:
        with self._lock:
            self.calls["list"] += 1
        entries: list[tuple[str, bool]] = []
        seen: set[str] = set()
        for key in sorted(self.objects):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest[: rest.index(delimiter) + 1]
                if common not in seen:
                    seen.add(common)
                    entries.append((common, True))
            else:
                entries.append((key, False))
        entries.sort()
        if token is not None:
            entries = [e for e in entries if e[0] > token]
        page = ListPage()
        for name, is_prefix in entries[:page_size]:
            if is_prefix:
                page.prefixes.append(name)
            else:
                page.objects.append(self._info(name))
        if len(entries) > page_size:
            page.next_token = entries[page_size - 1][0]
        return page

    def head(self, key: str) -> ObjectInfo:
        with self._lock:
            self.calls["head"] += 1
        if key not in self.objects:
            raise NotFound(key)
        return self._info(key)

    def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        with self._lock:
            self.calls["get"] += 1
            self.get_ranges.append((key, start, length))
            remaining = self.failures.get(key, 0)
            if remaining:
                self.failures[key] = remaining - 1 if remaining > 0 else -1
                raise TransientError(f"injected failure for {key}")
        if key not in self.objects or self.version(key) != version:
            raise VersionChanged(key)
        data = self.objects[key][start:start + length]
        assert len(data) == length, "a read past the end is the caller's bug"
        return data
