"""What the cloud backends share: HTTP statuses worth retrying and how errors and times
are put into the one-line, credential-free form the mount reports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def one_line(text: str) -> str:
    return " ".join(text.split())[:400]


def public_endpoint(url: str) -> str:
    """The endpoint for messages, without any user:password@ a user may have put in it."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def mtime_ns(dt: datetime | None) -> int:
    # Integer arithmetic: a float timestamp loses nanoseconds.
    return 0 if dt is None else (dt - _EPOCH) // timedelta(microseconds=1) * 1000
