"""file:// backend: a local directory served as if it were a bucket.

Files become objects keyed by their path relative to the root; directories become
prefixes (an empty directory reads like a `dir/` marker object). It is the embedded
default for demos and tests, so it follows the same contract as the cloud backends.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from bucketfs.backends.base import (
    AccessDenied,
    ListPage,
    NoSuchBucket,
    NotFound,
    ObjectInfo,
    TransientError,
    VersionChanged,
)


def _version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}"


class LocalBackend:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def close(self) -> None:
        pass

    def check_access(self) -> None:
        if not self.root.is_dir():
            raise NoSuchBucket(f"no such directory: {self.root}")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDenied(f"access denied to {self.root}")

    def _path(self, key: str) -> Path:
        return self.root / key

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key=key, size=st.st_size, mtime_ns=st.st_mtime_ns, version=_version(st))

    def head(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no such object: {key}") from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(f"no such object: {key}")
        return self._info(key, st)

    def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise VersionChanged(f"object {key} is gone") from None
        try:
            if _version(os.fstat(fd)) != version:
                raise VersionChanged(f"object {key} changed")
            data = os.pread(fd, length, start)
            # Again after the read: a file rewritten in place meanwhile (not replaced by
            # a rename) could have handed us bytes of two versions.
            if _version(os.fstat(fd)) != version:
                raise VersionChanged(f"object {key} changed while it was read")
        finally:
            os.close(fd)
        if len(data) != length:
            raise TransientError(f"short read of {key}: {len(data)} of {length} bytes")
        return data

    def _walk(self, directory: str) -> list[tuple[str, os.stat_result | None]]:
        """Keys below `directory` ("" or ending in "/"), recursively: (key, stat) for files,
        (key + "/", None) for empty directories."""
        out: list[tuple[str, os.stat_result | None]] = []
        try:
            entries = list(os.scandir(self._path(directory)))
        except (FileNotFoundError, NotADirectoryError):
            return out
        if not entries and directory:
            out.append((directory, None))
        for entry in entries:
            key = directory + entry.name
            if entry.is_dir(follow_symlinks=True):
                out.extend(self._walk(key + "/"))
            elif entry.is_file(follow_symlinks=True):
                out.append((key, entry.stat(follow_symlinks=True)))
        return out

    def list_page(
        self, prefix: str, delimiter: str | None, token: str | None, page_size: int
    ) -> ListPage:
        # Walk only the directory that holds the prefix; then filter as S3 would.
        directory = prefix[: prefix.rfind("/") + 1]
        if delimiter == "/":
            rows: list[tuple[str, os.stat_result | None]] = []
            try:
                entries = list(os.scandir(self._path(directory)))
            except (FileNotFoundError, NotADirectoryError):
                entries = []
            for entry in entries:
                key = directory + entry.name
                if entry.is_dir(follow_symlinks=True):
                    rows.append((key + "/", None))
                elif entry.is_file(follow_symlinks=True):
                    rows.append((key, entry.stat(follow_symlinks=True)))
        elif delimiter is None:
            rows = self._walk(directory)
        else:
            raise ValueError("the file backend supports only '/' as delimiter")
        rows = sorted(r for r in rows if r[0].startswith(prefix) and r[0] != prefix)
        if token is not None:
            rows = [r for r in rows if r[0] > token]
        page = ListPage()
        for key, st in rows[:page_size]:
            if st is None:
                if delimiter:
                    page.prefixes.append(key)
                else:
                    page.objects.append(ObjectInfo(key=key, size=0, mtime_ns=0, version="dir"))
            else:
                page.objects.append(self._info(key, st))
        if len(rows) > page_size:
            page.next_token = rows[page_size - 1][0]
        return page
