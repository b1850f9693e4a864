"""libcurl's GETs on the trio thread (bucketfs.backends.curl_multi and curl_gets) against
a small HTTP server of our own, which can ignore the Range header, stall mid-body or
answer with an error: what a real store rarely does on demand. Also: credentials asked
for once by many GETs, and the URLs each backend builds (AWS itself is out of reach
here). The same GETs against SeaweedFS and fake-gcs-server are in test_backends.py."""

from __future__ import annotations

import http.server
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pycurl
import pytest
import trio

from bucketfs.backends.base import BackendError, TransientError, VersionChanged
from bucketfs.backends.curl_gets import (
    CREDENTIALS_CHECK_SECONDS,
    BearerToken,
    CurlRangedGets,
    SigV4,
    Unsigned,
)
from bucketfs.backends.curl_multi import (
    LARGE_BODY,
    CurlSettings,
    Transfer,
    TrioCurl,
    ca_file,
    header_pattern,
)
from bucketfs.backends.gcs import GcsBackend
from bucketfs.backends.s3 import S3Backend
from bucketfs.backends.settings import BackendSettings

BODY = bytes(range(256)) * 5000  # 1,280,000 bytes: over LARGE_BODY
VERSION = "v1"


@dataclass
class Behaviour:
    honour_range: bool = True
    stall_after: int | None = None  # bytes sent before the server stops sending
    status: int | None = None  # answer this status instead
    no_length: bool = False  # no Content-Length: the body ends when the connection does
    chunked: bool = False  # Transfer-Encoding: chunked (with `trickle`, a chunk a piece)
    version: str = VERSION
    #: Send the body in pieces of this many bytes, `pause` seconds apart (a slow link).
    trickle: int | None = None
    pause: float = 0.0002
    requests: list[str] = field(default_factory=list)
    #: Each request's headers, as received.
    headers: list[dict[str, str]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    behaviour: Behaviour

    def do_GET(self) -> None:
        behaviour = self.server.behaviour  # type: ignore[attr-defined]
        behaviour.requests.append(self.path)
        behaviour.headers.append({k.lower(): v for k, v in self.headers.items()})
        if behaviour.status is not None:
            self.send_response(behaviour.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, status = BODY, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if match and behaviour.honour_range:
            body, status = BODY[int(match[1]):int(match[2]) + 1], 206
        self.send_response(status)
        if behaviour.no_length:
            self.send_header("Connection", "close")
            self.close_connection = True
        elif behaviour.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{behaviour.version}"')
        self.end_headers()
        if behaviour.stall_after is not None:
            self.wfile.write(body[:behaviour.stall_after])
            self.wfile.flush()
            behaviour.release.wait(10)
            return
        if behaviour.trickle is not None:
            for at in range(0, len(body), behaviour.trickle):
                piece = body[at:at + behaviour.trickle]
                if behaviour.chunked:
                    piece = b"%x\r\n%s\r\n" % (len(piece), piece)
                self.wfile.write(piece)
                time.sleep(behaviour.pause)
            if behaviour.chunked:
                self.wfile.write(b"0\r\n\r\n")
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up (a cancelled GET) resets its connection


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour]]:
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.behaviour = Behaviour()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.behaviour  # type: ignore[attr-defined]
    httpd.behaviour.release.set()  # type: ignore[attr-defined]
    httpd.shutdown()
    httpd.server_close()


def gets(endpoint: str, **settings: float) -> CurlRangedGets:
    return CurlRangedGets(
        CurlSettings(connections=4, **settings), Unsigned(),  # type: ignore[arg-type]
        url_of=lambda key, version: f"{endpoint}/{key}",
        pinned=lambda version: [f'If-Match: "{version}"'], answered_header="etag",
        where=lambda key: f"test://{key}")


@pytest.mark.parametrize(("start", "length"), [(0, 1), (0, len(BODY)), (1000, 99_000),
                                               (len(BODY) - 7, 7), (5, LARGE_BODY + 3)])
