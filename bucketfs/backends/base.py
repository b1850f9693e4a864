"""The narrow interface every object store sits behind.

A backend is blocking and thread-safe: the mount calls it from a bounded pool of
worker threads (see `bucketfs.backends.store`). The filesystem never sees SDK
types or SDK exceptions; each backend translates them into the errors below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object version as a listing or HEAD reports it."""

    key: str
    size: int
    mtime_ns: int
    # Identifies the bytes: ETag for S3, generation for GCS, mtime/size/inode for
    # file://. A ranged GET names it, so an object that changed is an error, not a mix.
    version: str


@dataclass(slots=True)
class ListPage:
    """One page of a listing. `prefixes` are common prefixes, each ending in the delimiter."""

    objects: list[ObjectInfo] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    next_token: str | None = None


class BackendError(Exception):
    """Base of every error a backend raises. The message is one line, free of credentials."""


class NoSuchBucket(BackendError):
    pass


class AccessDenied(BackendError):
    pass


class NotFound(BackendError):
    """The object (key) does not exist."""


class VersionChanged(BackendError):
    """The object no longer has the version the caller asked for."""


class Unreachable(BackendError):
    """The endpoint could not be reached at all (DNS, refused connection).

    Retryable while mounted; at mount time it is reported as is."""


class TransientError(BackendError):
    """Worth retrying: throttling (503 SlowDown, 429), 5xx, timeouts, dropped connections,
    and short or truncated responses."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        #: Seconds the server asked us to wait (a Retry-After header), if it said.
        self.retry_after = retry_after


RETRYABLE: tuple[type[BackendError], ...] = (TransientError, Unreachable)


class Backend(Protocol):
    """What the mount needs from an object store. All methods block; all are thread-safe.

    A backend may also have `async_get_range`: `get_range`'s contract as a coroutine
    that runs on the trio thread (s3 and gs: libcurl, curl_gets.py), or None.
    `ObjectStore` prefers it to a worker thread. It may also have `locate`: find where
    the bucket is (s3: its region) and point its requests there, once; it never raises,
    and `check_access` does it too."""

    #: The URL the user gave, without credentials, for messages.
    url: str

    def check_access(self) -> None:
        """Prove the bucket exists and can be listed; raise NoSuchBucket, AccessDenied,
        Unreachable or TransientError otherwise."""
        ...

    def list_page(
        self, prefix: str, delimiter: str | None, token: str | None, page_size: int
    ) -> ListPage:
        """One page of keys under `prefix` in lexicographic (UTF-8) order. With a delimiter,
        keys that contain it after the prefix are rolled up into `prefixes`."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """Raise NotFound if the key does not exist."""
        ...

    def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        """Exactly bytes [start, start + length) of that version of the object.

        `start + length` must not pass the object's end. Raises VersionChanged if the
        object no longer has `version`, TransientError if fewer bytes arrived.

        The request names the version (a precondition) and the response's own version is
        compared with it as well, so a store that ignores the precondition cannot hand
        back another version's bytes. A response that names no version at all cannot be
        checked: it is a BackendError (not retried; every answer of such a store would
        be the same), never bytes taken on trust."""
        ...

    def close(self) -> None: ...
