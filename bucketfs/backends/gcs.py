"""gs:// backend: google-cloud-storage for credentials, listings, HEADs and errors;
the daemon's ranged GETs through libcurl on the trio thread (curl_multi.py says why),
the blocking ones through obstore (fastget.py), with the same credentials.

Every SDK call passes retry=None, and obstore's retries are off (libcurl has none):
`bucketfs.backends.retry` is the only place that retries, so every attempt here is
exactly one HTTP request. With STORAGE_EMULATOR_HOST set both talk to that emulator,
anonymously (obstore through its XML API: the emulator must answer for its host).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import quote

import google.auth
import requests
import urllib3
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage import exceptions as storage_exceptions
from obstore.auth.google import GoogleCredentialProvider
from obstore.store import GCSStore

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
from bucketfs.backends.curl_gets import (
    BearerToken,
    CurlRangedGets,
    Unsigned,
    object_path,
)
from bucketfs.backends.curl_multi import CurlSettings, ca_file
from bucketfs.backends.fastget import RETRY_CONFIG, RangedGets, client_options
from bucketfs.backends.settings import BackendSettings

log = logging.getLogger(__name__)

_READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
#: What names the project that pays for a request to a requester-pays bucket through the
#: XML API (libcurl's and obstore's GETs); the SDK's JSON API takes `userProject`.
_USER_PROJECT_HEADER = "x-goog-user-project"
#: Sent with every GET: an object stored gzip-encoded (`gcloud storage cp -Z`) then
#: comes as stored, range and all, as its listed size says. Without it GCS decompresses
#: it and ignores the Range header, which the GETs' checks refuse (EIO). Neither libcurl
#: (no CURLOPT_ACCEPT_ENCODING) nor obstore decodes the body.
_STORED_BYTES = {"accept-encoding": "gzip"}
_LIST_FIELDS = "items(name,size,generation,updated),prefixes,nextPageToken"
# Everything a request can raise that is a failure of the service or the network, not a bug.
_FAILURES = (
    api_exceptions.GoogleAPICallError,
    auth_exceptions.GoogleAuthError,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    storage_exceptions.InvalidResponse,
    storage_exceptions.DataCorruption,
    ConnectionError,
)


def _credentials(bucket: str, settings: BackendSettings) -> tuple[Credentials, str]:
    """Credentials and the project to bill; anonymous for emulators and public buckets."""
    if settings.gcs_anonymous or os.environ.get("STORAGE_EMULATOR_HOST"):
        return AnonymousCredentials(), settings.gcs_project or "anonymous"
    try:
        credentials, project = google.auth.default(scopes=[_READ_ONLY_SCOPE])
    except auth_exceptions.DefaultCredentialsError:
        log.info("no Google credentials found; reading gs://%s anonymously", bucket)
        return AnonymousCredentials(), settings.gcs_project or "anonymous"
    return credentials, settings.gcs_project or project or "anonymous"


def _get_headers(settings: BackendSettings) -> dict[str, str]:
    """The headers every GET of the XML API carries, libcurl's and obstore's alike."""
    headers = dict(_STORED_BYTES)
    if settings.gcs_billing_project:
        headers[_USER_PROJECT_HEADER] = settings.gcs_billing_project
    return headers


def _fast_store(bucket: str, api_endpoint: str, credentials: Credentials,
                settings: BackendSettings) -> GCSStore:
    """An obstore GCSStore reaching the bucket the way the SDK client does."""
    options: dict[str, Any] = {"base_url": api_endpoint,
                               "client_options": client_options(api_endpoint, settings),
                               "retry_config": RETRY_CONFIG}
    options["client_options"]["default_headers"] = _get_headers(settings)
    if isinstance(credentials, AnonymousCredentials):
        options["skip_signature"] = True
    else:
        options["credential_provider"] = GoogleCredentialProvider(credentials)
    return GCSStore(bucket, **options)


def _curl_gets(bucket: str, api_endpoint: str, credentials: Credentials,
               settings: BackendSettings, where: Callable[[str], str]) -> CurlRangedGets:
    """The daemon's GETs through libcurl (curl_gets.py): the XML API, as obstore's
    (`{endpoint}/{bucket}/{object}?generation=N`, the answer's x-goog-generation)."""
    base = f"{api_endpoint.rstrip('/')}/{quote(bucket, safe='')}"
    signer = (Unsigned() if isinstance(credentials, AnonymousCredentials)
              else BearerToken(credentials))
    return CurlRangedGets(
        CurlSettings(settings.max_connections, settings.connect_timeout,
                     settings.read_timeout, ca_file(os.environ.get("REQUESTS_CA_BUNDLE"))),
        signer,
        # Naming the generation makes GCS answer 404 once it is gone.
        url_of=lambda key, version: f"{base}/{object_path(key)}?generation={version}",
        pinned=lambda version: [], answered_header="x-goog-generation", where=where,
        headers=[f"{name}: {value}" for name, value in _get_headers(settings).items()])


class GcsBackend:
    def __init__(self, bucket: str, settings: BackendSettings) -> None:
        self.bucket = bucket
        self.url = f"gs://{bucket}"
        self._timeout = (settings.connect_timeout, settings.read_timeout)
        credentials, project = _credentials(bucket, settings)
        # Our own session, so the connection pool matches the number of worker threads
        # (requests' default keeps 10). Its adapter does not retry either.
        session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=settings.max_connections)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        self._client = storage.Client(project=project, credentials=credentials, _http=session)
        # Recent google-cloud-storage fetches bucket metadata for tracing from background
        # threads, and re-checks the bucket after any 404: requests nobody asked for, outside
        # the retry policy and the worker limit. Every use of the cache is guarded by a
        # truth test of this attribute.
        self._client._bucket_metadata_cache = None
        # With a billing project the SDK's requests name it (`userProject`).
        self._bucket = self._client.bucket(bucket, user_project=settings.gcs_billing_project)
        self.endpoint = public_endpoint(self._client.api_endpoint)
        self._gets = RangedGets(
            _fast_store(bucket, self._client.api_endpoint, credentials, settings),
            where=lambda key: f"{self._where(key)} via {self.endpoint}",
            # Naming the generation makes GCS answer 404 once it is gone; the answer's
            # own generation (x-goog-generation) is checked as well.
            pinned=lambda version: {"version": version},
            answered=lambda meta: None if meta.get("version") is None else str(meta["version"]))
        self._curl_gets = _curl_gets(
            bucket, self._client.api_endpoint, credentials, settings,
            where=lambda key: f"{self._where(key)} via {self.endpoint}")
        #: The daemon's GETs: a coroutine on the trio thread (ObjectStore prefers it).
        self.async_get_range = self._curl_gets.get_range

    def close(self) -> None:
        self._curl_gets.close()
        self._client.close()

    def check_access(self) -> None:
        self.list_page("", None, None, 1)

    def list_page(
        self, prefix: str, delimiter: str | None, token: str | None, page_size: int
    ) -> ListPage:
        try:
            blobs = self._client.list_blobs(
                self._bucket,
                prefix=prefix or None,
                delimiter=delimiter,
                page_token=token,
                page_size=page_size,
                fields=_LIST_FIELDS,
                retry=None,
                timeout=self._timeout,
            )
            page = next(blobs.pages)
            # A "dir/" marker object is the directory itself, not an entry in it.
            objects = [self._info(blob) for blob in page if blob.name != prefix]
        except _FAILURES as exc:
            self._raise(exc, prefix or None, NoSuchBucket)
        return ListPage(
            objects=objects, prefixes=list(page.prefixes), next_token=blobs.next_page_token
        )

    def head(self, key: str) -> ObjectInfo:
        try:
            blob = self._bucket.get_blob(key, retry=None, timeout=self._timeout)
        except _FAILURES as exc:
            self._raise(exc, key, NotFound)
        if blob is None:
            raise NotFound(f"{self._where(key)} via {self.endpoint}: no such object")
        return self._info(blob)

    def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        return self._gets.get_range(key, version, start, length)

    @staticmethod
    def _info(blob: storage.Blob) -> ObjectInfo:
        return ObjectInfo(
            key=blob.name,
            size=blob.size or 0,
            mtime_ns=mtime_ns(blob.updated),
            version=str(blob.generation),
        )

    def _check_version(self, key: str, generation: int, answered: int | None) -> None:
        """The response must be the generation asked for (see `Backend.get_range`)."""
        where = f"{self._where(key)} via {self.endpoint}"
        if answered is None:
            raise BackendError(f"{where}: the response names no generation, so its "
                               "version cannot be checked")
        if answered != generation:
            raise VersionChanged(f"{where}: object changed (asked for generation "
                                 f"{generation}, the store answered with {answered})")

    def _where(self, key: str | None) -> str:
        return f"gs://{self.bucket}/{key}" if key else f"gs://{self.bucket}"

    def _raise(self, exc: Exception, key: str | None, missing: type[BackendError]) -> NoReturn:
        """Translate an SDK error; `missing` is what a 404 means for this call."""
        kind, reason = _classify(exc, missing)
        message = f"{self._where(key)} via {self.endpoint}: {one_line(reason)}"
        # API errors keep the HTTP response, and with it any Retry-After.
        headers = getattr(getattr(exc, "response", None), "headers", None)
        if kind is TransientError and headers is not None:
            asked = retry_after(headers.get("Retry-After"))
            raise TransientError(message, retry_after=asked) from None
        raise kind(message) from None