def test_a_range_comes_back_exact_and_read_only(server, start, length) -> None:
    endpoint, _ = server
    client = gets(endpoint)
    data = trio.run(client.get_range, "obj", VERSION, start, length)
    client.close()
    assert bytes(data) == BODY[start:start + length]
    assert isinstance(data, memoryview) and data.readonly


def test_many_gets_at_once_share_a_few_connections(server) -> None:
    """60 GETs at once through a multi handle allowed 4 connections to the host: each
    gets its own bytes."""
    endpoint, behaviour = server
    client = gets(endpoint)
    results: dict[int, bytes] = {}

    async def main() -> None:
        async def one(i: int) -> None:
            results[i] = bytes(await client.get_range("obj", VERSION, i * 1000, 5000))

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(one, i)

    trio.run(main)
    client.close()
    assert results == {i: BODY[i * 1000:i * 1000 + 5000] for i in range(60)}
    assert len(behaviour.requests) == 60


def test_a_server_ignoring_the_range_is_an_error_not_wrong_bytes(server) -> None:
    endpoint, behaviour = server
    behaviour.honour_range = False
    client = gets(endpoint)
    with pytest.raises(BackendError, match="more bytes than the range") as caught:
        trio.run(client.get_range, "obj", VERSION, 10, 100)
    client.close()
    assert "test://obj" in str(caught.value)


@pytest.mark.parametrize("length", [100, LARGE_BODY])
def test_a_body_of_unknown_length_longer_than_asked_is_an_error(server, length) -> None:
    """Without a Content-Length libcurl cannot refuse it up front: it stops the body
    at MAXFILESIZE as it arrives (libcurl 8.4 on; before, a large body's mapping,
    full, refuses the excess: CURLE_WRITE_ERROR)."""
    endpoint, behaviour = server
    behaviour.honour_range, behaviour.no_length = False, True
    client = gets(endpoint)
    with pytest.raises(BackendError, match="more bytes than the range"):
        trio.run(client.get_range, "obj", VERSION, 0, length)
    client.close()


def test_another_version_in_the_answer_is_refused(server) -> None:
    endpoint, behaviour = server
    behaviour.version = "v2"
    client = gets(endpoint)
    with pytest.raises(VersionChanged, match=r"asked for version v1.*answered with .*v2"):
        trio.run(client.get_range, "obj", VERSION, 0, 100)
    client.close()


@pytest.mark.parametrize(("status", "kind"), [(503, TransientError), (429, TransientError),
                                              (412, VersionChanged), (404, VersionChanged),
                                              (400, BackendError)])
def test_an_error_status_says_what_it_means(server, status, kind) -> None:
    endpoint, behaviour = server
    behaviour.status = status
    client = gets(endpoint)
    with pytest.raises(kind, match=f"HTTP {status}"):
        trio.run(client.get_range, "obj", VERSION, 0, 100)
    client.close()


def test_a_stalled_body_times_out_as_transient(server) -> None:
    endpoint, behaviour = server
    behaviour.stall_after = 1000
    client = gets(endpoint, read_timeout=1)
    with pytest.raises(TransientError, match="connection failed"):
        trio.run(client.get_range, "obj", VERSION, 0, 500_000)
    client.close()


def test_a_body_that_trickles_in_far_below_any_link_is_cut_as_transient(server) -> None:
    """A server that sends a few bytes now and then (here ~100 B/s) is no slow link:
    the GET is cut after about the read timeout, libcurl's speed over its last few
    seconds being under MIN_SPEED, where a floor of one byte a second let this one run
    for a quarter of an hour (a stalled body: the test above; a slow link's body is not
    cut: test_curl_wakes)."""
    endpoint, behaviour = server
    behaviour.trickle, behaviour.pause = 10, 0.1
    client = gets(endpoint, read_timeout=1)

    async def get() -> object:
        with trio.fail_after(20):
            return await client.get_range("obj", VERSION, 0, 100_000)

    with pytest.raises(TransientError, match="connection failed"):
        trio.run(get)
    client.close()


