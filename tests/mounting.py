"""Mounting for real in tests: `bucketfs mount` as a user runs it, and helpers to
compare what the mount shows with what the bucket holds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bucketfs.runtime import daemon_pid as recorded_pid
from bucketfs.runtime import mounted as mount_entry


def bucketfs(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
             ) -> subprocess.CompletedProcess[str]:
    """The CLI, imported as the daemon imports it: with -P (not from the working
    directory), so a PYTHONPATH naming another checkout (bench.compare_trees) runs that
    checkout's CLI, whose options its daemon knows."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "bucketfs", *args], capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=timeout,
    )


def drop_page_cache() -> None:
    """So that the next read reaches the daemon instead of the kernel's copy (with
    kernel_opens the kernel keeps a file's pages across opens). Root only."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def force_unmount(mountpoint: Path) -> None:
    if mount_entry(str(mountpoint)) is not None:
        subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


@contextlib.contextmanager
def mounted(url: str, mountpoint: Path, *args: str, env: dict[str, str] | None = None,
            ) -> Iterator[Path]:
    """Mount as a user would (daemonized), yield the mountpoint, always unmount."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    log_file = mountpoint.parent / f"{mountpoint.name}.log"
    result = bucketfs("mount", url, str(mountpoint), "--log-file", str(log_file), *args, env=env)
    assert result.returncode == 0, f"mount failed: {result.stderr}\n{read_log(log_file)}"
    assert mount_entry(str(mountpoint.resolve())) is not None
    try:
        yield mountpoint
    finally:
        result = bucketfs("umount", str(mountpoint))
        force_unmount(mountpoint)
        assert result.returncode == 0, f"umount failed: {result.stderr}"


def wait_for_foreground_mount(process: subprocess.Popen[str], mountpoint: Path,
                              timeout: float = 30) -> None:
    """Wait until a `bucketfs mount --foreground` process has mounted `mountpoint`;
    fail with its stderr if it exits first."""
    deadline = time.monotonic() + timeout
    while mount_entry(str(mountpoint)) is None:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "mount did not become ready"
        time.sleep(0.05)


def daemon_pid(mountpoint: Path) -> int:
    """The pid of the daemon serving `mountpoint` (the one its state directory records)."""
    pid = recorded_pid(str(mountpoint))
    assert pid is not None, f"no daemon pid recorded for {mountpoint}"
    return pid


def read_log(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def tree(root: Path) -> dict[str, str]:
    """relative path -> "dir" or the file's sha256, walking with plain os calls."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = sha256_file(path)
    return out


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def expected_tree(objects: dict[str, bytes], prefix: str = "") -> dict[str, str]:
    """What a mount of `prefix` must show for these keys, per the rules in namespace.py:
    markers and prefixes are directories, a directory hides a same-named object, and
    keys with empty, '.', '..', NUL-holding or over-long segments are left out (a name
    from a local directory that is not UTF-8 counts the bytes it stands for)."""
    out: dict[str, str] = {}
    for key, data in objects.items():
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix):].split("/")
        is_marker = parts[-1] == "" and len(parts) > 1
        if is_marker:
            parts = parts[:-1]
        bad = [i for i, p in enumerate(parts) if p in ("", ".", "..") or "\0" in p
               or len(p.encode("utf-8", "surrogateescape")) > 255]
        if bad:
            # The directories above the first bad segment still exist.
            for depth in range(1, bad[0] + 1):
                out["/".join(parts[:depth])] = "dir"
            continue
        for depth in range(1, len(parts)):
            out["/".join(parts[:depth])] = "dir"
        path = "/".join(parts)
        if is_marker:
            out[path] = "dir"
        elif out.get(path) != "dir":
            out[path] = hashlib.sha256(data).hexdigest()
    return out


def metrics(port: int) -> dict[str, float]:
    """A mount's /metrics on `port`, as {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(bucketfs_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)", line)
        if match:
            values[match[1] + (match[2] or "")] = float(match[3])
    return values


def status_json(mountpoint: Path) -> dict:
    """`bucketfs status --json` of a mount, parsed."""
    result = bucketfs("status", str(mountpoint), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def written_through(mountpoint: Path, timeout: float = 10) -> None:
    """Wait until the mount's SSD tier has nothing queued: the write-through gathers a
    batch for up to 50 ms before it writes (bucketfs/cache/tiered.py)."""
    from bucketfs.hints.client import Target
    from bucketfs.hints.control import status

    target = Target(str(Path(mountpoint).resolve()), os.getuid())
    deadline = time.monotonic() + timeout
    while True:  # the status over the control socket: no CLI process per poll
        ssd = [t for t in status(target)["cache"]["tiers"] if t["name"] == "ssd"]
        if not ssd or not ssd[0]["write_queue_bytes"]:
            return
        assert time.monotonic() < deadline, "the write-through never finished"
        time.sleep(0.05)
