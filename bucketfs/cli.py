"""The `bucketfs` command: mount, umount, check, status, warm, cache stats|clear, hint.

`bucketfs mount` without --foreground starts the daemon as a child process in its own
session and waits on a pipe until the child reports the mount ready (exit 0) or
reports the one-line reason it could not mount (exit 1). The child is the same command
with --foreground, so both paths run the same code. The options reach the child as JSON
on a second pipe, not on its command line: `ps` shows every user the command line of
every process, and an --endpoint-url may carry a user:password@.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from bucketfs import __version__, huge_pages, placement
from bucketfs.backends.urls import BadUrl, parse_bucket_url
from bucketfs.cache.admin import add_cache_commands, run_cache_command
from bucketfs.config import OPTIONS, OPTIONS_BY_NAME, ConfigError, load_config
from bucketfs.hints.cli import add_arguments as add_hint_arguments
from bucketfs.hints.cli import run as run_hint
from bucketfs.private import UnsafePath, open_private_log
from bucketfs.runtime import FSTYPE, daemon_pid, default_log_file, mounted, stale, unmount
from bucketfs.status_view import add_arguments as add_status_arguments
from bucketfs.status_view import run as run_status
from bucketfs.warm_client import add_arguments as add_warm_arguments
from bucketfs.warm_client import run as run_warm

PROG = "bucketfs"


def error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mount options (also settable in --config; flags win)")
    for option in OPTIONS:
        if option.parse.__name__ == "_bool":
            # --name and --no-name: a flag can turn off an option that is on by
            # default or in the config file.
            group.add_argument(option.flag, dest=option.name,
                               action=argparse.BooleanOptionalAction, default=None,
                               help=option.help)
        else:
            group.add_argument(option.flag, dest=option.name, default=None, metavar="VALUE",
                               help=option.help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Mount an S3 or GCS bucket (or a prefix of one) as a read-only directory.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mount = commands.add_parser(
        "mount", help="mount a bucket",
        description="Mount URL (s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX] or file:///PATH) "
                    "read-only on MOUNTPOINT. Returns once the mount is ready.",
    )
    mount.add_argument("url", metavar="URL")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT")
    mount.add_argument("--config", metavar="FILE", help="TOML file of options "
                       "(see mount.conf.example)")
    mount.add_argument("--foreground", "-f", action="store_true",
                       help="stay in the foreground and log to stderr; Ctrl-C unmounts")
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount.add_argument("--options-fd", type=int, help=argparse.SUPPRESS)
    _add_option_flags(mount)

    umount = commands.add_parser(
        "umount", help="unmount a bucketfs mount",
        description="Unmount MOUNTPOINT and wait for its daemon to exit.",
    )
    umount.add_argument("mountpoint", metavar="MOUNTPOINT")
    umount.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the daemon to exit (default 30)")
    add_cache_commands(commands)

    check = commands.add_parser(
        "check", help="check that a bucketfs mount answers (a readiness probe)",
        description="Exit 0 if a bucketfs daemon answers at MOUNTPOINT, else 1 (not "
                    "mounted, another filesystem, stale, or no answer in time); one line "
                    "either way.",
    )
    check.add_argument("mountpoint", metavar="MOUNTPOINT")
    check.add_argument("--timeout", type=float, default=5.0,
                       help="seconds to wait for the daemon's answer (default 5)")

    status = commands.add_parser(
        "status", help="show what a mount is doing: cache, prefetch, origin, errors",
        description="Ask the daemon of MOUNT for a live view of the mount: the backend, "
                    "each cache tier's occupancy and budget, hit ratios, prefetch, origin "
                    "requests, throughput and their estimated cost, errors and warm jobs.",
    )
    add_status_arguments(status)

    warm = commands.add_parser(
        "warm", help="fetch a dataset (or part of it) into the cache before training",
        description="Have the daemon of MOUNT fetch the files under each PATH (default: "
                    "all of MOUNT) into its cache, through its own fetch path and within "
                    "its cache budgets. Shows progress; Ctrl-C stops the job, and what "
                    "was fetched stays cached.",
    )
    add_warm_arguments(warm)

    hint = commands.add_parser(
        "hint", help="tell a mount the order in which files will be read",
        description="Send the daemon of MOUNT the order in which a job will read the files "
                    "in FILE_OF_PATHS (see docs/HINTS.md). Prints the job id.",
    )
    add_hint_arguments(hint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "mount":
        return cmd_mount(args)
    if args.command == "cache":
        return run_cache_command(args)
    if args.command == "hint":
        return run_hint(args)
    if args.command == "status":
        return run_status(args)
    if args.command == "warm":
        return run_warm(args)
    if args.command == "check":
        from bucketfs.check import run_check
        return run_check(args.mountpoint, args.timeout)
    return cmd_umount(args)


def cmd_mount(args: argparse.Namespace) -> int:
    """`bucketfs mount`, also run by mount.fuse.bucketfs (fstab.py) with the options it
    read from -o set on `args`."""
    overrides = {o.name: value for o in OPTIONS if (value := getattr(args, o.name)) is not None}
    try:
        url = parse_bucket_url(args.url)
        if args.options_fd is not None:  # the daemon: its parent resolved them already
            config = load_config(None, _read_options(args.options_fd))
        else:
            config = load_config(args.config, overrides)
    except (BadUrl, ConfigError) as exc:
        return _report(args, str(exc))
    if args.foreground:
        return _mount_foreground(args, url, config)
    return _spawn_daemon(args, config)


def _report(args: argparse.Namespace, message: str) -> int:
    """A mount-time error: to the waiting parent (daemon mode) and to stderr."""
    if args.ready_fd is not None:
        with os.fdopen(args.ready_fd, "w") as pipe:
            pipe.write(message.replace("\n", " ") + "\n")
    return error(message)


def _mount_foreground(args: argparse.Namespace, url: object, config: object) -> int:
    if args.ready_fd is None and args.options_fd is None:  # not started by a parent
        huge_pages.run_again_with_huge_pages(config.huge_buffers)  # type: ignore[attr-defined]
    cpus = config.cpus  # type: ignore[attr-defined]
    if cpus is not None:  # before any thread exists: every later thread inherits it
        try:
            cores = placement.confine(cpus)
        except (ValueError, OSError) as exc:
            return _report(args, f"cannot run on cores {cpus}: {exc}")
    # Imported here so `bucketfs --help` and `umount` do not load pyfuse3 and the SDKs.
    from bucketfs.logs import setup_logging
    from bucketfs.mount import MountError, MountInfo, run_mount

    # Everything the daemon creates (cache files, its index, sockets) is private to the
    # mount's user, and to the cache group if one is configured (the cache directories
    # then carry that group): a cached private bucket is not for every user of the node.
    os.umask(0o027 if config.cache_group else 0o077)  # type: ignore[attr-defined]
    try:
        setup_logging(config.log_level, config.log_file,  # type: ignore[attr-defined]
                      config.log_format)  # type: ignore[attr-defined]
    except (UnsafePath, OSError) as exc:
        return _report(args, f"cannot write the log {config.log_file}: {exc}")  # type: ignore[attr-defined]
    # Every resolved option, once, for whoever reads a debug log (redacted by the filter).
    logging.getLogger(__name__).debug("bucketfs %s, pid %d, options: %s", __version__,
                                      os.getpid(), _describe(config))
    if cpus is not None:
        logging.getLogger(__name__).info("the daemon runs on cores %s",
                                         ",".join(map(str, sorted(cores))))

    def ready(warnings: list[str]) -> None:
        if args.ready_fd is not None:
            lines = [f"warning: {w}" for w in warnings] + ["ready"]
            os.write(args.ready_fd, "".join(f"{line}\n" for line in lines).encode())
            os.close(args.ready_fd)
            args.ready_fd = None

    try:
        run_mount(MountInfo(url, args.mountpoint, config), ready)  # type: ignore[arg-type]
    except MountError as exc:
        return _report(args, str(exc))
    return 0


def _spawn_daemon(args: argparse.Namespace, config: object) -> int:
    given = config.log_file  # type: ignore[attr-defined]
    log_file = given or default_log_file(os.path.abspath(args.mountpoint))
    try:
        # Private to the mount's user: it names the bucket's keys.
        log = open_private_log(log_file)
    except (UnsafePath, OSError) as exc:
        return error(f"cannot write the log {log_file}: {exc}")
    read_end, write_end = os.pipe()
    options_read, options_write = os.pipe()
    command = [*_child_argv(args), "--foreground", "--ready-fd", str(write_end),
               "--options-fd", str(options_read)]
    try:
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            pass_fds=(write_end, options_read), start_new_session=True,
            env=huge_pages.environment(os.environ,
                                       config.huge_buffers),  # type: ignore[attr-defined]
        )
    except OSError as exc:  # no daemon to talk to: close our ends too
        for fd in (read_end, options_write):
            os.close(fd)
        return error(f"cannot start the daemon ({command[0]}): {exc}")
    finally:
        os.close(log)
        os.close(options_read)
        os.close(write_end)
    values = {**config.as_dict(), "log_file": log_file}  # type: ignore[attr-defined]
    try:
        with os.fdopen(options_write, "w") as pipe:
            json.dump(values, pipe)  # inf (metadata_ttl = forever) goes as Infinity
    except BrokenPipeError:
        pass  # the child died first; its exit status is reported below
    with os.fdopen(read_end) as pipe:
        status = pipe.readline().strip()
        while status.startswith("warning: "):
            print(f"{PROG}: {status}", file=sys.stderr)
            status = pipe.readline().strip()
    if status == "ready":
        return 0
    if not status:
        child.wait()
        return error(f"the mount daemon exited ({child.returncode}) before the mount was "
                     f"ready; see {log_file}")
    child.wait()
    return error(status)


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The daemon's command line: the URL (never holding credentials: parse_bucket_url
    refuses them) and the mountpoint; the options go through --options-fd. -P: `-m`
    would otherwise import a `bucketfs` directory in the current directory (a checkout,
    or one planted there) instead of the installed package."""
    return [sys.executable, "-P", "-m", "bucketfs", "mount", args.url,
            os.path.abspath(args.mountpoint)]