def test_a_refused_connection_is_transient() -> None:
    client = gets("http://127.0.0.1:9")  # discard: nothing listens here
    with pytest.raises(TransientError, match="curl error 7"):
        trio.run(client.get_range, "obj", VERSION, 0, 10)
    client.close()


def test_a_cancelled_get_leaves_the_multi_handle_and_the_next_get_works(server) -> None:
    endpoint, behaviour = server
    behaviour.stall_after = 1000
    engine = TrioCurl(CurlSettings(connections=2))

    async def main() -> None:
        transfer = Transfer(f"{endpoint}/obj", ["Range: bytes=0-499999"], 500_000)
        with trio.move_on_after(0.5) as scope:
            await engine.get(transfer)
        assert scope.cancelled_caught
        assert not engine._running  # taken out at once, its connection with it
        behaviour.stall_after = None
        again = await engine.get(Transfer(f"{endpoint}/obj", ["Range: bytes=0-99"], 100))
        assert (again.error, again.status, again.take_body()) == (0, 206, BODY[:100])
        assert again.pieces == []  # let go: the spare handle keeps no body alive
        assert again.header(header_pattern("ETag")) == '"v1"'
        assert again.header(header_pattern("x-goog-generation")) is None

    trio.run(main)
    engine.close()


def test_gets_in_two_runs_one_after_the_other(server) -> None:
    """The driver is a system task of whichever trio run makes GETs: a backend outlives
    a run (the CLI's checks, then the mount)."""
    endpoint, _ = server
    client = gets(endpoint)
    for _ in range(2):
        assert bytes(trio.run(client.get_range, "obj", VERSION, 5, 5)) == BODY[5:10]
    client.close()


def test_a_failing_libcurl_call_fails_the_get_not_the_run(server, monkeypatch) -> None:
    endpoint, _ = server
    engine = TrioCurl(CurlSettings(connections=2))

    def refuse(*_: object) -> None:
        raise pycurl.error(8, "out of memory, say")

    monkeypatch.setattr(engine, "_act", refuse)

    async def main() -> Transfer:
        return await engine.get(Transfer(f"{endpoint}/obj", [], 10))

    try:
        transfer = trio.run(main)
    finally:
        monkeypatch.undo()
        engine.close()
    assert transfer.error == -1 and "out of memory" in transfer.message


# --- Credentials ------------------------------------------------------------------------


class FrozenCredentials:
    def __init__(self, n: int, token: str | None) -> None:
        self.access_key, self.secret_key, self.token = f"AK{n}", f"secret{n}", token


class CountingCredentials:
    """botocore's credentials as SigV4 uses them: `get_frozen_credentials` (which may
    block on the network when a refresh is due)."""

    def __init__(self, token: str | None = None) -> None:
        self.asked = 0
        self.token = token

    def get_frozen_credentials(self) -> FrozenCredentials:
        self.asked += 1
        time.sleep(0.05)  # as a refresh over the network would
        return FrozenCredentials(self.asked, self.token)


class FakeCurl:
    def __init__(self) -> None:
        self.options: dict[int, object] = {}

    def setopt(self, option: int, value: object) -> None:
        self.options[option] = value


def test_sigv4_asks_for_credentials_once_for_many_gets_then_again_when_due():
    credentials = CountingCredentials(token="session-token")
    signer = SigV4(credentials, "eu-west-3")

    async def many() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(signer.ready)

    trio.run(many)
    assert credentials.asked == 1  # the first GETs all waited for the one answer
    curl = FakeCurl()
    signer.apply(curl)  # type: ignore[arg-type]
    assert curl.options[pycurl.AWS_SIGV4] == "aws:amz:eu-west-3:s3"
    assert (curl.options[pycurl.USERNAME], curl.options[pycurl.PASSWORD]) == ("AK1", "secret1")
    assert signer.headers() == ["x-amz-security-token: session-token"]

    trio.run(many)
    assert credentials.asked == 1  # within the check interval: not asked again
    signer._checked -= CREDENTIALS_CHECK_SECONDS + 1  # as if that much time had passed
    trio.run(many)
    assert credentials.asked == 2  # due: one GET asked, the others signed meanwhile
    signer.apply(curl)  # type: ignore[arg-type]
    assert curl.options[pycurl.USERNAME] == "AK2"


