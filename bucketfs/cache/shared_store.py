"""The shared tier's bucket: blocking GETs, PUTs, LISTs and DELETEs through obstore.

Like a backend, it blocks and is thread-safe: the tier (shared.py) calls it from worker
threads. Unlike the origin nothing here retries: a shared block that does not come at
once is fetched from the origin instead, so one attempt, with a short timeout, is the
whole policy. Every error becomes a `SharedError` with one line free of credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import obstore
from obstore.exceptions import BaseError, NotFoundError

from bucketfs.backends.base import BackendError
from bucketfs.backends.common import one_line
from bucketfs.backends.fastget import classify
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.urls import BucketUrl, parse_bucket_url

#: S3's DeleteObjects takes at most this many keys.
_DELETE_BATCH = 1000


class SharedError(Exception):
    """A request to the shared tier failed (one line)."""


@dataclass(frozen=True, slots=True)
class Fetched:
    metadata: dict[str, str]
    data: Any  # an obstore.Bytes: a buffer that slices without copying


class SharedStore:
    """One bucket (and prefix) of an S3-compatible store."""

    def __init__(self, url: str, settings: BackendSettings, *, timeout: float) -> None:
        from bucketfs.backends.s3 import open_object_store  # boto3 loads only if used

        self.url: BucketUrl = parse_bucket_url(url)
        if self.url.scheme != "s3":
            raise SharedError(f"shared tier {self.url}: must be an s3:// bucket")
        settings = replace(settings, read_timeout=timeout,
                           connect_timeout=min(timeout, settings.connect_timeout))
        try:
            self._store, self.endpoint = open_object_store(self.url.bucket, settings)
        except BackendError as exc:
            raise SharedError(f"shared tier {self.url}: {exc}") from None

    @property
    def prefix(self) -> str:
        return self.url.prefix

    def _fail(self, exc: Exception, what: str) -> SharedError:
        _, reason = classify(exc)
        return SharedError(f"shared tier {self.url} via {self.endpoint}: {what}: "
                           f"{one_line(reason)}")

    def get(self, name: str) -> Fetched | None:
        """The object and its user metadata; None if there is none of that name."""
        try:
            result = obstore.get(self._store, name)
            metadata = {k.lower(): v for k, v in result.attributes.items()
                        if isinstance(v, str)}
            return Fetched(metadata, result.bytes())
        except (NotFoundError, FileNotFoundError):
            return None
        except BaseError as exc:
            raise self._fail(exc, "GET") from None

    def put(self, name: str, data: Any, metadata: dict[str, str]) -> None:
        try:
            obstore.put(self._store, name, data, attributes=metadata)
        except (BaseError, FileNotFoundError) as exc:
            raise self._fail(exc, "PUT") from None

    def folders(self, prefix: str) -> list[str]:
        """The common prefixes one level under `prefix` (each ending in "/")."""
        try:
            listed = obstore.list_with_delimiter(self._store, prefix.rstrip("/") or None)
        except (BaseError, FileNotFoundError) as exc:
            raise self._fail(exc, "LIST") from None
        return [p.rstrip("/") + "/" for p in listed["common_prefixes"]]

    def objects(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(name, size) of every object under `prefix`, page by page."""
        try:
            for page in obstore.list(self._store, prefix.rstrip("/")):
                for entry in page:
                    yield entry["path"], entry["size"]
        except (BaseError, FileNotFoundError) as exc:
            raise self._fail(exc, "LIST") from None

    def delete(self, names: list[str]) -> None:
        try:
            for start in range(0, len(names), _DELETE_BATCH):
                obstore.delete(self._store, names[start:start + _DELETE_BATCH])
        except (BaseError, FileNotFoundError) as exc:
            raise self._fail(exc, "DELETE") from None
