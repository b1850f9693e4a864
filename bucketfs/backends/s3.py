"""s3:// backend: boto3 for credentials, listings, HEADs and errors; the daemon's ranged
GETs through libcurl on the trio thread (curl_multi.py says why), the blocking ones
through obstore (fastget.py), both signed with the credentials boto3's chain found.

Credentials, region and endpoint come from the SDK's standard chain unless the settings
name them. Neither SDK retries: `bucketfs.backends.retry` is the only place that
retries, so every attempt here is exactly one HTTP request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import boto3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from obstore.auth.boto3 import Boto3CredentialProvider
from obstore.store import S3Store

from bucketfs.backends.base import (
    AccessDenied,
    BackendError,
    ListPage,
    NoSuchBucket,
    NotFound,
    ObjectInfo,
    TransientError,
    Unreachable,
    VersionChanged,
)
from bucketfs.backends.common import (
    TRANSIENT_STATUS,
    mtime_ns,
    one_line,
    public_endpoint,
    retry_after,
)
from bucketfs.backends.curl_gets import CurlRangedGets, Signer, SigV4, Unsigned, object_path
from bucketfs.backends.curl_multi import CurlSettings, ca_file
from bucketfs.backends.fastget import RETRY_CONFIG, RangedGets, client_options
from bucketfs.backends.settings import BackendSettings

log = logging.getLogger(__name__)

_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "BandwidthLimitExceeded",
        "InternalError",
        "RequestLimitExceeded",
        "RequestTimeout",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
    }
)
#: What a request to a requester-pays bucket must carry (libcurl's GETs; boto3 and
#: obstore are told by their own options).
_PAYER_HEADER = "x-amz-request-payer"

_CREDENTIAL_ERRORS = (
    NoCredentialsError,
    PartialCredentialsError,
    CredentialRetrievalError,
    ProfileNotFound,
)


def _is_aws(endpoint: str) -> bool:
    return urlsplit(endpoint).hostname.endswith(".amazonaws.com")  # type: ignore[union-attr]


def _addressing(bucket: str, endpoint: str, style: str) -> tuple[bool, bool, str]:
    """How requests reach the bucket, as the boto3 client would: whether the endpoint is
    AWS's own, whether the bucket is named in the host (virtual-hosted style), and the
    bucket's base URL. On AWS, "auto" is virtual-hosted except for a dotted name, which
    as a host would not match AWS's wildcard TLS certificate (path style, as boto3)."""
    parts = urlsplit(endpoint)
    aws = _is_aws(endpoint)
    virtual = style == "virtual" or (style == "auto" and aws and "." not in bucket)
    base = (urlunsplit(parts._replace(netloc=f"{bucket}.{parts.netloc}")) if virtual
            else f"{endpoint.rstrip('/')}/{bucket}")
    return aws, virtual, base.rstrip("/")


def _signing_credentials(session: boto3.session.Session, settings: BackendSettings) -> Any:
    """The credentials requests are signed with; None: unsigned (`s3_unsigned`, or none
    found: boto3's own requests then fail, naming the missing credentials)."""
    return None if settings.s3_unsigned else session.get_credentials()


def _fast_store(bucket: str, client: Any, session: boto3.session.Session,
                settings: BackendSettings) -> S3Store:
    """An obstore S3Store reaching the bucket the way the boto3 client does: its endpoint
    (none for AWS itself, where the region says where), addressing style, region and
    credentials (refreshed through the session; none: unsigned, as a public bucket)."""
    endpoint = client.meta.endpoint_url
    aws, virtual, base = _addressing(bucket, endpoint, settings.addressing_style)
    options: dict[str, Any] = {
        "region": client.meta.region_name, "virtual_hosted_style_request": virtual,
        "client_options": client_options(endpoint, settings), "retry_config": RETRY_CONFIG}
    if not aws:
        options["endpoint"] = base if virtual else endpoint
    if settings.s3_requester_pays:
        options["request_payer"] = True
    if bucket.endswith("--x-s3"):
        # An S3 Express One Zone directory bucket (AWS names them so): its requests are
        # signed with session credentials, which obstore fetches (CreateSession).
        # Not tested here: this machine reaches no AWS endpoint.
        options["s3_express"] = True
    if _signing_credentials(session, settings) is None:
        options["skip_signature"] = True
    else:
        options["credential_provider"] = Boto3CredentialProvider(session)
    return S3Store(bucket, **options)


