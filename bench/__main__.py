"""bucketfs against local disk and the other ways to read a bucket, on a shaped link.

    python -m bench run --scenario imagenet-small [--link near|far] [--repeat N]
                        [--contenders a,b,c] [--epochs E] [--gpu-ms MS]
                        [--bucketfs-flags "--prefetch-connections 4"] ...
    python -m bench clean      remove what a crashed run left (namespaces, mounts)
    python -m bench report DIR rewrite DIR/report.md and DIR/*.png from DIR/results.json

Needs root (network namespaces, tc, drop_caches, FUSE). Results: bench/results/<time>/
(results.json, report.md, epochs.png, stall.png, requests.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
from pathlib import Path

from bench.harness.contenders import CONTENDERS, parse_contenders
from bench.harness.scenarios import LINKS, SCENARIOS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="measure every contender and write the report")
    run.add_argument("--scenario", choices=sorted(SCENARIOS), default="imagenet-small")
    run.add_argument("--link", choices=sorted(LINKS), default="far")
    run.add_argument("--repeat", type=int, default=3, help="repeats (medians and ranges)")
    run.add_argument("--contenders", default=None,
                     help=f"comma-separated subset of: {', '.join(CONTENDERS)}")
    run.add_argument("--epochs", type=int, default=2,
                     help="training epochs: the first cold, the rest warm")
    run.add_argument("--workers", type=int, default=4, help="DataLoader workers")
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--gpu-ms", type=float, default=50.0,
                     help="simulated GPU time per batch, in ms (0: none)")
    run.add_argument("--threads", type=int, default=16, help="threads of the raw reads")
    run.add_argument("--train-only", action="store_true",
                     help="training epochs only (no raw or sequential reads)")
    run.add_argument("--bucketfs-flags", default="",
                     help="extra `bucketfs mount` flags for every bucketfs contender, "
                          "e.g. \"--prefetch-connections 4\"")
    run.add_argument("--out", type=Path, default=Path("bench/results"))
    commands.add_parser("clean", help="remove namespaces and mounts a crashed run left")
    report = commands.add_parser("report", help="rewrite report.md and the plots of a run "
                                                "from its results.json")
    report.add_argument("directory", type=Path)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every teardown, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.command == "report":
        from bench.harness.report import rewrite

        rewrite(args.directory)
        return 0
    # Imported here: `--help` should not need root or the heavy imports.
    from bench.harness import runner

    if args.command == "clean":
        with runner.exclusive():
            runner.clean_stale()
        return 0
    if args.repeat < 1 or args.epochs < 1:
        raise SystemExit("--repeat and --epochs must be at least 1")
    try:
        contenders = parse_contenders(args.contenders)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    extra = tuple(shlex.split(args.bucketfs_flags))
    contenders = [dataclasses.replace(c, flags=c.flags + extra)
                  if extra and c.name.startswith("bucketfs") else c for c in contenders]
    settings = runner.Settings(
        scenario=SCENARIOS[args.scenario], link=LINKS[args.link], repeats=args.repeat,
        contenders=contenders, epochs=args.epochs, workers=args.workers,
        batch_size=args.batch_size, gpu_ms=args.gpu_ms, threads=args.threads,
        out=args.out, train_only=args.train_only,
        command=shlex.join(["python", "-m", "bench", *sys.argv[1:]]),
    )
    runner.run(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
