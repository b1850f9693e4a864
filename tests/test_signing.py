"""What AWS and GCS check of every request and the test servers do not, so a proxy in
front of SeaweedFS and fake-gcs-server checks it as they would:

- Temporary credentials: an S3 session token (an instance or pod role, SSO, an assumed
  role) and a GCS OAuth token, on every request, the daemon's libcurl GETs included. A
  request without them is refused (403 / 401) and never forwarded. The daemon's GETs
  once left both out (libcurl had copied the header list before the credential was
  added to it), so `ls` worked and every read failed.
- The bucket's region: a request signed for another region is refused with S3's answer
  naming the right one. boto3 follows that answer for its own requests; the daemon's
  GETs once kept signing for the configured region, so every read failed.
- Who pays: a requester-pays bucket refuses a request that does not say the requester
  pays (S3) or which project to bill (GCS).
"""

from __future__ import annotations

import datetime
import json
import os
import random
from unittest import mock

import boto3
import pytest
import trio
from botocore.config import Config
from botocore.exceptions import ClientError
from google.oauth2.credentials import Credentials as TokenCredentials

from bucketfs.backends import gcs
from bucketfs.backends.base import AccessDenied
from bucketfs.backends.gcs import GcsBackend
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.s3 import S3Backend
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.store import ObjectStore
from tests.faultproxy import FaultProxy
from tests.mounting import bucketfs, mounted, read_log
from tests.sigv4 import sigv4_signer

TOKEN = "IQoJb3JpZ2luX2VjEXAMPLEsessionTOKEN" + "x" * 40
MiB = 1024**2
FILES = {name: random.Random(name).randbytes(size) for name, size in [
    ("small.jpg", 100_000), ("two/deep.jpg", 50_000), ("large.bin", 9 * MiB),
]}


def filled_bucket(server, prefix: str) -> str:
    """A new bucket on `server` holding FILES."""
    bucket = f"{prefix}-{os.urandom(4).hex()}"
    server.create_bucket(bucket)
    for name, data in FILES.items():
        server.put(bucket, name, data)
    return bucket


def resigning(s3_server):
    """The proxy's signer for requests it changed (a credential header taken off)."""
    return sigv4_signer(s3_server.access_key, s3_server.secret_key, s3_server.region)


@pytest.fixture
def token_gated_s3(s3_server, fault_proxy):
    """SeaweedFS behind a proxy that wants TOKEN, signed, in every request."""
    proxy = fault_proxy(s3_server.endpoint, signer=resigning(s3_server))
    proxy.require_credential("x-amz-security-token", TOKEN, signed=True)
    return filled_bucket(s3_server, "session"), proxy


def client(s3_server, endpoint: str, token: str | None):
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name=s3_server.region,
        aws_access_key_id=s3_server.access_key, aws_secret_access_key=s3_server.secret_key,
        aws_session_token=token,
        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}))


def test_the_gate_refuses_a_request_without_the_token(s3_server, token_gated_s3):
    bucket, proxy = token_gated_s3
    with pytest.raises(ClientError) as caught:
        client(s3_server, proxy.endpoint, None).head_object(Bucket=bucket, Key="small.jpg")
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError):
        client(s3_server, proxy.endpoint, "another").head_object(Bucket=bucket, Key="small.jpg")
    answer = client(s3_server, proxy.endpoint, TOKEN).get_object(Bucket=bucket, Key="small.jpg")
    assert answer["Body"].read() == FILES["small.jpg"]
    assert proxy.refused == 2


@pytest.mark.fuse
def test_a_mount_with_a_session_token_reads_every_byte(s3_server, token_gated_s3, tmp_path):
    bucket, proxy = token_gated_s3
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_SESSION_TOKEN": TOKEN}
    mountpoint = tmp_path / "mnt"
    with mounted(f"s3://{bucket}", mountpoint, "--addressing-style", "path",
                 "--retry-attempts", "1", env=env):
        for name, data in FILES.items():
            assert (mountpoint / name).read_bytes() == data
    gets = [status for method, _, status in proxy.answers if method == "GET"]
    # The listing (boto3) and the reads (libcurl: the large file in several ranges).
    assert len(gets) >= 1 + len(FILES) and set(gets) <= {200, 206}, gets
    assert proxy.refused == 0
    log = read_log(tmp_path / "mnt.log")
    assert TOKEN not in log and s3_server.secret_key not in log


