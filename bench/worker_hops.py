"""What a GET costs through the daemon's worker threads, against the same GET made by
the thread that needs it:

    python -m bench.worker_hops [--objects 2000] [--rounds 4] [--out DIR]

On loopback SeaweedFS, OBJECTS objects of 100 KB, each fetched by the backend's own
`get_range` (obstore, pinned to the object's version, as the daemon fetches a block),
16 at a time, in three arms run in alternation:
  - plain threads: 16 threads each calling `get_range` in turn (what a GET client in the
    reading process does: no hand-off between threads);
  - through `in_worker`: 16 trio tasks, each GET handed to a worker thread and the result
    handed back (the daemon's path: `workers.in_worker`, under a `CapacityLimiter` of
    32);
  - the hand-off alone: the same, with a call that returns 100 KB at once in place of
    the GET;
  - libcurl on the trio thread: 16 trio tasks, each GET made by the backend's
    `async_get_range` (the daemon's GETs since step 33: curl_multi.py), no thread hop.
For each: CPU per call (`time.process_time`, all threads of this process) and context
switches per call (`getrusage`: voluntary, each a thread that blocked and was woken
again, on the GIL, a lock, I/O or work to do; involuntary, each a preemption), medians
over the rounds. Context switches count the same on 2 cores as on 64, where every
wakeup crosses cores: they say what the hand-offs will cost a large node that this
machine cannot show. Results: JSON and a Markdown table under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import threading
import time
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench.harness.saving import save_results
from bench.harness.stats import medians
from bucketfs.backends import open_backend
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.urls import parse_bucket_url
from bucketfs.workers import in_worker
from tests.servers import S3Server

BUCKET = "workerhops"
SIZE = 100_000
CALLERS = 16
ARMS = ("plain threads", "through in_worker", "the hand-off alone",
        "libcurl on the trio thread")

Get = Callable[[str, str, int, int], Any]


def usage() -> tuple[float, int, int]:
    """CPU seconds, voluntary and involuntary context switches of this process so far
    (threads that ended included)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), own.ru_nvcsw, own.ru_nivcsw


def with_threads(get: Get, versions: dict[str, str]) -> None:
    keys = iter(versions)
    lock = threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                key = next(keys, None)
            if key is None:
                return
            get(key, versions[key], 0, SIZE)

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def with_in_worker(get: Get, versions: dict[str, str]) -> None:
    async def main() -> None:
        limiter = trio.CapacityLimiter(32)
        keys = iter(versions)

        async def caller() -> None:
            for key in keys:
                await in_worker(get, key, versions[key], 0, SIZE, limiter=limiter)

        async with trio.open_nursery() as nursery:
            for _ in range(CALLERS):
                nursery.start_soon(caller)

    trio.run(main)


def on_the_trio_thread(fetch: Callable[..., Any], versions: dict[str, str]) -> None:
    async def main() -> None:
        keys = iter(versions)

        async def caller() -> None:
            for key in keys:
                await fetch(key, versions[key], 0, SIZE)

        async with trio.open_nursery() as nursery:
            for _ in range(CALLERS):
                nursery.start_soon(caller)

    trio.run(main)


def measure(arm: str, backend: Any, versions: dict[str, str]) -> dict[str, float]:
    body = bytes(SIZE)
    run = {"plain threads": with_threads,
           "libcurl on the trio thread": on_the_trio_thread}.get(arm, with_in_worker)
    call = {"the hand-off alone": lambda *_: body,
            "libcurl on the trio thread": backend.async_get_range}.get(
                arm, backend.get_range)
    cpu, voluntary, involuntary = usage()
    began = time.monotonic()
    run(call, versions)
    wall = time.monotonic() - began
    cpu_after, voluntary_after, involuntary_after = usage()
    calls = len(versions)
    return {"cpu_ms_per_call": 1000 * (cpu_after - cpu) / calls,
            "voluntary_switches_per_call": (voluntary_after - voluntary) / calls,
            "involuntary_switches_per_call": (involuntary_after - involuntary) / calls,
            "calls_per_s": calls / wall}


def run(objects: int, rounds: int) -> dict[str, Any]:
    with S3Server() as server:
        server.create_bucket(BUCKET)
        client = server.client()
        keys = [f"k{i:06d}" for i in range(objects)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda key: client.put_object(Bucket=BUCKET, Key=key,
                                                        Body=os.urandom(SIZE)), keys))
        # The backend's credential chain reads the environment; it is put back after.
        with unittest.mock.patch.dict(os.environ, server.env()):
            backend = open_backend(parse_bucket_url(f"s3://{BUCKET}"),
                                   BackendSettings(addressing_style="path",
                                                   max_connections=32))
            versions = {key: backend.head(key).version for key in keys}
            rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
            for round_ in range(rounds):
                for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                    rows[arm].append(measure(arm, backend, versions))
                    print(f"round {round_ + 1}, {arm}: " + ", ".join(
                        f"{k} {v:.3f}" for k, v in rows[arm][-1].items()), flush=True)
    return {"objects": objects, "rounds": rounds, "size": SIZE, "callers": CALLERS,
            "machine": f"{os.uname().nodename}, {os.cpu_count()} cores",
            "arms": {arm: medians(rs, rs[0]) for arm, rs in rows.items()}}


def table(results: dict[str, Any]) -> str:
    lines = ["| arm | CPU per call | voluntary context switches per call | involuntary "
             "| calls/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for arm, row in results["arms"].items():
        lines.append(f"| {arm} | {row['cpu_ms_per_call']['median']:.3f} ms "
                     f"| {row['voluntary_switches_per_call']['median']:.2f} "
                     f"| {row['involuntary_switches_per_call']['median']:.2f} "
                     f"| {row['calls_per_s']['median']:,.0f} |")
    return ("\n".join(lines) + f"\n\nMedians of {results['rounds']} rounds of "
            f"{results['objects']} objects of {results['size']:,} bytes, {CALLERS} at a "
            f"time; {results['machine']}.\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_hops",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = run(args.objects, args.rounds)
    text = table(results)
    print(text, end="")
    save_results(args.out, "worker-hops", results, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
