"""Blocking ranged GETs through obstore (the Rust object_store), for the S3 and GCS
backends: a caller outside trio (the conformance tests) and an S3 Express bucket. The
daemon's own GETs go through libcurl on the trio thread (curl_multi.py, curl_gets.py).

Why not the SDKs: a 100 KB GET costs the reading process about 1.2 ms of CPU through
boto3 and 0.2 ms through obstore (bench/dataplane.py, docs/BENCHMARKS.md), and a GiB
read as 8 MiB ranges 0.7 CPU-s against several; its sync calls release the GIL, and the
body comes back as a buffer that slices without copying, which pyfuse3 replies from.
The SDKs keep what they do best: credential chains, listings page by page, HEADs and
their errors. obstore's own retries are off: `retry.py` is the one retry policy.

What obstore does not give: response headers on an error, so a GET's 503 or 429 is
retried with the policy's backoff, not its Retry-After (HEADs and LISTs, through the
SDKs, still read it). Not fork-safe: a store is made in the daemon, after it started.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from bucketfs.backends.base import (
    AccessDenied,
    BackendError,
    TransientError,
    VersionChanged,
)
from bucketfs.backends.common import one_line, pinned_get_status
from bucketfs.backends.settings import BackendSettings

_STATUS = re.compile(r"status code: (\d{3})")
#: How obstore says that a ranged GET was answered with the whole object (HTTP 200).
_WHOLE_OBJECT = "non-partial response when range requested"


def client_options(endpoint: str, settings: BackendSettings) -> dict[str, Any]:
    return {
        "allow_http": endpoint.startswith("http://"),
        "timeout": f"{settings.read_timeout}s",
        "connect_timeout": f"{settings.connect_timeout}s",
    }


#: One attempt per call: retry.py retries.
RETRY_CONFIG = {"max_retries": 0, "retry_timeout": timedelta(seconds=1)}


class RangedGets:
    """`get_range` over an obstore store; `pinned(version)` says how a request names
    the version, `answered(meta)` which version the response is."""

    def __init__(self, store: Any, where: Callable[[str], str],
                 pinned: Callable[[str], dict[str, Any]],
                 answered: Callable[[dict[str, Any]], str | None]) -> None:
        self.store = store
        self.where = where
        self.pinned = pinned
        self.answered = answered

    def get_range(self, key: str, version: str, start: int, length: int) -> Any:
        """Exactly bytes [start, start + length) of that version (an obstore.Bytes: a
        buffer that slices without copying); see `Backend.get_range`."""
        if length == 0:
            return b""
        try:
            result = obstore.get(self.store, key, options={
                "range": (start, start + length), **self.pinned(version)})
            answered = self.answered(result.meta)
            # Before the body: a store that ignored the precondition sent another version.
            if answered is None:
                raise BackendError(f"{self.where(key)}: the response names no version, so "
                                   "it cannot be checked")
            if answered != version:
                raise VersionChanged(f"{self.where(key)}: object changed (asked for version "
                                     f"{version}, the store answered with "
                                     f"{one_line(answered)})")
            data = result.bytes()
        except BaseError as exc:
            self._raise(exc, key)
        except FileNotFoundError as exc:  # obstore's not-found derives from it
            self._raise(exc, key)
        if len(data) != length:
            raise TransientError(f"{self.where(key)}: short read, {len(data)} of {length} "
                                 f"bytes at offset {start}")
        return data

    def _raise(self, exc: Exception, key: str) -> NoReturn:
        kind, reason = classify(exc)
        raise kind(f"{self.where(key)}: {one_line(reason)}") from None


def classify(exc: Exception) -> tuple[type[BackendError], str]:
    """What an obstore error means for a GET of a pinned version."""
    text = str(exc).split("\n", 1)[0]
    if isinstance(exc, PreconditionError):
        return VersionChanged, "object changed (HTTP 412)"
    if isinstance(exc, NotFoundError | FileNotFoundError):
        # Deleted since the version was taken: that version is gone, like a 412.
        return VersionChanged, "object version is gone (HTTP 404)"
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return AccessDenied, f"access denied ({text})"
    if _WHOLE_OBJECT in text:  # retrying gets the same answer (as curl_gets.classify)
        return BackendError, "the store ignored the Range header"
    match = _STATUS.search(text)
    if match is not None:
        return pinned_get_status(int(match.group(1)))
    # No status: the connection failed, timed out, or the body was cut short.
    return TransientError, f"connection failed ({text})"
