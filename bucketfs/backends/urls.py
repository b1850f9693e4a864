"""Parsing of the bucket URLs a user types: s3://bucket[/prefix], gs://bucket[/prefix], file:///path."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("s3", "gs", "file")
#: The user:password@ of a URL, kept out of error messages.
_USERINFO = re.compile(r"(^|[/\s'\"])[^/\s'\"]*@")


class BadUrl(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BucketUrl:
    scheme: str
    #: Bucket name; for file:// the absolute directory path.
    bucket: str
    #: Key prefix the mount shows as its root: "" or ending in "/".
    prefix: str

    @property
    def bucket_url(self) -> str:
        """The bucket alone, without the prefix: what cached keys are relative to."""
        return f"file://{self.bucket}" if self.scheme == "file" else \
            f"{self.scheme}://{self.bucket}"

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.bucket}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse_bucket_url(text: str) -> BucketUrl:
    shown = _scrub(text)  # what error messages may echo
    # urlsplit silently drops tabs and line breaks, and a NUL reaches no API: refused
    # rather than mounting some other prefix than the one typed.
    if any(unicodedata.category(ch) == "Cc" for ch in text):
        raise BadUrl(f"URL {shown!r} must not contain control characters")
    # An empty "?" or "#" would be dropped just as silently.
    if "?" in text or "#" in text:
        raise BadUrl(f"URL {shown!r} must not have a query or fragment")
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # a bad [IPv6] host, characters NFKC changes into "/"
        raise BadUrl(f"URL {shown!r} cannot be parsed: "
                     f"{_scrub(str(exc))}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise BadUrl(f"unsupported URL {shown!r}: expected s3://BUCKET[/PREFIX], "
                     "gs://BUCKET[/PREFIX] or file:///PATH")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BadUrl(f"file URL {shown!r} must be file:///ABSOLUTE/PATH")
        if not parts.path.startswith("/"):  # "file:" alone would otherwise mount /
            raise BadUrl(f"file URL {shown!r} must name an absolute path")
        return BucketUrl("file", parts.path.rstrip("/") or "/", "")
    if "@" in parts.netloc:
        raise BadUrl("credentials do not belong in the bucket URL; use the SDK's credential chain")
    bucket = parts.netloc
    if not bucket:
        raise BadUrl(f"URL {shown!r} names no bucket")
    if any(unicodedata.category(ch) == "Cs" for ch in text):
        raise BadUrl(f"URL {shown!r} is not valid UTF-8")  # no object store takes it
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return BucketUrl(scheme, bucket, prefix)


def _scrub(text: str) -> str:
    return _USERINFO.sub(r"\1<redacted>@", text)