def _curl_target(bucket: str, client: Any, session: boto3.session.Session,
                 settings: BackendSettings) -> tuple[Callable[[str, str], str], Signer]:
    """Where the daemon's GETs go and how they are signed, as the boto3 client would."""
    _, _, base = _addressing(bucket, client.meta.endpoint_url, settings.addressing_style)
    credentials = _signing_credentials(session, settings)
    signer = Unsigned() if credentials is None else SigV4(
        credentials, client.meta.region_name or "us-east-1")
    return (lambda key, version: f"{base}/{object_path(key)}"), signer


def _curl_gets(bucket: str, client: Any, session: boto3.session.Session,
               settings: BackendSettings, where: Callable[[str], str],
               ) -> CurlRangedGets | None:
    """The daemon's GETs through libcurl (curl_gets.py), reaching the bucket as
    `_fast_store` does; None for an S3 Express bucket, whose session credentials only
    obstore fetches."""
    if bucket.endswith("--x-s3"):
        return None
    url_of, signer = _curl_target(bucket, client, session, settings)
    payer = [f"{_PAYER_HEADER}: requester"] if settings.s3_requester_pays else []
    return CurlRangedGets(
        CurlSettings(settings.max_connections, settings.connect_timeout,
                     settings.read_timeout, ca_file(os.environ.get("AWS_CA_BUNDLE"))),
        signer, url_of=url_of,
        pinned=lambda version: [f'If-Match: "{version}"'], answered_header="etag",
        where=where, headers=payer)


def _client_config(settings: BackendSettings) -> Config:
    """The boto3 client's timeouts and addressing; one attempt per call (retry.py
    retries)."""
    return Config(connect_timeout=settings.connect_timeout,
                  read_timeout=settings.read_timeout,
                  retries={"mode": "standard", "total_max_attempts": 1},
                  s3={"addressing_style": settings.addressing_style})


def _open_client(settings: BackendSettings, where: str, config: Config | None = None,
                 ) -> tuple[boto3.session.Session, Any]:
    """A boto3 session (the profile's credential chain) and its S3 client; what fails
    is a backend error about `where`."""
    if settings.s3_unsigned:  # a public bucket: no credentials looked for or sent
        config = (config or Config()).merge(Config(signature_version=UNSIGNED))
    try:
        session = boto3.session.Session(profile_name=settings.profile)
        return session, session.client("s3", endpoint_url=settings.endpoint_url,
                                       region_name=settings.region, config=config)
    except BotoCoreError as exc:
        kind, reason = _classify(exc, BackendError)
        raise kind(f"{where}: {one_line(reason)}") from None


def _bucket_region(client: Any, bucket: str) -> str | None:
    """The region S3 says `bucket` is in (HeadBucket's x-amz-bucket-region, named even
    when the request is refused); None where no answer names one."""
    try:
        answer = client.head_bucket(Bucket=bucket)["ResponseMetadata"]
    except ClientError as exc:
        answer = exc.response.get("ResponseMetadata", {})
    except BotoCoreError:
        return None  # unreachable: the requests that matter will say so
    return answer.get("HTTPHeaders", {}).get("x-amz-bucket-region")


