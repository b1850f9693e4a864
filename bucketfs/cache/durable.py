"""Writing a cache file so that a crash at any moment leaves nothing torn under its real
name: write `NAME.<thread>.tmp`, fsync, rename to `NAME`. The caller records it in the
index only after this returns; the startup sweep deletes what a crash left in between."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path


def write_durably(path: Path, parts: Iterable[bytes]) -> None:
    temporary = path.with_name(f"{path.name}.{threading.get_ident():x}.tmp")
    try:
        with open(temporary, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
