"""A SigV4 signer for a proxy that rewrites S3 requests (tests/faultproxy.py's `signer`):
the signature covers headers such as If-Match and x-amz-request-payer, so a request the
proxy changed must be signed anew before the upstream sees it."""

from __future__ import annotations

from tests.faultproxy import Signer


def sigv4_signer(access_key: str, secret_key: str, region: str) -> Signer:
    """Signs a rewritten S3 request anew (SigV4 covers headers such as If-Match)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = S3SigV4Auth(Credentials(access_key, secret_key), "s3", region)
    replaced = {"authorization", "x-amz-date", "x-amz-content-sha256"}

    def sign(method: str, target: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        kept = {k: v for k, v in headers if k.lower() not in replaced}
        host = next(v for k, v in kept.items() if k.lower() == "host")
        request = AWSRequest(method=method, url=f"http://{host}{target}", headers=kept)
        auth.add_auth(request)
        return list(request.headers.items())

    return sign
