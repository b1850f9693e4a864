"""Nothing a client sends over the hints socket takes the mount down, on a real mount:
an order holding one path of ~1,900 segments (it used to raise RecursionError in the
daemon and unmount it), orders whose directories cannot be listed (an expired token),
garbage frames and a flood of orders. Each fails that order with an error reply or
one log line; the mount serves on and the next good order is prefetched."""

from __future__ import annotations

import os
import socket
import time

import pytest

from bucketfs.hints import location
from bucketfs.hints.client import Target, request
from bucketfs.hints.protocol import Order
from tests.mounting import metrics, mounted, read_log
from tests.servers import free_ports

pytestmark = pytest.mark.fuse

FILES = {f"a/{i}.bin": bytes([i]) * 5_000 for i in range(6)} | {"deny/x.bin": b"x" * 100}


def wait_for(port: int, name: str, at_least: float) -> dict[str, float]:
    for _ in range(200):
        values = metrics(port)
        if values.get(name, 0) >= at_least:
            return values
        time.sleep(0.05)
    return values


def test_hostile_hints_fail_their_order_and_never_the_mount(s3_server, fault_proxy, tmp_path):
    s3_server.create_bucket("hostile")
    for key, data in FILES.items():
        s3_server.put("hostile", key, data)
    proxy = fault_proxy(s3_server.endpoint)
    # Listing deny/ is refused (403 is not retried): an expired token, say.
    proxy.add_rule(method="GET", path_contains="prefix=deny", action="status:403")
    port = free_ports(1)[0]
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    with mounted("s3://hostile", tmp_path / "mnt", "--addressing-style", "path",
                 "--metrics-port", str(port), "--retry-attempts", "2", env=env) as mnt:
        target = Target(str(mnt.resolve()), os.getuid())
        deep = "/".join(["a"] * 1_900) + "/0.bin"

        def send(paths: list[str], job: str, epoch: int = 0):
            return request(target, Order(job, 0, 1, epoch, paths))

        assert send([deep, "a/0.bin"], "deep").ok
        assert send(["deny/x.bin", "a/1.bin"], "denied").ok  # resolved later: it fails then
        sock = location.socket_path(str(mnt.resolve()))
        for garbage in (b"\0" * 12, b"BFSH\x01\x01\x00\x00\xff\xff\xff\xff", os.urandom(64)):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(sock))
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(4096)[:4] == b"BFSH"  # an error reply, not a dead daemon
        replies = [send(["a/2.bin"], f"flood-{i}") for i in range(80)]
        assert all(reply.ok or "limit" in reply.reason for reply in replies)
        values = wait_for(port, "bucketfs_prefetch_started_total", 1)
        assert send(["a/3.bin", "a/4.bin", "a/5.bin"], "good").ok
        for key, data in FILES.items():
            if not key.startswith("deny"):
                assert (mnt / key).read_bytes() == data
        values = wait_for(port, "bucketfs_hints_orders_total", 83)
        assert values["bucketfs_prefetch_started_total"] >= 3
    log = read_log(tmp_path / "mnt.log")
    assert "Traceback" not in log
    dropped = [line for line in log.splitlines() if "was dropped" in line]
    assert len(dropped) == 1 and "deny" in dropped[0], dropped
