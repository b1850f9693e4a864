"""bench.worker_hops runs end to end against SeaweedFS and reports every arm."""

from __future__ import annotations

import json
import os

from bench import worker_hops


def test_every_arm_is_measured_in_cpu_and_context_switches(tmp_path, capsys):
    assert worker_hops.main(["--objects", "48", "--rounds", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("worker-hops-*.json")).read_text())
    assert list(saved["arms"]) == list(worker_hops.ARMS)
    for arm, row in saved["arms"].items():
        assert len(row["cpu_ms_per_call"]["rounds"]) == 2
        assert row["cpu_ms_per_call"]["median"] > 0, arm
        # Every arm waits on the network; all but libcurl's also hand work between
        # threads, which blocks at least once per call.
        floor = 0 if arm == "libcurl on the trio thread" else 0.5
        assert row["voluntary_switches_per_call"]["median"] > floor, arm
        assert row["calls_per_s"]["median"] > 0, arm
    out = capsys.readouterr().out
    assert "| through in_worker |" in out and "| plain threads |" in out
    assert "| libcurl on the trio thread |" in out


def test_the_server_credentials_do_not_stay_in_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert worker_hops.main(["--objects", "16", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert "AWS_ENDPOINT_URL" not in os.environ  # later tests see no stopped server's
