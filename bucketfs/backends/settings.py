"""What a backend needs to know from the configuration, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackendSettings:
    #: Connection pool size; matches the number of worker threads.
    max_connections: int = 16
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    # S3
    endpoint_url: str | None = None  # else AWS_ENDPOINT_URL, else AWS
    region: str | None = None  # else the SDK's chain (AWS_DEFAULT_REGION, config file)
    addressing_style: str = "auto"  # "auto" | "path" | "virtual"
    profile: str | None = None
    s3_unsigned: bool = False  # requests unsigned, no credentials looked for (a public bucket)
    s3_requester_pays: bool = False  # every request says the requester pays for it
    # GCS
    gcs_project: str | None = None
    gcs_anonymous: bool = False  # anonymous access for public buckets
    gcs_billing_project: str | None = None  # requests billed to it (a requester-pays bucket)
