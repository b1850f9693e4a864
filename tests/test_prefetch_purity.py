"""prefetch/ holds the decisions (what to fetch, what to evict, how to lay out chunks):
pure, deterministic code a trace can be replayed through without FUSE, a network or the
daemon. It imports only the standard library and itself, as hints/ does."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PREFETCH = Path(__file__).resolve().parent.parent / "prefetch"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_prefetch_imports_only_the_standard_library_and_itself():
    modules = sorted(PREFETCH.glob("*.py"))
    assert len(modules) >= 6
    for path in modules:
        for name in imported_modules(path):
            top = name.partition(".")[0]
            ok = top in sys.stdlib_module_names or name.startswith("bucketfs.prefetch")
            assert ok, f"{path.name} imports {name}"


def test_importing_prefetch_loads_no_daemon_dependency():
    names = [f"bucketfs.prefetch.{p.stem}" for p in sorted(PREFETCH.glob("*.py"))
             if p.stem != "__init__"]
    code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
            "heavy = {'trio', 'pyfuse3', 'boto3', 'botocore', 'google', 'rocksdict', "
            "'prometheus_client', 'torch'}\n"
            "loaded = {m.partition('.')[0] for m in sys.modules} & heavy\n"
            "ours = sorted(m for m in sys.modules if m.startswith('bucketfs.') and not "
            "m.startswith('bucketfs.prefetch'))\n"
            "print(sorted(loaded), ours)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[] []"
