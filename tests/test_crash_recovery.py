"""Crash recovery of the cache's index, one bug at a time: each test leaves the index
where a kill -9 found it (everything written so far is kept, nothing after), opens it
again as the next mount does, and checks what that mount serves. The crash runs that
found these are in tests/test_crash.py."""

from __future__ import annotations

from rocksdict import Options, Rdict

from bucketfs.cache.listings import ROOT_INODE, TreeIndex
from bucketfs.cache.schema import DirEntry, tree_space

SPACE = tree_space("s3://bucket via http://127.0.0.1:1", "")


def open_index(path) -> Rdict:
    return Rdict(str(path), Options(raw_mode=True))


def test_inodes_of_a_listing_cut_short_are_never_handed_out_again(tmp_path):
    """A listing stores its pages as they come and says "listed" last. Killed between
    two pages, it left entries whose inode numbers the next mount handed out again: the
    other entry's inode record then sent reads of one file to the other file."""
    index = open_index(tmp_path / "index")
    tree = TreeIndex(index, SPACE)
    root = tree.begin(ROOT_INODE)
    tree.add_page(root, [DirEntry("a", True, "a/"), DirEntry("b", True, "b/")])
    tree.finish(root, 1.0)
    a, b = tree.child(ROOT_INODE, "a").inode, tree.child(ROOT_INODE, "b").inode
    cut = tree.begin(a)
    tree.add_page(cut, [DirEntry("x", False, "a/x", size=10, version="v1")])
    index.close()  # killed before the listing of a/ finished

    index = open_index(tmp_path / "index")
    tree = TreeIndex(index, SPACE)
    listing = tree.begin(b)
    tree.add_page(listing, [DirEntry("y", False, "b/y", size=20, version="v2")])
    tree.finish(listing, 2.0)
    listing = tree.begin(a)  # a/ was never listed to the end: listed again
    tree.add_page(listing, [DirEntry("x", False, "a/x", size=10, version="v1")])
    tree.finish(listing, 2.0)
    x, y = tree.child(a, "x"), tree.child(b, "y")
    assert x.inode != y.inode
    assert tree.entry_of(x.inode) == x
    assert tree.entry_of(y.inode) == y
    index.close()


def test_stamps_of_a_listing_cut_short_are_never_reused(tmp_path):
    """Two listings began after the last finished one; the second was cut short after
    a page. Its stamp must not be the next mount's, or that mount's listing takes the
    old entries for ones it has already seen and keeps them as they were."""
    index = open_index(tmp_path / "index")
    tree = TreeIndex(index, SPACE)
    root = tree.begin(ROOT_INODE)
    tree.add_page(root, [DirEntry("a", True, "a/"), DirEntry("b", True, "b/")])
    tree.finish(root, 1.0)
    a, b = tree.child(ROOT_INODE, "a").inode, tree.child(ROOT_INODE, "b").inode
    tree.begin(b)  # begun, nothing stored yet
    cut = tree.begin(a)
    tree.add_page(cut, [DirEntry("x", False, "a/x", size=10, version="old")])
    index.close()

    index = open_index(tmp_path / "index")
    tree = TreeIndex(index, SPACE)
    listing = tree.begin(a)
    tree.add_page(listing, [DirEntry("x", False, "a/x", size=11, version="new")])
    tree.finish(listing, 2.0)
    assert tree.child(a, "x").version == "new"
    assert tree.known_bytes == 11
    index.close()