def _located(session: boto3.session.Session, client: Any, bucket: str, url: str) -> Any:
    """A client for the region S3 says the bucket is in, where it is not `client`'s;
    else `client`. A node's region names where it runs, not where each bucket is, and a
    request signed for another region is refused (boto3 follows S3's answer for its own
    requests; libcurl's and obstore's do not)."""
    configured = client.meta.region_name
    region = _bucket_region(client, bucket)
    if not region or region == configured:
        return client
    # AWS's own endpoint is the region's; any other (named, or AWS_ENDPOINT_URL's)
    # stays as the first client found it.
    endpoint: str | None = None if _is_aws(client.meta.endpoint_url) else (
        client.meta.endpoint_url)
    try:
        located = session.client("s3", endpoint_url=endpoint, region_name=region,
                                 config=client.meta.config)
    except BotoCoreError as exc:
        log.warning("%s is in %s, but no client for it: %s", url, region, one_line(str(exc)))
        return client
    log.info("%s is in %s, not %s as configured: requests are signed for %s",
             url, region, configured, region)
    return located


def open_object_store(bucket: str, settings: BackendSettings) -> tuple[S3Store, str]:
    """An obstore S3Store for `bucket`, with its public endpoint: reached and signed as
    the origin would be with these settings, for the region the bucket is in (the shared
    cache tier reads and writes through it). Asks S3 where the bucket is: one request."""
    session, client = _open_client(settings, f"s3://{bucket}", _client_config(settings))
    located = _located(session, client, bucket, f"s3://{bucket}")
    try:
        return (_fast_store(bucket, located, session, settings),
                public_endpoint(located.meta.endpoint_url))
    finally:
        client.close()
        if located is not client:
            located.close()


def _etag(value: str) -> str:
    return value.strip('"')