@pytest.fixture
def token_gated_gcs(gcs_server, fault_proxy):
    proxy = fault_proxy(gcs_server.endpoint, flavor="gcs")
    proxy.require_credential("authorization", f"Bearer {TOKEN}")
    return filled_bucket(gcs_server, "session"), proxy


def gcs_backend(bucket: str, proxy: FaultProxy, token: str | None,
                **settings: object) -> GcsBackend:
    """A GCS backend through the proxy, with an OAuth token as google.auth.default()
    gives one on a node (the emulator's settings would otherwise make it anonymous)."""
    if token is None:
        credentials = gcs.AnonymousCredentials()
    else:
        # google-auth compares a naive UTC expiry.
        expiry = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        credentials = TokenCredentials(token, expiry=expiry + datetime.timedelta(hours=1))
    with (mock.patch.dict(os.environ, {"STORAGE_EMULATOR_HOST": proxy.endpoint}),
          mock.patch.object(gcs, "_credentials", lambda *_: (credentials, "test"))):
        return GcsBackend(bucket, BackendSettings(**settings))  # type: ignore[arg-type]


def test_gcs_gets_carry_the_oauth_token(token_gated_gcs):
    bucket, proxy = token_gated_gcs
    backend = gcs_backend(bucket, proxy, TOKEN)
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))
    try:
        for name, data in FILES.items():
            version = backend.head(name).version  # the SDK's request
            got = trio.run(store.get_range, name, version, 0, len(data))  # libcurl's
            assert bytes(got) == data
            assert bytes(trio.run(store.get_range, name, version, 7, 1000)) == data[7:1007]
    finally:
        backend.close()
    assert proxy.refused == 0


def test_gcs_without_the_token_is_refused_by_the_gate(token_gated_gcs):
    bucket, proxy = token_gated_gcs
    backend = gcs_backend(bucket, proxy, None)
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))
    try:
        with pytest.raises(AccessDenied):
            trio.run(store.get_range, "small.jpg", "1", 0, 10)
    finally:
        backend.close()
    assert proxy.refused >= 1


@pytest.fixture
def bucket_elsewhere(s3_server, fault_proxy):
    """SeaweedFS behind a proxy that answers as S3 for a bucket in eu-west-3."""
    proxy = fault_proxy(s3_server.endpoint)
    proxy.bucket_region("eu-west-3")
    return filled_bucket(s3_server, "region"), proxy


@pytest.mark.fuse
def test_a_bucket_in_another_region_than_configured_is_read(s3_server, bucket_elsewhere,
                                                             tmp_path):
    # A node's AWS_REGION names where it runs, not where each bucket is. boto3 follows
    # S3's answer for its own requests; the daemon's GETs must sign for that region too,
    # also after a remount, whose access check is a HEAD of an object it knew, no LIST.
    bucket, proxy = bucket_elsewhere
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint,
           "AWS_DEFAULT_REGION": "us-west-2"}
    mountpoint, names = tmp_path / "mnt", list(FILES)
    args = ("--addressing-style", "path", "--retry-attempts", "1",
            "--cache-dir", str(tmp_path / "cache"))
    with mounted(f"s3://{bucket}", mountpoint, *args, env=env):
        assert (mountpoint / names[0]).read_bytes() == FILES[names[0]]
    proxy.clear()
    with mounted(f"s3://{bucket}", mountpoint, *args, env=env):
        for name in names:
            assert (mountpoint / name).read_bytes() == FILES[name]
    # The remount kept its listing: its access check was a HEAD of a file it knew.
    method, path = proxy.requests[0]
    assert method == "HEAD" and path.removeprefix(f"/{bucket}/") in FILES
    log = read_log(tmp_path / "mnt.log")
    assert log.count("is in eu-west-3, not us-west-2") == 2  # said at each mount
    # Only each mount's first request may be signed for the wrong region.
    assert proxy.wrong_region <= 2, proxy.wrong_region


@pytest.mark.parametrize("head_bucket", ["allowed", "refused"])
def test_both_get_paths_follow_the_buckets_region(s3_server, bucket_elsewhere, head_bucket):
    bucket, proxy = bucket_elsewhere
    if head_bucket == "refused":  # S3 still names the region in the 403
        proxy.add_rule(method="HEAD", path_contains=f"/{bucket}", action="status:403",
                       times=1)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint,
           "AWS_DEFAULT_REGION": "us-west-2"}
    with mock.patch.dict(os.environ, env):
        backend = S3Backend(bucket, BackendSettings(addressing_style="path"))
    try:
        backend.check_access()
        data = FILES["small.jpg"]
        version = backend.head("small.jpg").version
        store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))
        assert bytes(trio.run(store.get_range, "small.jpg", version, 0, len(data))) == data
        assert bytes(backend.get_range("small.jpg", version, 5, 500)) == data[5:505]  # obstore
    finally:
        backend.close()
    assert proxy.wrong_region == 1  # the first listing, which boto3 followed


