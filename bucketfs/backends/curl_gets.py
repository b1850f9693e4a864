"""A bucket's version-pinned ranged GETs through libcurl on the trio thread
(curl_multi.py says why): the request (URL, range, precondition, signature), the checks
on the answer, and what its failures mean.

S3 requests are signed by libcurl (AWS Signature Version 4) with the credentials
boto3's chain found, refreshed through it; GCS requests carry the OAuth token of the
google-auth credentials, refreshed through them. Either refresh can block on the
network, so it runs in a worker thread, and a GET meanwhile signs with what it has (SDKs
refresh minutes before expiry).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol
from urllib.parse import quote

import pycurl
import trio

from bucketfs.backends.base import (
    BackendError,
    TransientError,
    VersionChanged,
)
from bucketfs.backends.common import one_line, pinned_get_status, retry_after
from bucketfs.backends.curl_multi import CurlSettings, Transfer, TrioCurl, header_pattern
from bucketfs.workers import in_worker

#: libcurl errors that retrying cannot mend: the TLS peer or our own set-up.
_PERMANENT = frozenset({
    pycurl.E_SSL_CACERT_BADFILE, pycurl.E_SSL_CERTPROBLEM, pycurl.E_SSL_CIPHER,
    pycurl.E_PEER_FAILED_VERIFICATION, pycurl.E_SSL_ISSUER_ERROR,
    pycurl.E_SSL_PINNEDPUBKEYNOTMATCH, pycurl.E_UNSUPPORTED_PROTOCOL,
    pycurl.E_URL_MALFORMAT,
})
_RETRY_AFTER = header_pattern("retry-after")
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~/-]*")
#: How often credentials are asked again of the SDK (which refreshes them when due).
CREDENTIALS_CHECK_SECONDS = 30.0

log = logging.getLogger(__name__)


class Signer(Protocol):
    async def ready(self) -> None:
        """Fresh enough credentials at hand (may ask the SDK, in a worker thread);
        TransientError if there are none to sign with."""

    def headers(self) -> list[str]:
        """The request headers that carry credentials (a session token, a bearer token).
        They go in the request's header list before it is set on the handle: libcurl
        copies that list when it is set, so a header appended later is never sent."""

    def apply(self, curl: pycurl.Curl) -> None:
        """Options on the handle that sign the request (SigV4: libcurl signs it)."""


class Unsigned:
    """Anonymous requests (a public bucket, an emulator)."""

    async def ready(self) -> None:
        return None

    def headers(self) -> list[str]:
        return []

    def apply(self, curl: pycurl.Curl) -> None:
        return None


class SigV4:
    """AWS Signature Version 4, computed by libcurl, with boto3's credentials (a
    session token goes as x-amz-security-token)."""

    def __init__(self, credentials: Any, region: str) -> None:
        self._credentials = credentials  # botocore Credentials or RefreshableCredentials
        self._provider = f"aws:amz:{region}:s3"
        self._frozen: Any = None
        self._checked = 0.0
        self._first = trio.Lock()
        self._asking = False

    async def ready(self) -> None:
        if self._frozen is None:  # nothing to sign with yet: every GET waits for it
            async with self._first:
                if self._frozen is None:
                    await self._ask()
            return
        if time.monotonic() - self._checked >= CREDENTIALS_CHECK_SECONDS and not self._asking:
            # One GET asks; the others sign with what there is meanwhile.
            self._asking = True
            try:
                await self._ask()
            finally:
                self._asking = False

    async def _ask(self) -> None:
        try:
            frozen = await in_worker(self._credentials.get_frozen_credentials)
        except Exception as exc:  # the chain's errors: files, the network, STS
            self._checked = time.monotonic()  # asked again at the next check, not at once
            reason = f"cannot get AWS credentials ({type(exc).__name__}: {one_line(str(exc))})"
            if self._frozen is None:
                raise TransientError(reason) from None
            log.warning("%s; signing with the ones there were", reason)
            return
        self._frozen, self._checked = frozen, time.monotonic()

    def headers(self) -> list[str]:
        # Temporary credentials (an instance or pod role, SSO, an assumed role): S3
        # refuses their key without the token. libcurl signs it with the other headers.
        token = self._frozen.token
        return [f"x-amz-security-token: {token}"] if token else []

    def apply(self, curl: pycurl.Curl) -> None:
        frozen = self._frozen
        curl.setopt(pycurl.AWS_SIGV4, self._provider)
        curl.setopt(pycurl.USERNAME, frozen.access_key)
        curl.setopt(pycurl.PASSWORD, frozen.secret_key)


class BearerToken:
    """The OAuth access token of google-auth credentials."""

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials
        self._refreshing = trio.Lock()

    async def ready(self) -> None:
        if not self._credentials.valid:  # none yet, or within minutes of expiry
            async with self._refreshing:
                if not self._credentials.valid:
                    try:
                        await in_worker(self._refresh)
                    except Exception as exc:  # google-auth's: refused, or unreachable
                        raise TransientError(
                            f"cannot refresh the Google credentials ({type(exc).__name__}: "
                            f"{one_line(str(exc))})") from None

    def _refresh(self) -> None:
        from google.auth.transport.requests import Request

        self._credentials.refresh(Request())

    def headers(self) -> list[str]:
        return [f"Authorization: Bearer {self._credentials.token}"]

    def apply(self, curl: pycurl.Curl) -> None:
        return None


def object_path(key: str) -> str:
    """A key as a URL path: every byte but unreserved ones and "/" percent-encoded, as
    both S3's signature (its canonical URI) and GCS expect."""
    # Most keys need no quoting; the check costs a tenth of quote().
    return key if _UNRESERVED.fullmatch(key) else quote(key, safe="/~")