class ExpiringToken:
    """google-auth credentials as BearerToken uses them."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.refreshed = 0

    @property
    def valid(self) -> bool:
        return self.token is not None

    def refresh(self, request: object) -> None:
        self.refreshed += 1
        time.sleep(0.05)
        self.token = f"token-{self.refreshed}"


def test_a_bearer_token_is_refreshed_once_when_invalid():
    credentials = ExpiringToken()
    signer = BearerToken(credentials)

    async def many() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(signer.ready)

    trio.run(many)
    assert credentials.refreshed == 1
    assert signer.headers() == ["Authorization: Bearer token-1"]
    credentials.token = None  # expired
    trio.run(many)
    assert credentials.refreshed == 2


def signed_gets(endpoint: str, signer: SigV4 | BearerToken) -> CurlRangedGets:
    return CurlRangedGets(
        CurlSettings(connections=4), signer, url_of=lambda key, version: f"{endpoint}/{key}",
        pinned=lambda version: [f'If-Match: "{version}"'], answered_header="etag",
        where=lambda key: f"test://{key}")


@pytest.mark.parametrize("token", ["session-token", None])
def test_a_get_sends_the_session_token_signed(server, token) -> None:
    # Temporary credentials (an instance role, SSO) are refused by S3 without their
    # token; libcurl copies the header list when it is set, so the token must be in it
    # by then (it once was appended after, and never sent).
    endpoint, behaviour = server
    credentials = CountingCredentials(token=token)
    fetch = signed_gets(endpoint, SigV4(credentials, "eu-west-3"))
    data = trio.run(fetch.get_range, "k", VERSION, 0, 10)
    assert bytes(data) == BODY[:10]
    received = behaviour.headers[-1]
    assert received.get("x-amz-security-token") == token
    signed = received["authorization"].partition("SignedHeaders=")[2].split(",")[0]
    assert ("x-amz-security-token" in signed.split(";")) == (token is not None)
    assert "Credential=AK1/" in received["authorization"]


def test_a_get_sends_the_bearer_token(server) -> None:
    endpoint, behaviour = server
    credentials = ExpiringToken()
    fetch = signed_gets(endpoint, BearerToken(credentials))
    for _ in range(2):
        assert bytes(trio.run(fetch.get_range, "k", VERSION, 0, 10)) == BODY[:10]
    assert [h.get("authorization") for h in behaviour.headers] == ["Bearer token-1"] * 2


# --- Where a GET goes ---------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "style", "bucket", "url", "obstore"), [
    ("http://127.0.0.1:9000", "path", "data", "http://127.0.0.1:9000/data/a%20b/c.jpg",
     {"endpoint": "http://127.0.0.1:9000", "virtual_hosted_style_request": "false"}),
    ("http://127.0.0.1:9000", "virtual", "data", "http://data.127.0.0.1:9000/a%20b/c.jpg",
     {"endpoint": "http://data.127.0.0.1:9000", "virtual_hosted_style_request": "true"}),
    (None, "auto", "data", "https://data.s3.eu-west-3.amazonaws.com/a%20b/c.jpg",
     {"virtual_hosted_style_request": "true"}),
    # A dotted name would not match AWS's wildcard certificate as a virtual host.
    (None, "auto", "my.data", "https://s3.eu-west-3.amazonaws.com/my.data/a%20b/c.jpg",
     {"virtual_hosted_style_request": "false"}),
])
def test_s3_gets_go_where_the_sdk_would(monkeypatch, endpoint, style, bucket, url, obstore):
    """libcurl's GETs and obstore's (S3 Express, the shared tier) alike."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    backend = S3Backend(bucket, BackendSettings(endpoint_url=endpoint, region="eu-west-3",
                                                addressing_style=style))
    try:
        gets = backend._curl_gets
        assert gets is not None and isinstance(gets.signer, SigV4)
        assert gets.url_of("a b/c.jpg", "etag") == url
        assert gets.pinned("etag") == ['If-Match: "etag"']
        config = backend._gets.store.config
        assert {k: config.get(k) for k in obstore} == obstore
        assert ("endpoint" in config) == ("endpoint" in obstore)  # AWS: the region's
    finally:
        backend.close()


