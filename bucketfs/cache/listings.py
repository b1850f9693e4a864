"""Directory listings kept in the cache index, so a remount neither lists the bucket
again nor waits for it, for as long as `metadata_ttl` trusts them.

A listing is stored whole, under its bucket URL and prefix, with the wall-clock time it
was made. Blocking (RocksDB point reads and writes); called from the trio thread, where
each call is a single small-ish read or write.
"""

from __future__ import annotations

import json
import time

from rocksdict import Rdict

from bucketfs.backends.base import ObjectInfo
from bucketfs.backends.store import DirListing

LISTING = b"L"


class ListingCache:
    def __init__(self, index: Rdict, namespace: str) -> None:
        self.index = index
        self.prefix = LISTING + namespace.encode("utf-8", "surrogateescape") + b"\0"

    def _key(self, directory: str) -> bytes:
        return self.prefix + directory.encode("utf-8", "surrogateescape")

    def get(self, directory: str) -> tuple[DirListing, float] | None:
        """The saved listing of `directory` and its age in seconds, if any."""
        raw = self.index.get(self._key(directory))
        if raw is None:
            return None
        saved = json.loads(raw)
        listing = DirListing(
            objects=[ObjectInfo(directory + name, size, mtime, version)
                     for name, size, mtime, version in saved["objects"]],
            prefixes=[directory + name for name in saved["prefixes"]],
        )
        return listing, max(0.0, time.time() - saved["time"])

    def put(self, directory: str, listing: DirListing) -> None:
        cut = len(directory)
        saved = {
            "time": time.time(),
            "objects": [[o.key[cut:], o.size, o.mtime_ns, o.version] for o in listing.objects],
            "prefixes": [p[cut:] for p in listing.prefixes],
        }
        self.index[self._key(directory)] = json.dumps(saved, separators=(",", ":")).encode()

    def any_object(self) -> str | None:
        """The key of one object some saved listing names (to probe access with a HEAD)."""
        for name, raw in self.index.items(from_key=self.prefix):
            if not name.startswith(self.prefix):
                return None
            objects = json.loads(raw)["objects"]
            if objects:
                directory = name[len(self.prefix):].decode("utf-8", "surrogateescape")
                return directory + objects[0][0]
        return None

    def forget_all(self) -> None:
        """Drop every saved listing of this bucket (mount --refresh)."""
        stale = []
        for name in self.index.keys(from_key=self.prefix):
            if not name.startswith(self.prefix):
                break
            stale.append(name)
        for name in stale:
            self.index.delete(name)
