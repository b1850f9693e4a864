"""The shared cache tier: a second node's cold epoch against the first's, on a far origin
with a near shared tier.

    python -m bench.shared_tier [--scenario imagenet-small|tiny] [--repeat 3]
                                [--threads 16] [--no-baseline]
                                [--bucketfs-flags "..."] [--out DIR]
    python -m bench.shared_tier --report DIR   costs and report.md again from
                                               DIR/results.json (no root)

Needs root (network namespaces, tc, drop_caches, FUSE); about 90 s for
`imagenet-small`, 3 repeats, on a 2-core machine (the dataset generated once before).
One SeaweedFS in the origin namespace holds two buckets, reached from the client
namespace through two delay proxies on one veth:

    origin   s3://bench         port 9000, 30 ms RTT, 200 Mbit/s  (tc htb class 1:10)
    shared   s3://bench-shared  port 9001,  1 ms RTT, 1 Gbit/s    (tc htb class 1:11)

The two "nodes" are two bucketfs mounts, one after the other, each with its own empty
`--cache-dir` and the page cache dropped, both with `--shared-cache
s3://bench-shared/nodes-rN`. Each reads every image once (THREADS threads, shuffled,
plain open/read, every file's CRC checked) and is unmounted, which drains its queue of
background PUTs. A third, plain cold mount without the shared tier is the baseline
(run last, or first in every other repeat, so drift does not always land on it). Each
repeat uses a new, empty prefix of the shared bucket; the report gives medians with
min-max over the repeats.
Per node: epoch time, files/s, MB/s, the origin's and the shared tier's requests and
bytes as the proxies counted them, the daemon's own `shared` counters (`bucketfs status
--json`), its CPU, and the least time the origin link needs for the bytes it carried.

Prices (US dollars, us-east-1, list prices as published by AWS, as read 2025-04; this
machine cannot reach the pages: check them before quoting a cost):
  origin, S3 Standard (https://aws.amazon.com/s3/pricing/): GET $0.0004 and LIST $0.005
      per 1,000 (bench/harness/costs.py); data transfer out to another region
      $0.02/GB (inter-region transfer; to the internet it is $0.09/GB and up)
  shared tier, S3 Express One Zone (same page, after the April 2025 price change):
      PUT, COPY, POST, LIST $0.00113 per 1,000; GET, HEAD and other requests $0.00003
      per 1,000; for the part of each request above 512 KB, upload $0.0032/GB and
      retrieval $0.0006/GB; storage $0.11/GB-month. DELETE is free.
The constants: `Prices` in bench/shared_report.py. A GB is 2**30 bytes, as AWS bills
it. Results: results.json and report.md under OUT/shared-<time>/ (bench/results/ is
git-ignored), with each node's daemon log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import netlab
from bench.harness.contenders import Contender, MountContext, clean_env
from bench.harness.dataset import Dataset, ensure_dataset, image_sizes, size_summary
from bench.harness.mounts import MountProcess, clean_stale_mounts
from bench.harness.netlab import (
    CLIENT_IF,
    CLIENT_NS,
    ORIGIN_IF,
    ORIGIN_NS,
    NetLab,
    PortLink,
    in_namespace,
)
from bench.harness.origin import BUCKET, PROXY_PORT, Origin, control_request
from bench.harness.runner import (
    WORK,
    clean_stale,
    drop_page_cache,
    exclusive,
    log,
    machine,
    source_state,
)
from bench.harness.scenarios import SCENARIOS, Link
from bench.shared_report import (
    Prices,
    compare_repeats,
    express_excess_bytes,
    markdown,
    node_costs,
)

ORIGIN_LINK = Link("far", rtt_ms=30, mbit=200)
SHARED_LINK = Link("shared", rtt_ms=1, mbit=1000)
SHARED_PORT = 9001
SHARED_BUCKET = "bench-shared"
SHARED_PREFIX = "nodes"
#: Patterns of a daemon log line worth reporting (the daemon logs level names).
LOG_PROBLEMS = ("WARNING", "ERROR", "CRITICAL", "Traceback")


@dataclass(frozen=True)
class NodePlan:
    name: str
    shared: bool
    description: str


NODES = (
    NodePlan("node 1", True, "cold, empty shared tier: fills it"),
    NodePlan("node 2", True, "cold, fresh cache dir: reads what node 1 shared"),
    NodePlan("baseline", False, "cold, no shared tier (what node 2 would be without it)"),
)


def node_order(repeat: int, baseline: bool) -> list[NodePlan]:
    """Node 1 before node 2 always; the baseline last, or first in every other repeat."""
    shared = [p for p in NODES if p.shared]
    plain = [p for p in NODES if not p.shared] if baseline else []
    return plain + shared if repeat % 2 else shared + plain


def checksums(train: Path, images: list[str]) -> dict[str, tuple[int, int]]:
    """Size and CRC-32 of every image on local disk: what each read must return."""
    out = {}
    for name in images:
        data = (train / name).read_bytes()
        out[name] = (len(data), zlib.crc32(data))
    return out


def read_epoch(root: Path, expected: dict[str, tuple[int, int]], threads: int,
               seed: int) -> dict[str, Any]:
    """Every file once, in a shuffled order, `threads` at a time; wrong or failed reads
    are counted (and the first few named), not raised: node 2's data must be right."""
    order = sorted(expected)
    random.Random(seed).shuffle(order)
    wrong: list[str] = []

    def read(name: str) -> int:
        try:
            with open(root / name, "rb") as f:
                data = f.read()
        except OSError as exc:
            wrong.append(f"{name}: {exc}")
            return 0
        if (len(data), zlib.crc32(data)) != expected[name]:
            wrong.append(f"{name}: {len(data)} bytes, not the expected content")
        return len(data)

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, order, chunksize=4))
    wall = time.perf_counter() - began
    return {"files": len(order), "bytes": total, "wall_s": wall,
            "files_per_s": len(order) / wall, "mb_per_s": total / wall / 1e6,
            "threads": threads, "bad_reads": len(wrong), "bad_examples": wrong[:5]}


