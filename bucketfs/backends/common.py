"""What the cloud backends share: HTTP statuses worth retrying and how errors and times
are put into the one-line, credential-free form the mount reports, and what a
Retry-After header asks for."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
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


def retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None when
    absent or unreadable, 0 for a date already past."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; obsolete forms may lack a zone
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