def _classify(exc: Exception, missing: type[BackendError]) -> tuple[type[BackendError], str]:
    name = type(exc).__name__
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        status = exc.code or 0
        # The SDK's message repeats the whole request URL; the status and reason suffice.
        reason = exc.errors[0].get("reason") if exc.errors else None
        detail = f"HTTP {status}" + (f": {reason}" if reason else "")
        if isinstance(exc, api_exceptions.NotFound):
            what = {NoSuchBucket: "no such bucket", NotFound: "no such object"}.get(
                missing, "object version is gone")
            return missing, f"{what} ({detail})"
        if isinstance(exc, api_exceptions.Forbidden | api_exceptions.Unauthorized):
            return AccessDenied, f"access denied ({detail})"
        if isinstance(exc, api_exceptions.PreconditionFailed):
            return VersionChanged, f"object changed ({detail})"
        if status in TRANSIENT_STATUS:
            return TransientError, f"temporary failure ({detail})"
        if "requester pays" in (exc.message or "").lower():
            return BackendError, (f"the bucket is requester-pays: name a project to bill "
                                  f"with --billing-project ({detail})")
        return BackendError, f"request failed ({detail})"
    if isinstance(exc, auth_exceptions.TransportError):
        return TransientError, f"cannot reach the token service ({name}: {exc})"
    if isinstance(exc, auth_exceptions.GoogleAuthError):
        # RefreshError and the like: the credentials themselves are refused.
        return AccessDenied, f"credentials failed ({name}: {exc})"
    if isinstance(exc, requests.Timeout):
        return TransientError, f"timed out ({name})"
    if isinstance(exc, requests.ConnectionError):
        # requests wraps urllib3's MaxRetryError; its reason says whether we ever connected.
        cause = exc.args[0] if exc.args else None
        if isinstance(getattr(cause, "reason", None), urllib3.exceptions.NewConnectionError):
            return Unreachable, f"cannot connect ({name}: {exc})"
        return TransientError, f"connection failed ({name}: {exc})"
    # The rest: a raw download reads the body through urllib3, whose errors arrive
    # unwrapped (resets, read timeouts, bodies shorter than their Content-Length).
    return TransientError, f"connection failed ({name}: {exc})"
