"""The Grafana dashboard only queries metrics the daemon exports (the list in
bucketfs/metrics.py is the one place names are defined)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import bucketfs.metrics

DASHBOARD = Path(__file__).parent.parent / "packaging/grafana/bucketfs-dashboard.json"


def exported_names() -> set[str]:
    names = set(re.findall(r"^\s+(bucketfs_[a-z_]+)", bucketfs.metrics.__doc__ or "", re.M))
    # A histogram is exported as _bucket, _sum and _count series.
    return names | {f"{n}_{s}" for n in names for s in ("bucket", "sum", "count")}


def test_every_query_names_an_exported_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    assert "bucketfs_prefetch_hits_total" in exported
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"bucketfs_[a-z_]+", target["expr"]))
    assert queried and queried <= exported, queried - exported
    variable = dashboard["templating"]["list"][0]["query"]
    assert set(re.findall(r"bucketfs_[a-z_]+", variable)) <= exported