def test_an_s3_express_bucket_keeps_obstore(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    backend = S3Backend("data--usw2-az1--x-s3", BackendSettings(region="us-west-2"))
    try:
        assert backend.async_get_range is None  # ObjectStore uses get_range (obstore)
    finally:
        backend.close()


def test_gcs_gets_name_the_generation(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    backend = GcsBackend("data", BackendSettings())
    try:
        gets = backend._curl_gets
        assert isinstance(gets.signer, Unsigned)  # an emulator: anonymous
        assert gets.url_of("ünï/x+y.jpg", "1234") == \
            "http://127.0.0.1:4443/data/%C3%BCn%C3%AF/x%2By.jpg?generation=1234"
        assert gets.pinned("1234") == []
    finally:
        backend.close()


def test_the_ca_bundle_is_the_one_named_else_certifi():
    import certifi

    assert ca_file("/etc/my-ca.pem") == "/etc/my-ca.pem"
    assert ca_file(None) == certifi.where()


class FailingCredentials(CountingCredentials):
    """The chain fails when asked again (a refresh that cannot reach STS, say)."""

    def __init__(self, fail_from: int) -> None:
        super().__init__()
        self.fail_from = fail_from

    def get_frozen_credentials(self) -> FrozenCredentials:
        if self.asked + 1 >= self.fail_from:
            self.asked += 1
            raise RuntimeError("Connect timeout on endpoint URL: sts")
        return super().get_frozen_credentials()


def test_no_credentials_at_all_is_a_transient_error_naming_the_object(server):
    endpoint, behaviour = server
    client = gets(endpoint)
    client.signer = SigV4(FailingCredentials(fail_from=1), "us-east-1")
    with pytest.raises(TransientError, match=r"test://obj: cannot get AWS credentials "
                                             r"\(RuntimeError: Connect timeout"):
        trio.run(client.get_range, "obj", VERSION, 0, 10)
    client.close()
    assert behaviour.requests == []  # nothing unsigned went out


def test_a_failed_refresh_signs_with_the_credentials_there_were(caplog):
    credentials = FailingCredentials(fail_from=2)
    signer = SigV4(credentials, "us-east-1")
    trio.run(signer.ready)
    signer._checked -= CREDENTIALS_CHECK_SECONDS + 1  # a check is due
    trio.run(signer.ready)  # the refresh fails: no error, the old ones stay
    curl = FakeCurl()
    signer.apply(curl)  # type: ignore[arg-type]
    assert (credentials.asked, curl.options[pycurl.USERNAME]) == (2, "AK1")
    assert "cannot get AWS credentials" in caplog.text
    assert "secret1" not in caplog.text
    trio.run(signer.ready)
    assert credentials.asked == 2  # not asked again until the next check is due


class RefusedToken(ExpiringToken):
    def refresh(self, request: object) -> None:
        raise RuntimeError("invalid_grant: account not found")


def test_a_refused_token_refresh_is_a_transient_error():
    with pytest.raises(TransientError, match="cannot refresh the Google credentials"):
        trio.run(BearerToken(RefusedToken()).ready)
