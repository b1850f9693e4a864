"""Hostile keys: whatever a bucket holds (unicode, control characters, `//`, `.`, `..`,
NUL, names over 255 bytes, very deep keys), the tree the namespace shows is the one the
model in tests/mounting.py predicts, every entry is found again by name, and nothing
but a skipped key (one warning) comes of a bad one."""

from __future__ import annotations

import hashlib
import logging

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.namespace import NAME_MAX, Namespace, invalid_name_reason
from tests.fuzzing import fuzz, one_line
from tests.membackend import MemoryBackend
from tests.mounting import expected_tree

# Few plain names, so that objects, prefixes and markers of one name meet.
segment = st.one_of(
    st.sampled_from(["a", "b", "a", "b", "c.txt"]),
    st.sampled_from([
        "", ".", "..", "...", "\0", "a\0b", " ", "\t", "\n", "\r", "\x7f", "\x1b[31m",
        "\u2028", "\ufeff", "é", "日本", "😀", "\udcff",  # a non-UTF-8 byte from a local dir
        "L" * NAME_MAX, "L" * (NAME_MAX + 1), "é" * 127, "é" * 128, "😀" * 63, "😀" * 64,
    ]),
    st.text(max_size=4),
)
keys = st.builds(lambda parts, marker: "/".join(parts) + ("/" if marker else ""),
                 st.lists(segment, min_size=1, max_size=5), st.booleans())
prefixes = st.sampled_from(["", "a/", "a/b/"])


def data_of(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")  # tells the objects apart


async def walk(ns: Namespace, objects: dict[str, bytes]) -> dict[str, str]:
    """The tree the namespace shows, as expected_tree writes it; checks on the way that
    each entry is found again by name, and each key is where its path says."""
    shown: dict[str, str] = {}
    pending = [(ns.root.inode, "")]
    while pending:  # not recursive: keys may be thousands of levels deep
        inode, path = pending.pop()
        for node in await ns.children(inode):
            here = f"{path}/{node.name}" if path else node.name
            assert invalid_name_reason(node.name) is None, node.name
            again = await ns.lookup(inode, node.name)
            assert again is not None and again.inode == node.inode
            if node.is_dir:
                assert node.key == ns.root.key + here + "/"
                shown[here] = "dir"
                pending.append((node.inode, here))
            else:
                assert node.key == ns.root.key + here
                assert node.size == len(objects[node.key])
                shown[here] = hashlib.sha256(objects[node.key]).hexdigest()
        for name in ("", ".", "..", "\0", "a\0b", "L" * (NAME_MAX + 1)):
            assert await ns.lookup(inode, name) is None
    return shown


def mount(objects: dict[str, bytes], prefix: str, page_size: int) -> Namespace:
    store = ObjectStore(MemoryBackend(objects), max_workers=2, retry=RetryPolicy(1),
                        page_size=page_size)
    return Namespace(store, prefix)


@fuzz(150)
@given(keys=st.lists(keys, max_size=12), prefix=prefixes,
       page_size=st.sampled_from([1, 2, 3, 1000]))
def test_any_keys_make_the_tree_the_model_predicts(keys, prefix, page_size):
    objects = {key: data_of(key) for key in keys}
    ns = mount(objects, prefix, page_size)
    try:
        shown = trio.run(walk, ns, objects)
    finally:
        ns.close()
    assert shown == expected_tree(objects, prefix)


@fuzz(300)
@given(name=st.text(st.characters(codec=None, categories=None), max_size=300)
       | segment)
def test_a_name_is_refused_for_one_documented_reason(name):
    if any(0xD800 <= ord(c) <= 0xDC7F or 0xDD00 <= ord(c) <= 0xDFFF for c in name):
        return  # no backend makes such a name: it stands for no byte (surrogateescape)
    reason = invalid_name_reason(name)
    bad = name in ("", ".", "..") or "\0" in name \
        or len(name.encode("utf-8", "surrogateescape")) > NAME_MAX
    assert (reason is not None) == bad, (name, reason)
    if reason is not None:
        assert one_line(reason)


def test_keys_thousands_of_levels_deep(caplog):
    depth = 2000  # past Python's recursion limit, as one unbounded path would go
    deep = "d/" * (depth - 1) + "leaf"
    objects = {deep: data_of(deep), "d/" * 10 + "..": b"", "d/" * 20 + "x\0y/z": b""}
    ns = mount(objects, "", 1000)

    async def main() -> None:
        inode = ns.root.inode
        for _ in range(depth - 1):
            node = await ns.lookup(inode, "d")
            assert node is not None and node.is_dir
            inode = node.inode
        leaf = await ns.lookup(inode, "leaf")
        assert leaf is not None and leaf.key == deep and leaf.size == len(deep)

    with caplog.at_level(logging.WARNING, logger="bucketfs.namespace"):
        try:
            trio.run(main)
        finally:
            ns.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "bucketfs.namespace"]
    assert len(warnings) == 2 and all(one_line(w) for w in warnings), warnings


@pytest.mark.parametrize("prefix", ["", "a/"])
def test_a_bad_key_is_skipped_with_one_warning(caplog, prefix):
    objects = {f"{prefix}ok": b"1", f"{prefix}x\0y": b"", f"{prefix}.": b"",
               f"{prefix}{'L' * 300}": b"", f"{prefix}d/../e": b"", f"{prefix}a//b": b""}
    ns = mount(objects, prefix, 1000)
    with caplog.at_level(logging.WARNING, logger="bucketfs.namespace"):
        try:
            shown = trio.run(walk, ns, objects)
            again = trio.run(walk, ns, objects)  # listed once: no second warning
        finally:
            ns.close()
    assert shown == again == expected_tree(objects, prefix) == {"ok": hashlib.sha256(
        b"1").hexdigest(), "d": "dir", "a": "dir"}
    warnings = [r.getMessage() for r in caplog.records if r.name == "bucketfs.namespace"]
    assert len(warnings) == 5 and all(one_line(w) for w in warnings), warnings