def proxy_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters a proxy moved by between two of its `stats` replies."""
    out: dict[str, Any] = {k: after[k] - before.get(k, 0) for k in after
                           if isinstance(after[k], int)}
    methods_before = before.get("methods", {})
    out["methods"] = {m: n - methods_before.get(m, 0)
                      for m, n in after.get("methods", {}).items()
                      if n - methods_before.get(m, 0)}
    return out


def log_problems(path: Path, limit: int = 20) -> dict[str, Any]:
    """The daemon log's warning and error lines (the first `limit` of them)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"count": 0, "lines": []}
    found = [line for line in lines if any(p in line for p in LOG_PROBLEMS)]
    return {"count": len(found), "lines": found[:limit]}


def daemon_status(mountpoint: Path, env: dict[str, str]) -> dict[str, Any] | None:
    """`bucketfs status MOUNT --json`, or None when it fails (the reason is logged)."""
    result = subprocess.run([sys.executable, "-m", "bucketfs", "status", str(mountpoint),
                             "--json"], env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    if result.returncode != 0:
        log(f"  bucketfs status failed ({result.returncode}): {result.stderr.strip()[-300:]}")
        return None
    return json.loads(result.stdout)


def parse_class_bytes(text: str) -> dict[str, int]:
    """`tc -s class show`'s text (this iproute2 ignores -j for classes): bytes sent per
    class handle."""
    out: dict[str, int] = {}
    handle = None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["class"] and len(words) > 2:
            handle = words[2]
        elif words[:1] == ["Sent"] and handle is not None:
            out[handle] = int(words[1])
            handle = None
    return out


def tc_class_bytes() -> dict[str, dict[str, int]]:
    """Bytes each htb class sent, per namespace: proof that the two paths were apart."""
    out = {}
    for namespace, device in ((ORIGIN_NS, ORIGIN_IF), (CLIENT_NS, CLIENT_IF)):
        result = subprocess.run(["tc", "-n", namespace, "-s", "class", "show", "dev", device],
                                capture_output=True, text=True, check=False)
        out[namespace] = parse_class_bytes(result.stdout)
    return out


def rtt_probe(env: dict[str, str], endpoints: dict[str, str], bucket: str) -> dict[str, float]:
    """Median ms of 5 signed HEADs of the bucket on a warm connection, per endpoint, from
    the client namespace: the round trip a request sees, SeaweedFS and boto3 included."""
    code = (
        "import boto3, json, statistics, sys, time\n"
        "from botocore.config import Config\n"
        "out = {}\n"
        "for name, url in json.loads(sys.argv[1]).items():\n"
        "    c = boto3.client('s3', endpoint_url=url, config=Config(s3={'addressing_style': "
        "'path'}))\n"
        "    c.head_bucket(Bucket=sys.argv[2])\n"
        "    times = []\n"
        "    for _ in range(5):\n"
        "        t = time.perf_counter(); c.head_bucket(Bucket=sys.argv[2])\n"
        "        times.append(1000 * (time.perf_counter() - t))\n"
        "    out[name] = statistics.median(times)\n"
        "print(json.dumps(out))\n")
    result = subprocess.run(in_namespace(CLIENT_NS, [sys.executable, "-c", code,
                                                     json.dumps(endpoints), bucket]),
                            env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout)


class Bench:
    """One run: the origin and its two proxies are up; nodes are measured in turn."""

    def __init__(self, args: argparse.Namespace, origin: Origin, dataset: Dataset,
                 expected: dict[str, tuple[int, int]], out: Path) -> None:
        self.args = args
        self.origin = origin
        self.dataset = dataset
        self.expected = expected
        self.out = out

    def flags(self, plan: NodePlan, scratch: Path, repeat: int) -> tuple[str, ...]:
        flags = ["--cache-dir", str(scratch / "cache")]
        if plan.shared:
            flags += ["--shared-cache",
                      f"s3://{SHARED_BUCKET}/{SHARED_PREFIX}-r{repeat + 1}",
                      "--shared-cache-endpoint-url", self.origin.endpoint_at(SHARED_PORT)]
        return (*flags, *shlex.split(self.args.bucketfs_flags))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {"origin": control_request(self.origin.proxy_control(PROXY_PORT), "stats"),
                "shared": control_request(self.origin.proxy_control(SHARED_PORT), "stats")}

    def deltas(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return {side: proxy_delta(before[side], after[side]) for side in before}

    def node(self, plan: NodePlan, repeat: int) -> dict[str, Any]:
        slug = f"{plan.name.replace(' ', '-')}-r{repeat + 1}"
        scratch = WORK / "nodes" / slug
        scratch.mkdir(parents=True)
        mountpoint = WORK / "mnt" / slug
        contender = Contender(f"bucketfs-{slug}", "mount", plan.description,
                              flags=self.flags(plan, scratch, repeat))
        ctx = MountContext(self.origin.endpoint, self.origin.access_key,
                           self.origin.secret_key, mountpoint, scratch, clean_env())
        spec = contender.mount_spec(ctx)
        assert spec is not None
        record: dict[str, Any] = {"name": plan.name, "repeat": repeat,
                                  "shared": plan.shared,
                                  "description": plan.description, "argv": spec.argv,
                                  "status": "ok"}
        mount = MountProcess(spec, scratch / "daemon.log")
        drop_page_cache()
        snaps = [self.snapshot()]
        try:
            record["first_byte_s"] = mount.start(mountpoint / "train" / self.dataset.images[0])
            snaps.append(self.snapshot())
            cpu_before = mount.cpu_seconds()
            record["epoch"] = read_epoch(mountpoint / "train", self.expected,
                                         self.args.threads, seed=repeat)
            record["daemon_cpu_s"] = mount.cpu_seconds() - cpu_before
            snaps.append(self.snapshot())
            record["daemon_status"] = daemon_status(mountpoint, spec.env)
            record["peak_rss_mib"] = mount.peak_rss_mib()
        except Exception as exc:
            traceback.print_exc()
            record["status"] = f"error: {type(exc).__name__}: {exc}"[:500]
        finally:
            # The daemon is reaped in stop(): its whole life's CPU (the drain included)
            # lands in our children's rusage then.
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            began = time.perf_counter()
            mount.stop()
            record["unmount_s"] = time.perf_counter() - began
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            record["daemon_cpu_life_s"] = (after.ru_utime + after.ru_stime
                                           - children.ru_utime - children.ru_stime)
            snaps.append(self.snapshot())
            shutil.copyfile(mount.log_path, self.out / "logs" / f"{slug}-daemon.log")
            record["log_problems"] = log_problems(mount.log_path)
        if len(snaps) == 4:
            # Per phase: mount to first byte, the epoch, and from the epoch's end to the
            # daemon's exit (the status call, then the unmount and its drain).
            record["start"] = self.deltas(snaps[0], snaps[1])
            record["epoch_requests"] = self.deltas(snaps[1], snaps[2])
            record["after_epoch"] = self.deltas(snaps[2], snaps[3])
        record["total"] = self.deltas(snaps[0], snaps[-1])
        return record


def run(args: argparse.Namespace, command: str) -> Path:
    with exclusive():
        clean_stale()
        WORK.mkdir(parents=True)
        out = args.out / time.strftime("shared-%Y%m%d-%H%M%S")
        (out / "logs").mkdir(parents=True)
        log(f"results go to {out}")
        scenario = SCENARIOS[args.scenario]
        dataset = ensure_dataset(scenario)
        sizes = image_sizes(dataset)
        expected = checksums(dataset.train, dataset.images)
        prices = Prices()
        results: dict[str, Any] = {
            "command": command, "machine": machine(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "scenario": scenario.name,
            "dataset": {"images": len(dataset.images), "image_bytes": dataset.image_bytes,
                        "sizes": size_summary(sizes)},
            "links": {"origin": {**asdict(ORIGIN_LINK), "port": PROXY_PORT},
                      "shared": {**asdict(SHARED_LINK), "port": SHARED_PORT}},
            "threads": args.threads, "repeats": args.repeat,
            "bucketfs_flags": args.bucketfs_flags,
            "prices": asdict(prices),
            "express_excess_bytes_per_object": express_excess_bytes(sizes, prices),
            "bucketfs_source": [source_state()], "nodes": [],
            # Others share this machine: how busy it was says how far to trust times
            # (at the end, the load is mostly this run's own readers).
            "load_average": [os.getloadavg()],
        }
        try:
            with NetLab(ORIGIN_LINK, (PortLink(SHARED_PORT, SHARED_LINK.mbit),)), \
                    Origin(WORK, ORIGIN_LINK.one_way_delay_ms,
                           {SHARED_PORT: SHARED_LINK.one_way_delay_ms}) as origin:
                log(f"origin up; uploading {len(dataset.images)} images")
                origin.upload(dataset.train, [])
                origin.create_bucket(SHARED_BUCKET)
                origin.check_from_client()
                env = {**os.environ, **origin.env()}
                results["rtt_ms"] = rtt_probe(env, {
                    "origin": origin.endpoint, "shared": origin.endpoint_at(SHARED_PORT)},
                    BUCKET)
                log(f"round trips (HEAD, ms): {results['rtt_ms']}")
                bench = Bench(args, origin, dataset, expected, out)
                for repeat in range(args.repeat):
                    for plan in node_order(repeat, args.baseline):
                        log(f"repeat {repeat + 1}/{args.repeat}, {plan.name}: "
                            f"{plan.description}")
                        record = bench.node(plan, repeat)
                        record["cost"] = node_costs(record, results, prices)
                        results["nodes"].append(record)
                        log(f"  {record['status']}, epoch "
                            f"{record.get('epoch', {}).get('wall_s', float('nan')):.1f} s, "
                            f"origin GETs {record['total']['origin'].get('GET', 0)}, "
                            f"unmount {record.get('unmount_s', 0):.1f} s")
                results["tc_class_bytes"] = tc_class_bytes()
        finally:
            clean_stale_mounts(WORK)
            netlab.clean_stale()
            shutil.rmtree(WORK, ignore_errors=True)
            results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
            results["bucketfs_source"].append(source_state())
            results["load_average"].append(os.getloadavg())
            results["comparisons"] = compare_repeats(results, prices)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            if results["nodes"]:
                try:
                    text = markdown(results)
                    (out / "report.md").write_text(text)
                    print(text)
                except Exception:
                    traceback.print_exc()  # not instead of the error that got us here
        log(f"results: {out / 'results.json'}")
        return out


def rewrite(directory: Path) -> str:
    """Costs, comparisons and report.md of a finished run again, from its results.json
    (after a change to the prices or the report)."""
    path = directory / "results.json"
    results = json.loads(path.read_text())
    prices = Prices()
    results["prices"] = asdict(prices)
    for node in results["nodes"]:
        node["cost"] = node_costs(node, results, prices)
    results["comparisons"] = compare_repeats(results, prices)
    path.write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (directory / "report.md").write_text(text)
    return text


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every teardown, as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shared_tier",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="imagenet-small")
    parser.add_argument("--repeat", type=int, default=3,
                        help="repeats of the whole sequence (medians and ranges)")
    parser.add_argument("--threads", type=int, default=16, help="reader threads per node")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also a plain cold mount without the shared tier")
    parser.add_argument("--bucketfs-flags", default="",
                        help="extra `bucketfs mount` flags for every node, e.g. "
                             "\"--shared-cache-max-object 1MiB\"")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="only rewrite DIR/report.md (and the costs in DIR/results.json)")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(rewrite(args.report))
        return 0
    if args.repeat < 1 or args.threads < 1:
        raise SystemExit("--repeat and --threads must be at least 1")
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, tc, drop_caches, FUSE)")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    command = shlex.join(["python", "-m", "bench.shared_tier", *(sys.argv[1:] if argv is None
                                                                  else argv)])
    run(args, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

