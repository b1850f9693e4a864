"""Two network namespaces joined by a veth pair, with `tc htb` on both ends.

    origin namespace  bfsb-origin   veth bfsb-o  10.201.0.1/30   SeaweedFS + delay proxy
    client namespace  bfsb-client   veth bfsb-c  10.201.0.2/30   mounts and workloads

A run may also shape some TCP ports at their own rate (`PortLink`): a second htb class
per port on both ends, selected by u32 on the port (the source port on the origin end,
whose egress carries the bodies; the destination port on the client end). That gives
two paths over one veth, e.g. a far origin and a near shared cache tier.

Everything is named with the `bfsb-` prefix so that `clean_stale()` can remove what a
crashed run left (processes in our namespaces, the namespaces, their veths) without
touching anything else on the machine. Commands run in a namespace through
`nsenter --net=...`, which switches the network namespace only: a FUSE mount started
that way is visible to every process (`ip netns exec` would make a private mount
namespace and hide it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from bench.harness.scenarios import Link

PREFIX = "bfsb-"
ORIGIN_NS = "bfsb-origin"
CLIENT_NS = "bfsb-client"
ORIGIN_IF, CLIENT_IF = "bfsb-o", "bfsb-c"
ORIGIN_IP, CLIENT_IP = "10.201.0.1", "10.201.0.2"
NETNS_DIR = Path("/run/netns")


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """argv, run in `namespace`'s network (and nothing else of it)."""
    return ["nsenter", f"--net={NETNS_DIR / namespace}", "--", *argv]


def namespaces() -> list[str]:
    result = run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def htb_commands(namespace: str, device: str, mbit: int) -> list[list[str]]:
    """tc commands that cap `device`'s egress at `mbit` (htb, one class).

    The quantum is set explicitly: the default (rate / r2q) is too big for htb at these
    rates and would make it share bandwidth coarsely."""
    return [
        ["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "handle", "1:",
         "htb", "default", "10"],
        ["tc", "-n", namespace, "class", "replace", "dev", device, "parent", "1:",
         "classid", "1:10", "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit",
         "quantum", "60000"],
    ]


@dataclass(frozen=True)
class PortLink:
    """The traffic of one server port, shaped at its own rate beside the default class."""

    port: int
    mbit: int


def port_class_commands(namespace: str, device: str, match: str,
                        port_links: tuple[PortLink, ...]) -> list[list[str]]:
    """tc commands that give each port its own htb class (1:11, 1:12, ...) under the root
    that `htb_commands` made; `match` is "sport" (the server's end, whose egress leaves
    the server port) or "dport" (the client's end). Other traffic stays in 1:10."""
    if match not in ("sport", "dport"):
        raise ValueError(f"match must be sport or dport, not {match!r}")
    commands = []
    for index, link in enumerate(port_links):
        classid = f"1:{11 + index}"
        commands += [
            ["tc", "-n", namespace, "class", "replace", "dev", device, "parent", "1:",
             "classid", classid, "htb", "rate", f"{link.mbit}mbit", "ceil",
             f"{link.mbit}mbit", "quantum", "60000"],
            ["tc", "-n", namespace, "filter", "add", "dev", device, "parent", "1:",
             "protocol", "ip", "prio", "1", "u32", "match", "ip", match, str(link.port),
             "0xffff", "flowid", classid],
        ]
    return commands


def kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process in `namespace` (only ever our own namespaces)."""
    result = run("ip", "netns", "pids", namespace, check=False)
    for pid in (int(p) for p in result.stdout.split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def clean_stale() -> list[str]:
    """Remove our namespaces and veths left by an earlier run; say what was removed."""
    removed = []
    for namespace in namespaces():
        if namespace.startswith(PREFIX):
            kill_namespace_processes(namespace)
            run("ip", "netns", "delete", namespace, check=False)
            removed.append(f"namespace {namespace}")
    # A veth whose peer was moved into a deleted namespace disappears with it; one left
    # in the root namespace (a crash between `link add` and `set netns`) does not.
    links = run("ip", "-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            run("ip", "link", "delete", name, check=False)
            removed.append(f"link {name}")
    return removed


class NetLab:
    """The two namespaces and the shaped veth between them, for the life of a run."""

    def __init__(self, link: Link, port_links: tuple[PortLink, ...] = ()) -> None:
        self.link = link
        self.port_links = port_links

    def start(self) -> Self:
        try:
            for namespace in (ORIGIN_NS, CLIENT_NS):
                run("ip", "netns", "add", namespace)
                run("ip", "-n", namespace, "link", "set", "lo", "up")
            run("ip", "link", "add", ORIGIN_IF, "type", "veth", "peer", "name", CLIENT_IF)
            run("ip", "link", "set", ORIGIN_IF, "netns", ORIGIN_NS)
            run("ip", "link", "set", CLIENT_IF, "netns", CLIENT_NS)
            for namespace, device, address in ((ORIGIN_NS, ORIGIN_IF, ORIGIN_IP),
                                               (CLIENT_NS, CLIENT_IF, CLIENT_IP)):
                run("ip", "-n", namespace, "addr", "add", f"{address}/30", "dev", device)
                run("ip", "-n", namespace, "link", "set", device, "up")
                match = "sport" if namespace == ORIGIN_NS else "dport"
                for command in (htb_commands(namespace, device, self.link.mbit)
                                + port_class_commands(namespace, device, match,
                                                      self.port_links)):
                    run(*command)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for namespace in (ORIGIN_NS, CLIENT_NS):
            if namespace in namespaces():
                kill_namespace_processes(namespace)
                run("ip", "netns", "delete", namespace, check=False)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