def test_the_shared_tier_signs_for_its_buckets_region(s3_server, bucket_elsewhere):
    from bucketfs.cache.shared_store import SharedStore

    bucket, proxy = bucket_elsewhere
    with mock.patch.dict(os.environ, {**s3_server.env(), "AWS_DEFAULT_REGION": "us-west-2"}):
        store = SharedStore(f"s3://{bucket}/team", BackendSettings(
            endpoint_url=proxy.endpoint, addressing_style="path"), timeout=5.0)
    store.put("team/blocks/one", b"a block", {"origin": "s3://data"})
    fetched = store.get("team/blocks/one")
    assert fetched is not None and bytes(fetched.data) == b"a block"
    assert fetched.metadata["origin"] == "s3://data"
    assert proxy.wrong_region == 1  # the HeadBucket that asked where the bucket is


NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                  "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}


@pytest.fixture(scope="module")
def public_bucket(s3_server):
    """A bucket whose policy lets anyone list and read it, as AWS's open datasets."""
    bucket = filled_bucket(s3_server, "public")
    s3_server.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps({
        "Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject", "s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}))
    return bucket


@pytest.mark.fuse
def test_a_public_bucket_is_read_without_credentials(s3_server, public_bucket, tmp_path):
    env = {**s3_server.env(), **NO_CREDENTIALS}
    mountpoint = tmp_path / "mnt"
    with mounted(f"s3://{public_bucket}", mountpoint, "--addressing-style", "path",
                 "--no-sign-request", env=env):
        for name, data in FILES.items():
            assert (mountpoint / name).read_bytes() == data


@pytest.mark.fuse
def test_without_credentials_the_mount_says_how_to_read_a_public_bucket(
        s3_server, public_bucket, tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    env = {**s3_server.env(), **NO_CREDENTIALS}
    result = bucketfs("mount", f"s3://{public_bucket}", str(mountpoint), "--addressing-style",
                      "path", "--log-file", str(tmp_path / "mnt.log"), env=env)
    assert result.returncode != 0
    assert "no usable AWS credentials" in result.stderr
    assert "--no-sign-request" in result.stderr


def test_unsigned_requests_to_a_private_bucket_are_denied(s3_server, token_gated_s3):
    # The gated bucket has no public policy: unsigned, S3 (here SeaweedFS) says no.
    bucket, _ = token_gated_s3
    with mock.patch.dict(os.environ, {**s3_server.env(), **NO_CREDENTIALS}):
        backend = S3Backend(bucket, BackendSettings(addressing_style="path",
                                                    s3_unsigned=True))
    try:
        with pytest.raises(AccessDenied):
            backend.check_access()
        store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))
        with pytest.raises(AccessDenied):  # the daemon's GET, unsigned too
            trio.run(store.get_range, "small.jpg", "any", 0, 10)
    finally:
        backend.close()


def test_the_shared_tier_is_signed_where_the_origin_is_read_unsigned(monkeypatch):
    from bucketfs import mount
    from bucketfs.config import load_config

    made: list[BackendSettings] = []
    monkeypatch.setattr(mount, "SharedStore",
                        lambda url, settings, timeout: made.append(settings))
    config = load_config(None, {"sign_request": False, "shared": "s3://team-cache/x"})
    assert mount.backend_settings(config).s3_unsigned
    mount.open_shared_store(config)
    assert made and not made[0].s3_unsigned  # the tier writes: it needs the credentials


@pytest.fixture
def requester_pays(s3_server, fault_proxy):
    """SeaweedFS behind a proxy that refuses a request not saying the requester pays,
    as S3 does for a requester-pays bucket read by another account."""
    proxy = fault_proxy(s3_server.endpoint, signer=resigning(s3_server))
    proxy.require_credential("x-amz-request-payer", "requester", signed=True)
    return filled_bucket(s3_server, "payer"), proxy


@pytest.mark.fuse
def test_a_requester_pays_bucket_is_read(s3_server, requester_pays, tmp_path):
    bucket, proxy = requester_pays
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    mountpoint = tmp_path / "mnt"
    with mounted(f"s3://{bucket}", mountpoint, "--addressing-style", "path",
                 "--retry-attempts", "1", "--requester-pays", env=env):
        for name, data in FILES.items():
            assert (mountpoint / name).read_bytes() == data
    # Refused: at most the HeadBucket that looks for the region (it takes no payer).
    assert proxy.refused <= 1
    assert all(status in (200, 206) for _, _, status in proxy.answers)


@pytest.mark.fuse
def test_a_requester_pays_bucket_refuses_a_mount_without_the_flag(
        s3_server, requester_pays, tmp_path):
    bucket, proxy = requester_pays
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    result = bucketfs("mount", f"s3://{bucket}", str(mountpoint), "--addressing-style",
                      "path", "--retry-attempts", "1", "--log-file", str(tmp_path / "mnt.log"),
                      env=env)
    assert result.returncode != 0 and "access denied" in result.stderr.lower()


def test_obstores_gets_say_the_requester_pays(s3_server, requester_pays):
    bucket, proxy = requester_pays
    with mock.patch.dict(os.environ, {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}):
        backend = S3Backend(bucket, BackendSettings(addressing_style="path",
                                                    s3_requester_pays=True))
    try:
        data = FILES["small.jpg"]
        version = backend.head("small.jpg").version
        assert bytes(backend.get_range("small.jpg", version, 9, 900)) == data[9:909]
    finally:
        backend.close()
    assert proxy.refused == 0


BILLED = "team-billing-project"


@pytest.fixture
def requester_pays_gcs(gcs_server, fault_proxy):
    """fake-gcs-server behind a proxy that refuses a request naming no project to bill,
    as GCS does for a requester-pays bucket (400, with its message): the JSON API takes
    the project as `userProject`, the XML API as the x-goog-user-project header."""
    proxy = fault_proxy(gcs_server.endpoint, flavor="gcs")
    proxy.require_credential("x-goog-user-project", BILLED, param="userProject", refusal=(
        400, "Bucket is a requester pays bucket but no user project provided."))
    return filled_bucket(gcs_server, "billed"), proxy


@pytest.mark.fuse
def test_a_requester_pays_gcs_bucket_is_read_billing_the_project(
        requester_pays_gcs, tmp_path):
    bucket, proxy = requester_pays_gcs
    mountpoint = tmp_path / "mnt"
    with mounted(f"gs://{bucket}", mountpoint, "--retry-attempts", "1",
                 "--billing-project", BILLED, env={"STORAGE_EMULATOR_HOST": proxy.endpoint}):
        for name, data in FILES.items():
            assert (mountpoint / name).read_bytes() == data
    assert proxy.refused == 0
    json_api = [path for _, path in proxy.requests if path.startswith("/storage/")]
    xml_gets = [path for method, path in proxy.requests
                if method == "GET" and path.startswith(f"/{bucket}/")]
    assert json_api and len(xml_gets) >= len(FILES)  # the listing (SDK), the reads (libcurl)


@pytest.mark.fuse
def test_a_requester_pays_gcs_bucket_without_a_project_says_which_option(
        requester_pays_gcs, tmp_path):
    bucket, proxy = requester_pays_gcs
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = bucketfs("mount", f"gs://{bucket}", str(mountpoint), "--retry-attempts", "1",
                      "--log-file", str(tmp_path / "mnt.log"),
                      env={"STORAGE_EMULATOR_HOST": proxy.endpoint})
    assert result.returncode != 0
    assert "requester-pays" in result.stderr and "--billing-project" in result.stderr
    assert proxy.refused >= 1


def test_obstores_gcs_gets_name_the_project_to_bill(requester_pays_gcs):
    bucket, proxy = requester_pays_gcs
    backend = gcs_backend(bucket, proxy, None, gcs_billing_project=BILLED)
    try:
        data = FILES["two/deep.jpg"]
        version = backend.head("two/deep.jpg").version  # the SDK's
        assert bytes(backend.get_range("two/deep.jpg", version, 5, 700)) == data[5:705]
    finally:
        backend.close()
    xml_gets = [path for method, path in proxy.requests
                if method == "GET" and not path.startswith("/storage/")]
    assert proxy.refused == 0 and len(xml_gets) == 1  # obstore's, through the XML API


def test_a_project_billed_needs_credentials():
    from bucketfs.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs credentials"):
        load_config(None, {"anonymous": True, "billing_project": BILLED})
