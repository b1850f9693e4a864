"""A FUSE mount daemon run in the foreground as our child: started, timed to its first
byte, measured, and unmounted whatever happens.

Every contender's daemon (bucketfs, s3fs, rclone) runs in the foreground, in the client
namespace, so its pid is ours to measure and its traffic crosses the shaped link.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.netlab import CLIENT_NS, in_namespace
from bench.harness.procstats import cpu_seconds, peak_rss_mib

MOUNT_TIMEOUT = 120.0
EXIT_TIMEOUT = 60.0


@dataclass
class MountSpec:
    """How to run one contender's daemon in the foreground on `mountpoint`."""

    argv: list[str]
    mountpoint: Path
    env: dict[str, str] = field(default_factory=dict)


def mounted_paths() -> list[str]:
    """Every mountpoint in this mount namespace (octal escapes decoded)."""
    paths = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            paths.append(raw.encode().decode("unicode_escape"))
    return paths


def is_mounted(path: Path) -> bool:
    return str(path) in mounted_paths()


def force_unmount(path: Path) -> None:
    """Unmount now, busy or not (a lazy unmount detaches it from the tree at once)."""
    for argv in (["umount", str(path)], ["umount", "-l", str(path)]):
        if not is_mounted(path):
            return
        subprocess.run(argv, capture_output=True, check=False)


def clean_stale_mounts(base: Path) -> list[str]:
    """Unmount whatever an earlier run left mounted under base."""
    stale = [p for p in mounted_paths() if p == str(base) or p.startswith(f"{base}/")]
    for path in sorted(stale, reverse=True):  # deepest first
        force_unmount(Path(path))
    return stale


class MountProcess:
    def __init__(self, spec: MountSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned_at = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, first_file: Path) -> float:
        """Spawn the daemon and read one byte of first_file (a path under the
        mountpoint) as soon as it can be read; return the seconds from spawn to that
        byte: what a job waits before its first sample."""
        self.spec.mountpoint.mkdir(parents=True, exist_ok=True)
        if is_mounted(self.spec.mountpoint) or any(self.spec.mountpoint.iterdir()):
            raise RuntimeError(f"{self.spec.mountpoint} is not an empty, unmounted directory")
        with open(self.log_path, "ab") as log:
            self.spawned_at = time.perf_counter()
            self.proc = subprocess.Popen(
                in_namespace(CLIENT_NS, self.spec.argv), env=self.spec.env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = self.spawned_at + MOUNT_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            # Before the mount is up this names a missing file in the empty directory.
            with contextlib.suppress(OSError), open(first_file, "rb") as f:
                if f.read(1):
                    return time.perf_counter() - self.spawned_at
            if time.perf_counter() > deadline:
                raise RuntimeError(f"no byte of {first_file} after {MOUNT_TIMEOUT:.0f} s: "
                                   f"{self.log_tail()}")
            time.sleep(0.005)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def peak_rss_mib(self) -> float:
        return peak_rss_mib(self.pid)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """Unmount and wait for the daemon to exit; escalate if it will not."""
        mountpoint = self.spec.mountpoint
        for _ in range(20):
            if not is_mounted(mountpoint):
                break
            if subprocess.run(["umount", str(mountpoint)], capture_output=True,
                              check=False).returncode == 0:
                break
            time.sleep(0.5)  # busy: DataLoader workers may still be exiting
        if self.proc is not None:
            try:
                self.proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                for signum in (signal.SIGTERM, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signum)
                    try:
                        self.proc.wait(10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        force_unmount(mountpoint)