class CurlRangedGets:
    """`get_range` as a coroutine: one HTTP GET of one byte range of one object version.

    `url_of(key, version)` is the object's URL, `pinned(version)` the headers that make
    any other version fail (If-Match), `headers` those every GET carries (who pays for
    it), `answered_header` the response header naming the version sent, checked against
    the one asked for."""

    def __init__(self, settings: CurlSettings, signer: Signer, *,
                 url_of: Callable[[str, str], str], pinned: Callable[[str], list[str]],
                 answered_header: str, where: Callable[[str], str],
                 headers: Sequence[str] = ()) -> None:
        self.settings = settings
        self.signer = signer
        self.url_of = url_of
        self.pinned = pinned
        self.headers = list(headers)
        self.answered_header = header_pattern(answered_header)
        self.where = where
        self._engine: TrioCurl | None = None  # made at first use: after the daemon forks

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    async def get_range(self, key: str, version: str, start: int, length: int) -> Any:
        """Exactly bytes [start, start + length) of that version, as a memoryview of
        bytes (read-only; slices without copying); the errors of `Backend.get_range`."""
        if length == 0:
            return b""
        if self._engine is None:
            self._engine = TrioCurl(self.settings)
        try:
            await self.signer.ready()
        except TransientError as exc:
            raise TransientError(f"{self.where(key)}: {exc}") from None
        headers = [f"Range: bytes={start}-{start + length - 1}", *self.pinned(version),
                   *self.headers, *self.signer.headers()]
        transfer = Transfer(self.url_of(key, version), headers, length)
        await self._engine.get(transfer, self.signer.apply)
        data = transfer.take_body()  # taken even on failure: nothing partial kept
        if transfer.error:
            self._raise(key, transfer)
        answered = transfer.header(self.answered_header)
        if answered is None:
            raise BackendError(f"{self.where(key)}: the response names no version, so it "
                               "cannot be checked")
        if answered.strip('"') != version:
            raise VersionChanged(f"{self.where(key)}: object changed (asked for version "
                                 f"{version}, the store answered with {one_line(answered)})")
        if transfer.status != 206 and not (transfer.status == 200 and start == 0):
            raise BackendError(f"{self.where(key)}: the store ignored the Range header "
                               f"(HTTP {transfer.status})")
        if len(data) != length:
            raise TransientError(f"{self.where(key)}: short read, {len(data)} of {length} "
                                 f"bytes at offset {start}")
        return memoryview(data).toreadonly()

    def _raise(self, key: str, transfer: Transfer) -> NoReturn:
        kind, reason = classify(transfer)
        message = f"{self.where(key)}: {one_line(reason)}"
        if kind is TransientError:
            # A 503 or 429 may say how long to wait; retry.py waits that long.
            raise TransientError(message, retry_after=retry_after(
                transfer.header(_RETRY_AFTER)))
        raise kind(message)


def classify(transfer: Transfer) -> tuple[type[BackendError], str]:
    """What a failed GET of a pinned version means (as fastget.classify for obstore)."""
    if transfer.error in (pycurl.E_FILESIZE_EXCEEDED, pycurl.E_WRITE_ERROR):
        return BackendError, ("the store sent more bytes than the range asked for "
                              "(it ignored the Range header)")
    if transfer.error == pycurl.E_HTTP_RETURNED_ERROR and transfer.status:
        return pinned_get_status(transfer.status)
    text = f"curl error {transfer.error}: {transfer.message}"
    if transfer.error in _PERMANENT:
        return BackendError, f"request failed ({text})"
    # The connection failed, timed out, or the body was cut short.
    return TransientError, f"connection failed ({text})"
