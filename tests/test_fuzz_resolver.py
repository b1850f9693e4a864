"""Hostile orders: the resolver (`HintedPrefetch._resolve`) turns any paths, however deep,
long, odd or missing, into exactly the files the namespace shows at those paths and
counts every other path as not found; it never raises. Through the hints socket, such
orders are answered, resolved and planned without taking the daemon down."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import tempfile
from functools import partial
from pathlib import Path

import trio
from hypothesis import given
from hypothesis import strategies as st

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.hints.protocol import End, Order, Reply, encode
from bucketfs.hints_server import serve_hints
from bucketfs.namespace import Namespace
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.scheduler import PrefetchScheduler
from bucketfs.prefetcher import HintedPrefetch
from tests.fuzzing import fuzz, one_line
from tests.membackend import MemoryBackend
from tests.mounting import expected_tree
from tests.test_hints_server import receive_reply
from tests.test_prefetcher import settle, with_daemon

MiB = 1024**2
DEEP = 2_000  # segments: past Python's recursion limit

# --- Strategies --------------------------------------------------------------------------

name = st.sampled_from(["a", "b", "c", "f.jpg", "é", "日本", "x y", "a\nb", "\x1b[0m", "\t"])
# "\udcff" is the byte 0xff of a non-UTF-8 local name. No other lone surrogate: no backend
# lists one and no decoded order holds one.
odd = st.sampled_from(["", ".", "..", "\0", "a\0b", "L" * 256, "é" * 128, "\udcff", "\u2028",
                       "\x7f"])
bucket_keys = st.lists(
    st.lists(name | odd, min_size=1, max_size=4).map("/".join), max_size=10)


@st.composite
def order_paths(draw: st.DrawFn, tree: dict[str, str]) -> list[str]:
    """Paths that name files, directories and nothing: real ones, real ones bent out of
    shape, and made-up ones."""
    real = sorted(tree)
    real_path = st.sampled_from(real) if real else st.just("a")
    bent = st.builds(
        lambda path, how, extra: {
            "below": f"{path}/{extra}", "slash": f"{path}/", "lead": f"/{path}",
            "double": path.replace("/", "//"), "dot": f"{path}/.", "dotdot": f"{path}/../{path}",
            "nul": f"{path}\0", "prefix": path[:-1], "deep": "/".join([path] * 50),
        }[how],
        real_path, st.sampled_from(["below", "slash", "lead", "double", "dot", "dotdot", "nul",
                                    "prefix", "deep"]), name | odd)
    made_up = st.lists(name | odd, min_size=1, max_size=6).map("/".join)
    return draw(st.lists(st.one_of(real_path, real_path, bent, made_up), max_size=30))


def resolver(objects: dict[str, bytes], prefix: str) -> tuple[MemoryBackend, HintedPrefetch]:
    backend = MemoryBackend(objects)
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1), page_size=3)
    # Resolution uses the namespace alone; the cache is never asked (nor run).
    cache = BlockCache(store, RamTier(64 * MiB, make_policy()), None, block_size=4 * MiB,
                       nursery=None)  # type: ignore[arg-type]
    prefetch = HintedPrefetch(Namespace(store, prefix), cache,
                              PrefetchScheduler(window_bytes=8 * MiB, budget_bytes=8 * MiB),
                              connections=4, block_size=4 * MiB)
    return backend, prefetch


def check(objects: dict[str, bytes], prefix: str, paths: list[str]) -> None:
    """Resolve `paths` and compare with the model: a path resolves iff the tree the
    namespace shows has a file there, to that file's object, in order."""
    tree = expected_tree(objects, prefix)
    backend, prefetch = resolver(objects, prefix)
    try:
        resolved = trio.run(prefetch._resolve, paths)
    finally:
        prefetch.namespace.close()
    files = [prefix + path for path in paths if tree.get(path, "dir") != "dir"]
    assert [obj.key for obj in resolved] == files
    for obj in resolved:
        assert (obj.size, obj.version) == (len(objects[obj.key]), backend.version(obj.key))
    assert prefetch.unknown_paths == len(paths) - len(files)


# --- The resolver ------------------------------------------------------------------------


@fuzz(150)
@given(data=st.data(), keys=bucket_keys, prefix=st.sampled_from(["", "a/"]))
def test_any_paths_resolve_to_the_files_the_tree_shows(data, keys, prefix):
    objects = {prefix + key: key.encode("utf-8", "surrogatepass") for key in keys}
    paths = data.draw(order_paths(expected_tree(objects, prefix)))
    check(objects, prefix, paths)


