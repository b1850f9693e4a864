"""`bucketfs hint MOUNT FILE_OF_PATHS`: send_order (with `--next`, send_next_order)
for other frameworks and scripts.

Unlike the sampler, the command reports failures: exit 1 with a one-line error. On
success it prints the job id, which `--end --job ID` takes later.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bucketfs.hints.client import DEFAULT_TIMEOUT, HintError, default_job, end_job, send_order

PROG = "bucketfs hint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mount", metavar="MOUNT", help="the bucketfs mount (or a "
                        "directory in it) the paths are relative to")
    parser.add_argument("paths", metavar="FILE_OF_PATHS", nargs="?",
                        help="one path a line, relative to MOUNT or absolute, in the "
                             "order they will be read; - for stdin")
    parser.add_argument("--epoch", type=int, default=0, help="epoch number (default 0)")
    parser.add_argument("--job", help="job id (default: a new one, printed)")
    parser.add_argument("--rank", type=int, default=0, help="this reader's rank (default 0)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="number of ranks (default 1)")
    parser.add_argument("--next", action="store_true",
                        help="the paths are the order of the job's next epoch (--epoch), "
                             "announced while it reads the current one: the daemon lays "
                             "out its SSD cache in that order")
    parser.add_argument("--next-follows", action="store_true",
                        help="a --next order for the epoch after this one will follow: "
                             "the daemon waits for it before laying out what is read")
    parser.add_argument("--end", action="store_true",
                        help="tell the daemon job --job is done instead of sending paths")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds to wait for the daemon (default {DEFAULT_TIMEOUT:g})")


def run(args: argparse.Namespace) -> int:
    try:
        if args.end:
            if not args.job:
                raise HintError("--end needs --job")
            if args.next or args.next_follows:
                raise HintError("--end takes no --next or --next-follows")
            end_job(args.job, mount=args.mount, timeout=args.timeout, strict=True)
            return 0
        if args.paths is None:
            raise HintError("FILE_OF_PATHS is required (or --end)")
        job = args.job or default_job()
        send_order(read_paths(args.paths), epoch=args.epoch, job=job, rank=args.rank,
                   world_size=args.world_size, mount=args.mount, timeout=args.timeout,
                   strict=True, next_epoch=args.next, next_follows=args.next_follows)
    except HintError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(job)
    return 0


def read_paths(name: str) -> list[str]:
    """The paths in file NAME ("-": standard input), one a line."""
    try:
        if name == "-":
            text = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
        else:
            with open(name, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
                text = f.read()
    except OSError as exc:
        raise HintError(f"cannot read {name}: {exc.strerror or exc}") from None
    # Only the line ends are stripped: spaces are ordinary characters in names.
    return [line for line in text.split("\n") if line]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Tell the daemon of MOUNT the "
                                     "order in which files will be read.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
