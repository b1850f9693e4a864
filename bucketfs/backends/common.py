"""What the cloud backends share: HTTP statuses worth retrying, what an error status
means for a GET of a pinned version, how errors and times are put into the one-line,
credential-free form the mount reports, and what a Retry-After header asks for."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit, urlunsplit

from bucketfs.backends.base import AccessDenied, BackendError, TransientError, VersionChanged

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


def pinned_get_status(status: int) -> tuple[type[BackendError], str]:
    """What an HTTP error status means for a GET of a pinned version (obstore's and
    libcurl's GETs alike)."""
    detail = f"HTTP {status}"
    if status == 404:
        # Deleted since the version was taken: that version is gone, like a 412.
        return VersionChanged, f"object version is gone ({detail})"
    if status == 412:
        return VersionChanged, f"object changed ({detail})"
    if status in (401, 403):
        return AccessDenied, f"access denied ({detail})"
    if status in TRANSIENT_STATUS:
        return TransientError, f"temporary failure ({detail})"
    return BackendError, f"request failed ({detail})"
