"""What the requests of a phase would cost at published request prices.

Prices in US dollars per 1,000 requests, Standard storage class, as published on
  S3:  https://aws.amazon.com/s3/pricing/  (us-east-1: "PUT, COPY, POST, LIST requests"
       $0.005, "GET, SELECT, and all other requests" $0.0004)
  GCS: https://cloud.google.com/storage/pricing  (Standard storage: Class A operations
       $0.005 (objects.list is class A), Class B operations $0.0004 (objects.get, a
       metadata get included))
read 2024-10 (the figures have been stable since 2023); this machine cannot reach the
pages, so check them before quoting a cost. Data transfer (egress) is not included: it
depends on where the reader is, and the bytes are reported beside the cost.
"""

from __future__ import annotations

S3_GET_PER_1000 = 0.0004  # GET, HEAD and "all other requests"
S3_LIST_PER_1000 = 0.005  # LIST (billed with PUT, COPY, POST)
GCS_CLASS_A_PER_1000 = 0.005  # objects.list (and inserts)
GCS_CLASS_B_PER_1000 = 0.0004  # objects.get, metadata gets
PRICES_READ = "2024-10"


def s3_cost(requests: dict[str, float]) -> float:
    """Dollars for GET/HEAD/LIST/OTHER counts at S3 Standard prices."""
    cheap = requests.get("GET", 0) + requests.get("HEAD", 0) + requests.get("OTHER", 0)
    return (cheap * S3_GET_PER_1000 + requests.get("LIST", 0) * S3_LIST_PER_1000) / 1000


def gcs_cost(requests: dict[str, float]) -> float:
    """Dollars for the same requests against GCS Standard (a LIST is class A; an object
    read or metadata read is class B)."""
    class_b = requests.get("GET", 0) + requests.get("HEAD", 0) + requests.get("OTHER", 0)
    class_a = requests.get("LIST", 0)
    return (class_a * GCS_CLASS_A_PER_1000 + class_b * GCS_CLASS_B_PER_1000) / 1000


def per_million_files(dollars: float, files: int) -> float:
    """A phase's cost scaled to a dataset of a million files read the same way (the
    request count per file carries over; ImageNet-1k's train split is 1.28 million)."""
    return dollars * 1_000_000 / files if files else 0.0
