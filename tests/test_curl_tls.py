"""libcurl's GETs over HTTPS, against test_curl_gets.py's server behind TLS with a
certificate from a CA of the test's own (trustme): the server is verified against the
CA bundle named (AWS_CA_BUNDLE for S3), and one that no trusted CA signed is refused
at once, not retried. AWS itself is out of reach here."""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Iterator

import pytest
import trio
import trustme

from bucketfs.backends.base import BackendError, TransientError
from bucketfs.backends.s3 import S3Backend
from bucketfs.backends.settings import BackendSettings
from tests.test_curl_gets import BODY, VERSION, Behaviour, Handler, Server, gets


@pytest.fixture
def tls_server(tmp_path) -> Iterator[tuple[str, str, Behaviour]]:
    """(https endpoint, the CA bundle that signed its certificate, its behaviour)."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.behaviour = Behaviour()  # type: ignore[attr-defined]
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield (f"https://127.0.0.1:{httpd.server_address[1]}", str(bundle),
           httpd.behaviour)  # type: ignore[attr-defined]
    httpd.behaviour.release.set()  # type: ignore[attr-defined]
    httpd.shutdown()
    httpd.server_close()


def test_a_get_over_https_verifies_the_server_against_the_named_ca(tls_server):
    endpoint, bundle, behaviour = tls_server
    with contextlib.closing(gets(endpoint, ca_file=bundle)) as client:  # type: ignore[arg-type]
        data = trio.run(client.get_range, "obj", VERSION, 1000, 99_000)
    assert bytes(data) == BODY[1000:100_000]
    assert behaviour.requests == ["/obj"]


def test_a_server_no_trusted_ca_signed_is_refused_and_not_retried(tls_server):
    """certifi's bundle (the default) does not hold the test's CA: a permanent error
    (BackendError, not TransientError), and no request reaches the server."""
    endpoint, _, behaviour = tls_server
    with contextlib.closing(gets(endpoint)) as client, \
            pytest.raises(BackendError, match=r"request failed \(curl error 60") as failure:
        trio.run(client.get_range, "obj", VERSION, 0, 100)
    assert not isinstance(failure.value, TransientError)
    assert behaviour.requests == []


def test_s3_gets_over_https_trust_the_bundle_in_aws_ca_bundle(tls_server, monkeypatch):
    """As boto3 reads it: the S3 backend's own GETs (libcurl, signed) use that bundle."""
    endpoint, bundle, behaviour = tls_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_CA_BUNDLE", bundle)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    settings = BackendSettings(endpoint_url=endpoint, region="eu-west-3",
                               addressing_style="path")
    with contextlib.closing(S3Backend("data", settings)) as backend:
        data = trio.run(backend.async_get_range, "a b/c.jpg", VERSION, 5, 4096)
    assert bytes(data) == BODY[5:4101]
    assert behaviour.requests == ["/data/a%20b/c.jpg"]