class S3Backend:
    def __init__(self, bucket: str, settings: BackendSettings) -> None:
        self.bucket = bucket
        self.url = f"s3://{bucket}"
        config = _client_config(settings).merge(Config(
            max_pool_connections=settings.max_connections,
            # Ranged reads cannot be checked against whole-object checksums anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ))
        self._settings = settings
        self._located = False
        #: boto3's parameter that says the requester pays (HeadBucket takes none).
        self._payer: dict[str, str] = (
            {"RequestPayer": "requester"} if settings.s3_requester_pays else {})
        self._session, self._client = _open_client(settings, str(self.url), config)
        self._gets = self._obstore_gets()
        self._curl_gets = _curl_gets(
            bucket, self._client, self._session, settings,
            where=lambda key: f"{self._where(key)} via {self.endpoint}")
        #: The daemon's GETs: a coroutine on the trio thread (ObjectStore prefers it).
        self.async_get_range = (None if self._curl_gets is None
                                else self._curl_gets.get_range)

    @property
    def endpoint(self) -> str:
        return public_endpoint(self._client.meta.endpoint_url)

    def _obstore_gets(self) -> RangedGets:
        return RangedGets(
            _fast_store(self.bucket, self._client, self._session, self._settings),
            where=lambda key: f"{self._where(key)} via {self.endpoint}",
            pinned=lambda version: {"if_match": f'"{version}"'},
            answered=lambda meta: None if meta.get("e_tag") is None else _etag(meta["e_tag"]))

    def locate(self) -> None:
        """Sign for the region S3 says the bucket is in, where it is not the one
        configured (once): a node's region names where it runs, not where each bucket
        is, and a GET signed for another region is refused (boto3 follows S3's answer
        for its own requests; the daemon's GETs and obstore's do not). HeadBucket names
        the region even when it is refused."""
        if self._located:
            return
        self._located = True
        client = _located(self._session, self._client, self.bucket, self.url)
        if client is self._client:
            return
        # The old client is left to the collector: another thread may be using it.
        self._client = client
        self._gets = self._obstore_gets()
        if self._curl_gets is not None:
            self._curl_gets.url_of, self._curl_gets.signer = _curl_target(
                self.bucket, client, self._session, self._settings)

    def close(self) -> None:
        if self._curl_gets is not None:
            self._curl_gets.close()
        self._client.close()

    def check_access(self) -> None:
        try:
            self._client.list_objects_v2(Bucket=self.bucket, MaxKeys=1, **self._payer)
        except (ClientError, BotoCoreError) as exc:
            self._raise(exc, None, NoSuchBucket)
        self.locate()

    def list_page(
        self, prefix: str, delimiter: str | None, token: str | None, page_size: int
    ) -> ListPage:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": page_size,
                                  **self._payer}
        if delimiter is not None:
            kwargs["Delimiter"] = delimiter
        if token is not None:
            kwargs["ContinuationToken"] = token
        try:
            resp = self._client.list_objects_v2(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            self._raise(exc, prefix or None, NoSuchBucket)
        return ListPage(
            # A "dir/" marker object is the directory itself, not an entry in it.
            objects=[
                ObjectInfo(
                    key=o["Key"],
                    size=o["Size"],
                    mtime_ns=mtime_ns(o["LastModified"]),
                    version=_etag(o["ETag"]),
                )
                for o in resp.get("Contents", ())
                if o["Key"] != prefix
            ],
            prefixes=[p["Prefix"] for p in resp.get("CommonPrefixes", ())],
            next_token=resp.get("NextContinuationToken") if resp.get("IsTruncated") else None,
        )

    def head(self, key: str) -> ObjectInfo:
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=key, **self._payer)
        except (ClientError, BotoCoreError) as exc:
            self._raise(exc, key, NotFound)
        return ObjectInfo(
            key=key,
            size=resp["ContentLength"],
            mtime_ns=mtime_ns(resp["LastModified"]),
            version=_etag(resp["ETag"]),
        )

    def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        return self._gets.get_range(key, version, start, length)

    def _where(self, key: str | None) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def _raise(
        self, exc: ClientError | BotoCoreError, key: str | None, missing: type[BackendError]
    ) -> NoReturn:
        """Translate an SDK error; `missing` is what a 404 means for this call."""
        kind, reason = _classify(exc, missing)
        message = f"{self._where(key)} via {self.endpoint}: {one_line(reason)}"
        if kind is TransientError and isinstance(exc, ClientError):
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            asked = retry_after(headers.get("retry-after"))
            raise TransientError(message, retry_after=asked) from None
        raise kind(message) from None


def _classify(
    exc: ClientError | BotoCoreError, missing: type[BackendError]
) -> tuple[type[BackendError], str]:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(error.get("Code") or status)
        # Only the code and message: other fields (StringToSign, AWSAccessKeyId) may
        # echo credentials.
        detail = f"{code}: {error.get('Message') or 'no message'} (HTTP {status})"
        if code == "NoSuchBucket":
            return NoSuchBucket, f"no such bucket ({detail})"
        if code in _DENIED_CODES or status in (401, 403):
            return AccessDenied, f"access denied ({detail})"
        if code == "PreconditionFailed" or status == 412:
            return VersionChanged, f"object changed ({detail})"
        if code in ("NoSuchKey", "NotFound") or status == 404:
            return missing, f"not found ({detail})"
        if code in _TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return TransientError, f"temporary failure ({detail})"
        return BackendError, f"request failed ({detail})"
    name = type(exc).__name__
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return AccessDenied, (f"no usable AWS credentials ({name}: {exc}); a public "
                              "bucket can be read without: --no-sign-request")
    if isinstance(exc, ConnectTimeoutError):
        return TransientError, f"connect timed out ({name})"
    if isinstance(exc, BotoConnectionError):
        # Refused connection, DNS failure, TLS or proxy failure: nothing answered.
        return Unreachable, f"cannot connect ({name}: {exc})"
    if isinstance(exc, HTTPClientError | IncompleteReadError):
        # Read timeout, reset or closed connection, a body cut short.
        return TransientError, f"connection failed ({name}: {exc})"
    return BackendError, f"request failed ({name}: {exc})"