def _read_options(fd: int) -> dict[str, object]:
    """The resolved options the parent wrote as JSON, read to the end."""
    with os.fdopen(fd) as pipe:
        try:
            values = json.load(pipe)
        except ValueError as exc:
            raise ConfigError(f"unreadable options from the parent: {exc}") from None
    if not isinstance(values, dict) or not set(values) <= set(OPTIONS_BY_NAME):
        raise ConfigError("unreadable options from the parent: unknown names")
    return values


def _describe(config: object) -> str:
    return " ".join(f"{name}={value}" for name, value in config.as_dict().items()  # type: ignore[attr-defined]
                    if value is not None)


def cmd_umount(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.mountpoint)
    entry = mounted(path) or mounted(os.path.realpath(path))
    if entry is None:
        return error(f"{args.mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        return error(f"{args.mountpoint} is not a bucketfs mount ({entry.fstype})")
    pid = daemon_pid(entry.mountpoint)
    # A stale mount still in use (a shell inside it) refuses a plain unmount with EBUSY;
    # with no daemon behind it there is nothing to wait for, so detach it lazily.
    result = unmount(entry.mountpoint, lazy=stale(entry.mountpoint))
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip().splitlines()
        return error(f"cannot unmount {args.mountpoint}: "
                     f"{reason[-1] if reason else 'unknown error'}")
    if pid is not None and not _wait_exit(pid, args.timeout):
        return error(f"unmounted, but the daemon (pid {pid}) is still running after "
                     f"{args.timeout:g}s")
    return 0


def _alive(pid: int) -> bool:
    """True while our daemon `pid` runs. A zombie (nobody reaped it yet) has finished,
    and a pid file left by a killed daemon may name an unrelated process by now."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"bucketfs" in f.read()
    except (OSError, IndexError):
        return False


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + (timeout if math.isfinite(timeout) else 1e9)
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False
