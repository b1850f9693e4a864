"""Faults while mounted, injected by a proxy between the mount and a real S3 server:
throttling, 5xx, dropped connections and truncated bodies are retried; after the retry
budget only that read fails with EIO; wrong bytes are never returned; and the
credentials never reach the logs."""

from __future__ import annotations

import errno
import random

import pytest

from tests.mounting import bucketfs, metrics, mounted, read_log, status_json
from tests.servers import free_ports

pytestmark = pytest.mark.fuse

MiB = 1024**2
FILES = {name: random.Random(name).randbytes(size) for name, size in [
    ("good.bin", 200_000), ("flaky.bin", 150_000), ("broken.bin", 100_000),
    ("cut.bin", 300_000), ("dropped.bin", 120_000), ("large.bin", 6 * MiB),
]}


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.create_bucket("faults")
    for name, data in FILES.items():
        s3_server.put("faults", name, data)
    return "faults"


@pytest.fixture
def metrics_port() -> int:
    return free_ports(1)[0]


@pytest.fixture
def proxied_mount(s3_server, bucket, fault_proxy, metrics_port, tmp_path):
    proxy = fault_proxy(s3_server.endpoint)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    with mounted(f"s3://{bucket}", tmp_path / "mnt", "--addressing-style", "path",
                 "--retry-attempts", "4", "--retry-base-delay", "0.01",
                 "--retry-max-delay", "0.05", "--read-timeout", "5",
                 "--metrics-port", str(metrics_port), env=env) as mnt:
        yield proxy, mnt, tmp_path / "mnt.log", s3_server


def test_transient_faults_are_retried_to_the_right_bytes(proxied_mount):
    proxy, mnt, _, _ = proxied_mount
    proxy.add_rule(method="GET", path_contains="flaky.bin", action="status:503", times=2)
    proxy.add_rule(method="GET", path_contains="good.bin", action="status:500", times=1)
    proxy.add_rule(method="GET", path_contains="cut.bin", action="truncate", times=2)
    proxy.add_rule(method="GET", path_contains="dropped.bin", action="drop", times=2)
    for name in ("flaky.bin", "good.bin", "cut.bin", "dropped.bin"):
        assert (mnt / name).read_bytes() == FILES[name]
    assert proxy.count("GET", "flaky.bin") == 3
    assert proxy.count("GET", "cut.bin") == 3


def test_exhausted_retries_fail_that_read_only(proxied_mount):
    proxy, mnt, log_file, _ = proxied_mount
    proxy.add_rule(method="GET", path_contains="broken.bin", action="status:503")
    with pytest.raises(OSError) as info:
        (mnt / "broken.bin").read_bytes()
    assert info.value.errno == errno.EIO
    # The kernel may ask twice (its read-ahead, then the read itself); each request to
    # the daemon spends the whole retry budget, no more.
    failures = failed_requests(mnt)
    assert failures >= 1
    assert proxy.count("GET", "broken.bin") == 4 * failures
    assert "'broken.bin' [0, 100000) failed after 4 attempts" in read_log(log_file)
    # Everything else is still served.
    assert (mnt / "good.bin").read_bytes() == FILES["good.bin"]
    assert (mnt / "large.bin").read_bytes() == FILES["large.bin"]


def failed_requests(mnt) -> int:
    return status_json(mnt)["errors"]["failed_requests"]


def test_a_client_rereading_a_refused_file_cannot_flood_the_log(proxied_mount, metrics_port):
    """Each read fails alone, each is counted, and the log says it once a minute: a
    line per failed request would let any reader fill the log's disk."""
    proxy, mnt, log_file, _ = proxied_mount
    proxy.add_rule(method="GET", path_contains="broken.bin", action="status:403")
    for _ in range(30):
        with pytest.raises(OSError) as info:
            (mnt / "broken.bin").read_bytes()
        assert info.value.errno == errno.EIO
    failures = failed_requests(mnt)
    assert failures >= 30 and proxy.count("GET", "broken.bin") == failures  # no retries
    assert metrics(metrics_port)['bucketfs_fuse_errors_total{operation="read"}'] == failures
    lines = [line for line in read_log(log_file).splitlines() if "broken.bin" in line]
    assert len(lines) == 1, lines
    assert "ERROR" in lines[0] and "read:" in lines[0]
    # The mount goes on serving what it can.
    assert (mnt / "good.bin").read_bytes() == FILES["good.bin"]


def test_truncation_never_returns_wrong_bytes(proxied_mount):
    proxy, mnt, _, _ = proxied_mount
    proxy.add_rule(method="GET", path_contains="large.bin", action="truncate")
    with pytest.raises(OSError) as info:
        (mnt / "large.bin").read_bytes()
    assert info.value.errno == errno.EIO
    proxy.clear()
    assert (mnt / "large.bin").read_bytes() == FILES["large.bin"]


def test_credentials_stay_out_of_logs(proxied_mount):
    proxy, mnt, log_file, server = proxied_mount
    proxy.add_rule(method="GET", path_contains="broken.bin", action="status:503")
    with pytest.raises(OSError):
        (mnt / "broken.bin").read_bytes()
    log = read_log(log_file)
    assert log, "the daemon logged nothing"
    assert server.secret_key not in log and server.access_key not in log
    assert "Signature=" not in log and "Authorization" not in log


def test_mount_time_origin_errors(s3_server, bucket, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    path_style = ("--addressing-style", "path")

    def mount(url, **env):
        return bucketfs("mount", url, str(mnt), *path_style, env={**s3_server.env(), **env})

    result = mount("s3://no-such-bucket-here")
    assert result.returncode == 1 and "no such bucket" in result.stderr.lower()
    wrong_secret = "WRONG" + s3_server.secret_key[5:]
    result = mount(f"s3://{bucket}", AWS_SECRET_ACCESS_KEY=wrong_secret)
    assert result.returncode == 1 and "access denied" in result.stderr.lower()
    assert wrong_secret not in result.stderr and s3_server.access_key not in result.stderr
    result = mount(f"s3://{bucket}", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    assert result.returncode == 1
    assert "127.0.0.1:9" in result.stderr
    for result_lines in (result.stderr.strip().splitlines(),):
        assert len(result_lines) == 1
    from bucketfs.runtime import mounted as mount_entry
    assert mount_entry(str(mnt)) is None


def test_gcs_mount_time_errors(gcs_server, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = bucketfs("mount", "gs://no-such-gcs-bucket", str(mnt), env=gcs_server.env())
    assert result.returncode == 1 and "no such bucket" in result.stderr.lower()
    result = bucketfs("mount", "gs://whatever", str(mnt),
                      env={"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"})
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
