"""What keeps the code easy to follow stays true: no module over 600 lines, in the package
(bucketfs/, prefetch/, hints/) or around it (bench/, tests/, packaging/), and no import
cycle among bucketfs's modules (imports made only for type checking count too: two
modules that name each other are one tangle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"bucketfs": ROOT / "bucketfs", "bucketfs.prefetch": ROOT / "prefetch",
            "bucketfs.hints": ROOT / "hints"}
#: The rest of the project's Python: benchmarks, tests and their helpers, packaging.
AROUND = [ROOT / "bench", ROOT / "tests", ROOT / "packaging"]


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The known modules `path` imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import submodule` needs the submodule, not the package's
            # other contents.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def test_no_module_is_over_600_lines():
    paths = [*modules().values(), *(p for d in AROUND for p in d.rglob("*.py"))]
    assert len(paths) > 200  # the walk found the tree
    long = {str(path.relative_to(ROOT)): n for path in paths
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, long


def test_no_import_cycle_in_the_package():
    found = modules()
    graph = {name: imports(path, set(found)) - {name}
             for name, path in found.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycle = [*path[path.index(other):], other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
