"""Parsing of the bucket URLs a user types: s3://bucket[/prefix], gs://bucket[/prefix], file:///path."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("s3", "gs", "file")


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
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise BadUrl(f"unsupported URL {text!r}: expected s3://BUCKET[/PREFIX], "
                     "gs://BUCKET[/PREFIX] or file:///PATH")
    if parts.query or parts.fragment:
        raise BadUrl(f"URL {text!r} must not have a query or fragment")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BadUrl(f"file URL {text!r} must be file:///ABSOLUTE/PATH")
        path = parts.path.rstrip("/") or "/"
        if not path.startswith("/"):
            raise BadUrl(f"file URL {text!r} must name an absolute path")
        return BucketUrl("file", path, "")
    if "@" in parts.netloc:
        raise BadUrl("credentials do not belong in the bucket URL; use the SDK's credential chain")
    bucket = parts.netloc
    if not bucket:
        raise BadUrl(f"URL {text!r} names no bucket")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return BucketUrl(scheme, bucket, prefix)
