"""Object-store backends, picked by URL scheme."""

from __future__ import annotations

from bucketfs.backends.base import Backend
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.urls import BucketUrl


def open_backend(url: BucketUrl, settings: BackendSettings) -> Backend:
    """Build the backend for `url`. SDK imports happen here, so the others stay unloaded."""
    if url.scheme == "file":
        from bucketfs.backends.local import LocalBackend

        return LocalBackend(url.bucket)
    if url.scheme == "s3":
        from bucketfs.backends.s3 import S3Backend

        return S3Backend(url.bucket, settings)
    if url.scheme == "gs":
        from bucketfs.backends.gcs import GcsBackend

        return GcsBackend(url.bucket, settings)
    raise ValueError(f"no backend for scheme {url.scheme!r}")

