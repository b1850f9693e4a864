"""The shared-tier benchmark's pure parts: the port-split shaping, counting requests by
method, the prices and savings, the report. No network shaping, no mounts, no root."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from bench.harness.httpcount import RequestStream
from bench.harness.netlab import PortLink, htb_commands, port_class_commands
from bench.shared_report import (
    GB,
    Prices,
    compare,
    compare_repeats,
    express_cost,
    express_excess_bytes,
    markdown,
    node_costs,
    origin_cost,
    shared_request_classes,
)
from bench.shared_tier import (
    NODES,
    ORIGIN_LINK,
    SHARED_LINK,
    log_problems,
    node_order,
    parse_class_bytes,
    proxy_delta,
    read_epoch,
    rewrite,
)

PRICES = Prices()

# --- two paths over one veth -----------------------------------------------------------


def test_each_port_gets_its_own_class_and_a_filter_on_the_right_port_field() -> None:
    links = (PortLink(9001, 1000), PortLink(9002, 50))
    origin_end = port_class_commands("bfsb-origin", "bfsb-o", "sport", links)
    assert len(origin_end) == 4
    cls, flt = origin_end[0], origin_end[1]
    assert cls[:3] == ["tc", "-n", "bfsb-origin"] and "bfsb-o" in cls
    assert cls[cls.index("classid") + 1] == "1:11"
    assert cls[cls.index("rate") + 1] == cls[cls.index("ceil") + 1] == "1000mbit"
    # The server's replies leave from its port: matched by source port, sent to 1:11.
    assert flt[flt.index("u32"):] == ["u32", "match", "ip", "sport", "9001", "0xffff",
                                      "flowid", "1:11"]
    assert origin_end[2][origin_end[2].index("classid") + 1] == "1:12"
    assert "50mbit" in origin_end[2] and "9002" in origin_end[3]
    client_end = port_class_commands("bfsb-client", "bfsb-c", "dport", links[:1])
    assert client_end[1][client_end[1].index("u32") + 3] == "dport"
    with pytest.raises(ValueError, match="sport or dport"):
        port_class_commands("bfsb-client", "bfsb-c", "src", links)


def test_no_port_links_leave_the_one_class_setup_as_it_was() -> None:
    assert port_class_commands("bfsb-origin", "bfsb-o", "sport", ()) == []
    default = htb_commands("bfsb-origin", "bfsb-o", 200)
    # Unclassified traffic (the origin's port) falls into the default class 1:10.
    assert default[0][default[0].index("default") + 1] == "10"
    assert default[1][default[1].index("classid") + 1] == "1:10"


def test_the_links_are_what_the_issue_asks_for() -> None:
    assert (ORIGIN_LINK.rtt_ms, ORIGIN_LINK.mbit) == (30, 200)
    assert (SHARED_LINK.rtt_ms, SHARED_LINK.mbit) == (1, 1000)
    assert SHARED_LINK.one_way_delay_ms == 0.5
    assert [n.shared for n in NODES] == [True, True, False]
    names = [[p.name for p in node_order(r, baseline=True)] for r in range(2)]
    assert names == [["node 1", "node 2", "baseline"], ["baseline", "node 1", "node 2"]]
    assert [p.name for p in node_order(1, baseline=False)] == ["node 1", "node 2"]


# --- counting by method ----------------------------------------------------------------


def _request(method: str, target: str, body: bytes = b"") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def test_puts_and_deletes_are_told_apart_by_method() -> None:
    methods: dict[str, int] = {}
    stream = RequestStream(methods=methods)
    stream.feed(_request("PUT", "/shared/nodes/a", b"PUT /x HTTP/1.1\r\n\r\n")
                + _request("GET", "/shared/nodes/a") + _request("DELETE", "/shared/nodes/a")
                + _request("GET", "/shared?list-type=2&prefix=nodes"))
    assert stream.counts == {"GET": 1, "HEAD": 0, "LIST": 1, "OTHER": 2}
    assert methods == {"PUT": 1, "GET": 2, "DELETE": 1}
    assert RequestStream().methods is None  # the other callers' streams are unchanged


def test_proxy_deltas_subtract_the_nested_method_counts_too() -> None:
    before = {"GET": 5, "bytes_down": 100, "methods": {"GET": 5, "PUT": 2}}
    after = {"GET": 9, "bytes_down": 350, "LIST": 1, "methods": {"GET": 10, "PUT": 2,
                                                                  "HEAD": 3}}
    assert proxy_delta(before, after) == {"GET": 4, "bytes_down": 250, "LIST": 1,
                                          "methods": {"GET": 5, "HEAD": 3}}


# --- prices ------------------------------------------------------------------------------


def test_express_prices_are_the_published_ones() -> None:
    assert PRICES.express_put_per_1000 == 0.00113
    assert PRICES.express_get_per_1000 == 0.00003
    assert (PRICES.express_upload_per_gb, PRICES.express_retrieval_per_gb) == (0.0032, 0.0006)
    assert PRICES.express_storage_per_gb_month == 0.11
    assert PRICES.origin_get_per_1000 == 0.0004 and PRICES.origin_egress_per_gb == 0.02


def test_only_bytes_above_512_kib_pay_the_express_data_fee() -> None:
    assert express_excess_bytes([100 * 1024, 512 * 1024], PRICES) == 0
    assert express_excess_bytes([100 * 1024, 612 * 1024], PRICES) == 50 * 1024
    assert express_excess_bytes([], PRICES) == 0


def test_shared_requests_are_split_as_express_bills_them() -> None:
    counted = {"GET": 2000, "HEAD": 5, "LIST": 3, "OTHER": 2010,
               "methods": {"GET": 2003, "HEAD": 5, "PUT": 2000, "DELETE": 10}}
    classes = shared_request_classes(counted)
    # The 3 listings are GETs of the bucket, billed as writes: 2,000 GETs + 5 HEADs read.
    assert classes == {"reads": 2005, "writes": 2003, "free": 10, "data_gets": 2000,
                       "puts": 2000}
    cost = express_cost(classes, excess_per_object=GB / 1000, prices=PRICES)
    assert cost == pytest.approx(2005 * 0.00003 / 1000 + 2003 * 0.00113 / 1000
                                 + 2 * 0.0032 + 2 * 0.0006)


def test_origin_cost_is_requests_plus_egress() -> None:
    cost = origin_cost({"GET": 2000, "HEAD": 10, "LIST": 2, "bytes_down": 3 * GB}, PRICES)
    assert cost["origin_requests_usd"] == pytest.approx((2010 * 0.0004 + 2 * 0.005) / 1000)
    assert cost["origin_egress_usd"] == pytest.approx(0.06)
    assert cost["origin_usd"] == pytest.approx(cost["origin_requests_usd"] + 0.06)


# --- a run's results ---------------------------------------------------------------------


def _node(name: str, repeat: int, origin_gets: int, origin_bytes: int,
          shared_counted: dict[str, Any], wall: float,
          status: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "name": name, "repeat": repeat, "shared": status is not None, "status": "ok",
        "epoch": {"files": 2000, "bytes": 220_000_000, "wall_s": wall,
                  "files_per_s": 2000 / wall, "mb_per_s": 220 / wall, "bad_reads": 0},
        "daemon_cpu_s": 2.4, "daemon_cpu_life_s": 3.0, "unmount_s": 1.5,
        "daemon_status": {"shared": status} if status is not None else {},
        "log_problems": {"count": 0, "lines": []},
        "total": {"origin": {"GET": origin_gets, "HEAD": 0, "LIST": 21, "OTHER": 0,
                             "bytes_down": origin_bytes},
                  "shared": {"bytes_down": 0, "bytes_up": 0, "methods": {},
                             **shared_counted}},
    }


STATUS_1 = {"lookups": 2000, "hits": 0, "misses": 2000, "invalid": 0, "errors": 0,
            "bytes_read": 0, "writes": 1990, "bytes_written": 219_000_000, "dropped": 0,
            "up": True, "requests": {"get": 2000, "put": 1990, "list": 0, "delete": 0}}
STATUS_2 = {**STATUS_1, "hits": 2000, "misses": 0, "bytes_read": 220_000_000,
            "writes": 0, "bytes_written": 0,
            "requests": {"get": 2000, "put": 0, "list": 0, "delete": 0}}


def _results(repeats: int = 1) -> dict[str, Any]:
    """A run whose node 2 takes 6.0, 7.2, 6.6 s in repeats 1-3 (the others 30 and 29)."""
    results: dict[str, Any] = {
        "command": "python -m bench.shared_tier", "machine": "test box",
        "started": "a", "finished": "b", "scenario": "imagenet-small", "threads": 16,
        "repeats": repeats,
        "dataset": {"images": 2000, "image_bytes": 220_000_000,
                    "sizes": {"mean": 110_000, "median": 97_000}},
        "links": {"origin": {"rtt_ms": 30, "mbit": 200, "port": 9000},
                  "shared": {"rtt_ms": 1, "mbit": 1000, "port": 9001}},
        "prices": {"read": "2025-04"}, "express_excess_bytes_per_object": 0.0,
        "bucketfs_source": [{"commit": "abc", "modified_files": 3, "digest": "d1"}],
        "rtt_ms": {"origin": 36.0, "shared": 3.0},
        "load_average": [[0.4, 0.5, 0.6], [3.14, 2.0, 1.0]],
        "tc_class_bytes": {"bfsb-origin": {"1:10": 221_000_000, "1:11": 222_000_000}},
        "nodes": [],
    }
    for repeat in range(repeats):
        results["nodes"] += [
            _node("node 1", repeat, 2000, 221_000_000,
                  {"GET": 2000, "OTHER": 2000, "bytes_up": 221_000_000,
                   "methods": {"GET": 2000, "PUT": 2000}}, 30.0, STATUS_1),
            _node("node 2", repeat, 0, 1_000_000,
                  {"GET": 2000, "bytes_down": 221_000_000, "methods": {"GET": 2000}},
                  (6.0, 7.2, 6.6)[repeat], STATUS_2),
            _node("baseline", repeat, 2000, 221_000_000, {}, 29.0, None),
        ]
    for node in results["nodes"]:
        node["cost"] = node_costs(node, results, PRICES)
    results["comparisons"] = compare_repeats(results, PRICES)
    return results


def test_node_2_against_node_1_and_the_baseline() -> None:
    comparisons = compare(_results()["nodes"], 2000, PRICES)
    against1 = comparisons["node 1"]
    assert against1["speedup"] == pytest.approx(5.0)
    assert (against1["origin_GET_saved"], against1["origin_LIST_saved"]) == (2000, 0)
    assert against1["origin_requests_saved"] == 2000
    assert against1["origin_bytes_saved"] == 220_000_000
    assert against1["origin_requests_usd_saved"] == pytest.approx(2000 * 0.0004 / 1000)
    assert against1["origin_egress_usd_saved"] == pytest.approx(220e6 / GB * 0.02)
    # Node 1 paid for 2,000 lookups and 2,000 PUTs; node 2 for 2,000 GETs.
    more = (2000 * 0.00003 - 2000 * 0.00003 - 2000 * 0.00113) / 1000
    assert against1["shared_usd_difference"] == pytest.approx(more)
    against_base = comparisons["baseline"]
    net = 2000 * 0.0004 / 1000 + 220e6 / GB * 0.02 - 2000 * 0.00003 / 1000
    assert against_base["net_usd_saved"] == pytest.approx(net)
    assert against_base["net_usd_saved_per_million_files"] == pytest.approx(net * 500)
    fill = comparisons["fill"]
    # The proxy's count (the drain included), not the daemon's (taken before it).
    assert fill["stored_bytes"] == 221_000_000
    assert fill["usd"] == pytest.approx((2000 * 0.00003 + 2000 * 0.00113) / 1000)
    assert fill["storage_usd_per_month"] == pytest.approx(221e6 / GB * 0.11)


def test_comparisons_are_made_within_a_repeat_and_skip_failed_nodes() -> None:
    results = _results(repeats=3)
    assert [c["repeat"] for c in results["comparisons"]] == [0, 1, 2]
    assert [c["node 1"]["epoch_s_after"] for c in results["comparisons"]] == [6.0, 7.2, 6.6]
    results["nodes"][1]["status"] = "error: boom"  # node 2 of repeat 1
    assert set(compare_repeats(results, PRICES)[0]) == {"repeat", "fill"}


def test_the_report_has_every_node_its_counters_costs_and_savings() -> None:
    results = _results()
    text = markdown(results)
    assert "Command: `python -m bench.shared_tier`. Machine: test box." in text
    # node 2: no origin GETs, 1 MB from the origin, the shared tier's 2,000 GETs.
    assert ("| node 2 | 6.0 | 333 | 36.7 | 0 / 0 / 21 | 1.0 | 0.0 / 1.8 | 2,000 / 0 / 0 "
            in text)
    assert ("| node 1 | 30.0 | 67 | 7.3 | 2,000 / 0 / 21 | 221.0 | 8.8 / 0.0 "
            "| 2,000 / 2,000 / 0 " in text)
    assert "| 1.20 | 0 |" in text  # 2.4 s of daemon CPU over 2,000 files
    # The status table: "skipped" is missing from this daemon's counters, shown as "—".
    assert ("| node 2 | 2,000 | 2,000 | 0 | 0 | 0 | — | 220.0 | 0 | 0.0 | 0 "
            "| 2,000 / 0 / 0 / 0 |" in text)
    assert "| node | lookups | hits | misses | invalid | errors | skipped | MB read |" in text
    assert "| baseline | 29.0 → 6.0 | 4.83x | 2,000 | 220.0 |" in text
    assert "origin 36.0 ms, shared 3.0 ms" in text
    assert "Cells: median (min\u2013max) of 1 run" in text
    assert "1:11 222.0 MB" in text
    assert "Load average (1 min) before the run: 0.4." in text
    assert "Problems:" not in text and "changed during the run" not in text
    json.dumps(results)  # what the run writes is plain JSON


def test_the_report_gives_medians_and_ranges_over_repeats() -> None:
    text = markdown(_results(repeats=3))
    assert "| node 2 | 6.6 (6.0\u20137.2) | 303 (278\u2013333) |" in text
    assert "| node 1 | 30.0 | 67 |" in text  # no spread: just the figure
    assert "| node 1 | 30.0 → 6.6 (6.0\u20137.2) | 4.55 (4.17\u20135.00)x |" in text
    assert "of 3 repeats;" in text
    cut = _results(repeats=2)
    cut["repeats"] = 3
    assert "of 2 repeats (of 3 asked for: the run was cut short)" in markdown(cut)


def test_the_report_says_what_went_wrong() -> None:
    results = _results()
    node2 = results["nodes"][1]
    node2["daemon_status"] = {}
    node2["log_problems"] = {"count": 2, "lines": ["WARNING shared tier: timed out"]}
    node2["epoch"]["bad_reads"] = 1
    node2["epoch"]["bad_examples"] = ["c/x.jpg: 12 bytes, not the expected content"]
    results["bucketfs_source"].append({"digest": "d2"})
    text = markdown(results)
    assert "| node 2 | — |" in text and "no `shared` section" in text
    assert "node 2, repeat 1: 2 warning/error lines" in text and "timed out" in text
    assert "node 2, repeat 1: 1 bad reads" in text
    assert "changed during the run" in text
    broken = _results(repeats=2)
    broken["nodes"][0]["status"] = "error: RuntimeError: mount exited with 1"
    assert "| node 1 (1 of 2 failed: error: RuntimeError: mount exited with 1) | 30.0 |" \
        in markdown(broken)


# --- reading an epoch --------------------------------------------------------------------


def test_an_epoch_counts_wrong_and_missing_files(tmp_path: Path) -> None:
    expected = {}
    for i in range(20):
        data = bytes([i]) * (1000 + i)
        (tmp_path / f"f{i}").write_bytes(data)
        expected[f"f{i}"] = (len(data), zlib.crc32(data))
    good = read_epoch(tmp_path, expected, threads=4, seed=0)
    assert (good["files"], good["bad_reads"]) == (20, 0)
    assert good["bytes"] == sum(size for size, _ in expected.values())
    (tmp_path / "f3").write_bytes(b"\xff" * 1003)  # same size, other bytes
    (tmp_path / "f7").unlink()
    bad = read_epoch(tmp_path, expected, threads=4, seed=1)
    assert bad["bad_reads"] == 2
    assert sorted(e.split(":")[0] for e in bad["bad_examples"]) == ["f3", "f7"]


def test_log_problems_finds_warnings_and_errors(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    log.write_text("INFO mounted\nWARNING shared tier slow\nINFO x\nERROR boom\n")
    assert log_problems(log) == {"count": 2, "lines": ["WARNING shared tier slow",
                                                       "ERROR boom"]}
    assert log_problems(tmp_path / "missing.log") == {"count": 0, "lines": []}


def test_class_bytes_are_read_from_tc_text() -> None:
    text = """class htb 1:11 root prio 0 rate 1Gbit ceil 1Gbit burst 1375b cburst 1375b
 Sent 222000000 bytes 150000 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
class htb 1:10 root prio 0 rate 200Mbit ceil 200Mbit burst 1600b cburst 1600b
 Sent 1234 bytes 3 pkt (dropped 0, overlimits 0 requeues 0)
"""
    assert parse_class_bytes(text) == {"1:11": 222_000_000, "1:10": 1234}
    assert parse_class_bytes("") == {}


def test_a_finished_run_is_reported_again_from_its_json(tmp_path: Path) -> None:
    results = _results(repeats=2)
    for node in results["nodes"]:
        node["cost"] = {}  # as if written with other prices
    results["comparisons"] = []
    (tmp_path / "results.json").write_text(json.dumps(results))
    text = rewrite(tmp_path)
    assert (tmp_path / "report.md").read_text() == text
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["prices"]["express_put_per_1000"] == 0.00113
    assert saved["nodes"][0]["cost"]["shared_usd"] > 0
    assert [c["repeat"] for c in saved["comparisons"]] == [0, 1]
    assert "| baseline | 29.0 → 6.6 (6.0\u20137.2) |" in text
