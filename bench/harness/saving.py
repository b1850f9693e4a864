"""Where a one-command benchmark leaves its results: OUT/NAME-<time>.json and .md."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def save_results(out: Path, name: str, results: dict[str, Any], text: str) -> Path:
    """Write the results as JSON and their Markdown table under `out`; the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"{name}-{stamp}.json"
    path.write_text(json.dumps(results, indent=1))
    path.with_suffix(".md").write_text(text)
    return path
