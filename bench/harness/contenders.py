"""The contenders: how each reaches the data, and what each cannot do.

access "local"   the dataset on local disk (the limit: no network at all)
access "mount"   a FUSE mount of the bucket; the workloads read plain paths
access "boto3"   the workloads call boto3 themselves (one GET per sample)
access "s3torch" s3torchconnector's map-style dataset and client (needs code changes)

A contender that cannot run here (a missing binary or package) is reported as
"n/a: <reason>" for every workload instead of being skipped silently.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness.mounts import MountSpec
from bench.harness.origin import BUCKET, REGION
from bench.harness.tree import this_tree


@dataclass(frozen=True)
class MountContext:
    """What a mount command needs: the origin, and private scratch space."""

    endpoint: str
    access_key: str
    secret_key: str
    mountpoint: Path
    scratch: Path  # fresh per session: cache directories and config files go here
    base_env: dict[str, str]


@dataclass(frozen=True)
class Contender:
    name: str
    access: str
    description: str
    #: Mount flags beyond the connection ones (bucketfs modes).
    flags: tuple[str, ...] = ()
    #: Wraps the training sampler in bucketfs.hints.HintSampler.
    hints: bool = False

    def unavailable(self) -> str | None:
        """Why this contender cannot run on this machine, or None."""
        if self.access == "s3torch" and importlib.util.find_spec("s3torchconnector") is None:
            return "s3torchconnector is not installed (pip install s3torchconnector)"
        if self.name == "s3fs" and shutil.which("s3fs") is None:
            return "s3fs is not installed (apt-get install s3fs)"
        if self.name == "rclone" and shutil.which("rclone") is None:
            return "rclone is not installed (apt-get install rclone)"
        if self.hints:
            return hints_unavailable()
        return None

    def mount_spec(self, ctx: MountContext) -> MountSpec | None:
        if self.access != "mount":
            return None
        if self.name.startswith("bucketfs"):
            return _bucketfs(ctx, self.flags)
        if self.name == "s3fs":
            return _s3fs(ctx)
        if self.name == "rclone":
            return _rclone(ctx)
        raise ValueError(f"no mount command for {self.name}")


def hints_unavailable() -> str | None:
    """None when bucketfs.hints.HintSampler imports in a fresh interpreter."""
    probe = subprocess.run([sys.executable, "-c", "from bucketfs.hints import HintSampler"],
                           capture_output=True, text=True, check=False)
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"bucketfs.hints is not available ({last})"


def _bucketfs(ctx: MountContext, flags: tuple[str, ...]) -> MountSpec:
    flags = tuple(f.replace("{scratch}", str(ctx.scratch)) for f in flags)
    argv = [sys.executable, "-m", "bucketfs", "mount", "--foreground", f"s3://{BUCKET}",
            str(ctx.mountpoint), "--endpoint-url", ctx.endpoint, "--region", REGION,
            "--addressing-style", "path", *flags]
    env = {**ctx.base_env, "AWS_ACCESS_KEY_ID": ctx.access_key,
           "AWS_SECRET_ACCESS_KEY": ctx.secret_key, "AWS_EC2_METADATA_DISABLED": "true",
           **this_tree()}
    return MountSpec(argv, ctx.mountpoint, env)


def _s3fs(ctx: MountContext) -> MountSpec:
    passwd = ctx.scratch / "s3fs.passwd"
    passwd.write_text(f"{ctx.access_key}:{ctx.secret_key}\n")
    passwd.chmod(0o600)
    cache = ctx.scratch / "s3fs-cache"
    cache.mkdir()
    argv = ["s3fs", BUCKET, str(ctx.mountpoint), "-f", "-o", "ro", "-o", f"url={ctx.endpoint}",
            "-o", "use_path_request_style", "-o", f"passwd_file={passwd}",
            "-o", f"endpoint={REGION}", "-o", f"use_cache={cache}"]
    return MountSpec(argv, ctx.mountpoint, dict(ctx.base_env))


def _rclone(ctx: MountContext) -> MountSpec:
    config = ctx.scratch / "rclone.conf"
    config.write_text(
        "[origin]\ntype = s3\nprovider = Other\n"
        f"access_key_id = {ctx.access_key}\nsecret_access_key = {ctx.secret_key}\n"
        f"endpoint = {ctx.endpoint}\nregion = {REGION}\nforce_path_style = true\n")
    config.chmod(0o600)
    argv = ["rclone", "mount", f"origin:{BUCKET}", str(ctx.mountpoint), "--read-only",
            "--vfs-cache-mode", "full", "--cache-dir", str(ctx.scratch / "rclone-cache"),
            "--config", str(config)]
    # Debian's rclone refuses the AWS_CA_BUNDLE this machine sets (and needs none here).
    env = {k: v for k, v in ctx.base_env.items() if k != "AWS_CA_BUNDLE"}
    return MountSpec(argv, ctx.mountpoint, env)


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("local", "local", "the dataset on local disk (no network)"),
        Contender("boto3", "boto3", "a Dataset that GETs each sample with boto3 (no mount, "
                                    "no cache)"),
        Contender("s3fs", "mount", "s3fs-fuse, -o use_cache=DIR (its disk cache)"),
        Contender("rclone", "mount", "rclone mount --vfs-cache-mode full"),
        Contender("s3torchconnector", "s3torch",
                  "s3torchconnector S3MapDataset (training code changed to use it)"),
        Contender("bucketfs-nocache", "mount",
                  "bucketfs mount --ram-cache 0 (no cache of its own; kernel page cache only)",
                  flags=("--ram-cache", "0")),
        Contender("bucketfs-cache", "mount",
                  "bucketfs mount --cache-dir DIR (2 GiB RAM tier + SSD tier)",
                  flags=("--cache-dir", "{scratch}/bucketfs-cache")),
        Contender("bucketfs-hints", "mount",
                  "bucketfs-cache, and the training loop's sampler wrapped in "
                  "bucketfs.hints.HintSampler",
                  flags=("--cache-dir", "{scratch}/bucketfs-cache"),
                  hints=True),
    )
}


def parse_contenders(text: str | None) -> list[Contender]:
    """The contenders named in a comma-separated list (all of them when None)."""
    if not text:
        return list(CONTENDERS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    return [CONTENDERS[n] for n in names]


def clean_env() -> dict[str, str]:
    """The environment the contenders start from: ours, without AWS settings that would
    send them elsewhere."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("AWS_PROFILE", "AWS_ENDPOINT", "AWS_CONFIG"))}
