"""bucketfs: an S3 or GCS bucket mounted as a read-only dataset directory."""

__version__ = "0.1.0"