def test_paths_thousands_of_segments_deep():
    deep_key = "/".join(["d"] * (DEEP - 1) + ["leaf"])
    objects = {deep_key: b"deep", "d/file": b"shallow"}
    paths = [
        deep_key,  # found, 2,000 directories down
        "/".join(["d"] * (DEEP - 1) + ["nope"]),  # its sibling is not there
        "/".join(["d"] * DEEP),  # a directory, not a file
        "/".join(["d"] * (DEEP + 5) + ["leaf"]),  # below a directory that has no such child
        "/".join(["x"] * DEEP),  # nothing from the first segment on
        "/".join(["d"] * 100 + [".."] * 100 + ["file"]),  # ".." is a name, not a way up
        "d/file",
    ]
    check(objects, "", paths)


def test_a_huge_order_of_mostly_missing_paths():
    objects = {f"c{i % 20}/{i:05d}.jpg": b"x" * (i % 7) for i in range(2_000)}
    rng = random.Random(11)
    paths = []
    for i in range(100_000):
        kind = i % 5
        n = rng.randrange(4_000)
        paths.append([f"c{n % 20}/{n:05d}.jpg",  # found when n < 2,000
                      f"c{n % 20}/missing-{n}",
                      f"nope{n % 50}/{n}.jpg",
                      f"c{n % 20}/{n:05d}.jpg/below",
                      f"c{n % 20}/é\n{n}"][kind])
    check(objects, "", paths)


# --- Orders through the socket -----------------------------------------------------------


def exchange(path: Path, message: Order | End) -> Reply:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(encode(message))
        return receive_reply(sock)


def test_hostile_orders_through_the_socket_never_take_the_daemon_down():
    deep = "/".join(["d"] * (DEEP - 1) + ["leaf"])  # 4,000 bytes: within the protocol's limit
    objects = {"train/ok.jpg": b"1" * 1000, f"train/{deep}": b"2" * 2000,
               "train/é/\x1b[31m red\n.jpg": b"3" * 3000}
    hostile = [
        deep, "ok.jpg", "é/\x1b[31m red\n.jpg",  # found
        "/".join(["d"] * (DEEP - 1) + ["nope"]), "/".join(["d"] * DEEP),  # missing, a dir
        "/".join(["x"] * DEEP), "L" * 300, "é/" + "é" * 200, "\u2028", "...", "ok.jpg/x",
        "ok.jpg\n", "\t", "日本/語",
    ]
    many = [f"missing/{i}.jpg" for i in range(100_000)]
    top = Path(tempfile.mkdtemp(prefix="bfr-"))
    sock_path = top / "state" / "hints.sock"

    def client() -> list[Reply]:
        return [exchange(sock_path, Order("hostile", 0, 1, 0, hostile)),
                exchange(sock_path, Order("many", 0, 1, 0, many)),
                # A next epoch's order with no order before it: refused, with a reason.
                exchange(sock_path, Order("stranger", 0, 1, 1, hostile, next_epoch=True)),
                exchange(sock_path, Order("late", 0, 2, 0, hostile))]

    async def body(prefetch: HintedPrefetch, read) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_hints, sock_path, owner_uid=os.getuid(),
                                        on_order=prefetch.on_order, on_end=prefetch.on_end))
            replies = await trio.to_thread.run_sync(client)
            refused = replies.pop(2)
            assert replies == [Reply(True)] * 3
            assert not refused.ok and one_line(refused.reason), refused
            assert "sent no order to follow" in refused.reason
            with trio.fail_after(60):  # all three installed (the deep path lists 2,000 dirs)
                while len(prefetch.scheduler.plans) < 3:
                    await trio.sleep(0.01)
            await settle(prefetch)
            # Each order's unknown paths are counted; none failed; the files are planned.
            assert prefetch.unknown_paths == 2 * (len(hostile) - 3) + len(many)
            assert getattr(prefetch, "failed_orders", 0) == 0
            for job in (("hostile", 0), ("late", 0)):
                assert set(prefetch.scheduler.plans[job].keys) == {
                    f"train/{p}" for p in hostile[:3]}
            assert await read(hostile[2]) == objects[f"train/{hostile[2]}"]
            # And the daemon goes on: the next client is served.
            assert await trio.to_thread.run_sync(exchange, sock_path, End("hostile")) \
                == Reply(True)
            assert ("hostile", 0) not in prefetch.scheduler.plans
            nursery.cancel_scope.cancel()

    try:
        trio.run(with_daemon, MemoryBackend(objects), body)
    finally:
        shutil.rmtree(top, ignore_errors=True)
