"""Which bucketfs a benchmark's daemon runs: the tree the benchmark itself was run from.

The CLI starts the daemon as `python -P -m bucketfs` (-P: never import a `bucketfs`
directory from the current directory), so a daemon imports the installed package, which
is this checkout only when it was installed editable from it. A benchmark run from a
second tree (a git worktree holding the change to compare) would then measure the
installed code in both arms. Every benchmark that spawns a daemon passes `this_tree()`
in its environment: PYTHONPATH is honoured under -P.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout this module belongs to (its bucketfs/ and bench/ sit side by side).
ROOT = Path(__file__).resolve().parents[2]


def this_tree() -> dict[str, str]:
    """Environment entries that make a spawned daemon import this checkout's bucketfs."""
    inherited = os.environ.get("PYTHONPATH")
    path = str(ROOT) if not inherited else f"{ROOT}{os.pathsep}{inherited}"
    return {"PYTHONPATH": path}
