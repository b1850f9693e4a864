"""The shared-tier benchmark's prices, costs, comparisons and Markdown (pure: no root, no
network), for `python -m bench.shared_tier`.

Prices in US dollars, us-east-1, list prices as published by AWS on
https://aws.amazon.com/s3/pricing/ , as read 2025-04; this machine cannot reach the
page, so check them before quoting a cost:
  origin, S3 Standard: GET (and HEAD, "all other requests") $0.0004 per 1,000; LIST
      $0.005 per 1,000 (the constants of bench/harness/costs.py). Data transfer out to
      another AWS region $0.02/GB (the inter-region rate; to the internet it is
      $0.09/GB and up): the egress a nearby shared tier saves when the origin is far.
  shared tier, S3 Express One Zone, after the April 2025 price change: PUT, COPY, POST,
      LIST $0.00113 per 1,000; GET, HEAD and all other requests $0.00003 per 1,000;
      for the part of each request above 512 KB, data upload $0.0032/GB and data
      retrieval $0.0006/GB; storage $0.11/GB-month. DELETE requests are free.
A GB is 2**30 bytes, as AWS bills it; 512 KB is taken as 512 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.harness import costs
from bench.harness.stats import format_summary, summarize

GB = 2**30
PRICES_READ = "2025-04"
#: Request kinds as the delay proxy counts them (httpcount.KINDS).
ORIGIN_KINDS = ("GET", "HEAD", "LIST", "OTHER")
#: Methods S3 bills at its PUT-class price (LIST is added from the kind counts).
WRITE_METHODS = ("PUT", "POST", "COPY")
FREE_METHODS = ("DELETE",)


@dataclass(frozen=True)
class Prices:
    origin_get_per_1000: float = costs.S3_GET_PER_1000
    origin_list_per_1000: float = costs.S3_LIST_PER_1000
    origin_egress_per_gb: float = 0.02
    express_put_per_1000: float = 0.00113
    express_get_per_1000: float = 0.00003
    express_upload_per_gb: float = 0.0032
    express_retrieval_per_gb: float = 0.0006
    express_free_bytes: int = 512 * 1024
    express_storage_per_gb_month: float = 0.11
    read: str = PRICES_READ


def express_excess_bytes(sizes: list[int], prices: Prices) -> float:
    """Mean bytes per object above the size S3 Express charges no data fee for: what
    one whole-object GET or PUT of a dataset's file pays the per-GB fee on."""
    if not sizes:
        return 0.0
    return sum(max(0, s - prices.express_free_bytes) for s in sizes) / len(sizes)


def shared_request_classes(counted: dict[str, Any]) -> dict[str, int]:
    """A proxy's counts of the shared tier split the way S3 Express bills them: reads
    (GET, HEAD and other requests; GETs of the data among them), writes (PUT, POST,
    COPY, LIST) and free ones (DELETE)."""
    methods: dict[str, int] = counted.get("methods", {})
    lists = int(counted.get("LIST", 0))
    writes = sum(methods.get(m, 0) for m in WRITE_METHODS) + lists
    free = sum(methods.get(m, 0) for m in FREE_METHODS)
    everything = sum(methods.values())
    data_gets = max(0, methods.get("GET", 0) - lists)
    return {"reads": everything - writes - free, "writes": writes, "free": free,
            "data_gets": data_gets, "puts": methods.get("PUT", 0)}


def express_cost(classes: dict[str, int], excess_per_object: float,
                 prices: Prices) -> float:
    """Dollars for a shared tier's requests at S3 Express One Zone prices; the per-GB
    fees are charged on each data GET and PUT's bytes above the free size."""
    requests = (classes["reads"] * prices.express_get_per_1000
                + classes["writes"] * prices.express_put_per_1000) / 1000
    data = (classes["puts"] * excess_per_object * prices.express_upload_per_gb
            + classes["data_gets"] * excess_per_object * prices.express_retrieval_per_gb)
    return requests + data / GB


def origin_cost(counted: dict[str, Any], prices: Prices) -> dict[str, float]:
    """The origin's requests at S3 Standard prices, and its bytes out at the egress rate."""
    cheap = sum(counted.get(k, 0) for k in ("GET", "HEAD", "OTHER"))
    requests = (cheap * prices.origin_get_per_1000
                + counted.get("LIST", 0) * prices.origin_list_per_1000) / 1000
    egress = counted.get("bytes_down", 0) / GB * prices.origin_egress_per_gb
    return {"origin_requests_usd": requests, "origin_egress_usd": egress,
            "origin_usd": requests + egress}


def node_costs(node: dict[str, Any], results: dict[str, Any],
               prices: Prices) -> dict[str, Any]:
    """What one node's whole life (mount, epoch, unmount and its drain) cost."""
    total = node["total"]
    out: dict[str, Any] = origin_cost(total["origin"], prices)
    classes = shared_request_classes(total["shared"])
    out["shared_requests"] = classes
    out["shared_usd"] = express_cost(classes, results["express_excess_bytes_per_object"],
                                     prices)
    out["total_usd"] = out["origin_usd"] + out["shared_usd"]
    return out


def stored_bytes(node: dict[str, Any]) -> int:
    """What a node wrote to the shared tier over its whole life, as the proxy counted it
    (request heads included, ~2%): the daemon's own count is taken before the unmount's
    drain, so it can miss the last writes."""
    return int(node["total"]["shared"].get("bytes_up", 0))


def compare(nodes: list[dict[str, Any]], files: int, prices: Prices) -> dict[str, Any]:
    """One repeat's node 2 against its node 1 and its baseline: time, origin requests
    and bytes saved, dollars saved per epoch and per million files; and the one-time
    fill of the shared tier by node 1."""
    by_name = {n["name"]: n for n in nodes if n.get("status") == "ok" and "cost" in n}
    scale = 1_000_000 / files if files else 0.0
    out: dict[str, Any] = {}
    node2 = by_name.get("node 2")
    for ref_name in ("node 1", "baseline"):
        ref = by_name.get(ref_name)
        if ref is None or node2 is None:
            continue
        ref_o, new_o = ref["total"]["origin"], node2["total"]["origin"]
        saved = {k: ref_o.get(k, 0) - new_o.get(k, 0) for k in ORIGIN_KINDS}
        rc, nc = ref["cost"], node2["cost"]
        net = rc["total_usd"] - nc["total_usd"]
        before, after = ref["epoch"]["wall_s"], node2["epoch"]["wall_s"]
        out[ref_name] = {
            "epoch_s_before": before, "epoch_s_after": after, "speedup": before / after,
            **{f"origin_{k}_saved": v for k, v in saved.items()},
            "origin_requests_saved": sum(saved.values()),
            "origin_bytes_saved": ref_o.get("bytes_down", 0) - new_o.get("bytes_down", 0),
            "origin_requests_usd_saved": rc["origin_requests_usd"] - nc["origin_requests_usd"],
            "origin_egress_usd_saved": rc["origin_egress_usd"] - nc["origin_egress_usd"],
            "shared_usd_difference": nc["shared_usd"] - rc["shared_usd"],
            "net_usd_saved": net, "net_usd_saved_per_million_files": net * scale,
        }
    node1 = by_name.get("node 1")
    if node1 is not None:
        stored = stored_bytes(node1)
        storage = stored / GB * prices.express_storage_per_gb_month
        out["fill"] = {"usd": node1["cost"]["shared_usd"],
                       "usd_per_million_files": node1["cost"]["shared_usd"] * scale,
                       "stored_bytes": stored, "storage_usd_per_month": storage,
                       "storage_usd_per_month_per_million_files": storage * scale}
    return out


def compare_repeats(results: dict[str, Any], prices: Prices) -> list[dict[str, Any]]:
    """`compare` for each repeat of the run."""
    repeats = sorted({n.get("repeat", 0) for n in results.get("nodes", [])})
    return [{"repeat": r, **compare([n for n in results["nodes"] if n.get("repeat", 0) == r],
                                    results["dataset"]["images"], prices)}
            for r in repeats]


def node_figures(node: dict[str, Any], results: dict[str, Any]) -> dict[str, float]:
    """One node's figures, flat, for medians over the repeats."""
    epoch = node.get("epoch", {})
    origin, shared = node["total"]["origin"], node["total"]["shared"]
    methods = shared.get("methods", {})
    links = results["links"]
    files = epoch.get("files") or 0
    out: dict[str, float] = {
        "epoch_s": epoch.get("wall_s"), "files_per_s": epoch.get("files_per_s"),
        "mb_per_s": epoch.get("mb_per_s"), "bad_reads": epoch.get("bad_reads", 0),
        **{f"origin_{k}": origin.get(k, 0) for k in ORIGIN_KINDS},
        "origin_bytes": origin.get("bytes_down", 0),
        "origin_link_s": origin.get("bytes_down", 0) * 8 / (links["origin"]["mbit"] * 1e6),
        "shared_link_s": shared.get("bytes_down", 0) * 8 / (links["shared"]["mbit"] * 1e6),
        "shared_GET": methods.get("GET", 0), "shared_PUT": methods.get("PUT", 0),
        "shared_other": sum(methods.values()) - methods.get("GET", 0) - methods.get("PUT", 0),
        "shared_bytes_down": shared.get("bytes_down", 0),
        "shared_bytes_up": shared.get("bytes_up", 0),
        "unmount_s": node.get("unmount_s"), "cpu_s": node.get("daemon_cpu_s"),
        "cpu_life_s": node.get("daemon_cpu_life_s"),
        "cpu_ms_per_file": (1000 * node["daemon_cpu_s"] / files
                            if node.get("daemon_cpu_s") is not None and files else None),
        **{k: v for k, v in node.get("cost", {}).items() if isinstance(v, float)},
    }
    status = (node.get("daemon_status") or {}).get("shared")
    if isinstance(status, dict):
        out.update({f"status_{k}": v for k, v in status.items() if isinstance(v, int)
                    and not isinstance(v, bool)})
        out.update({f"status_requests_{k}": v for k, v in
                    (status.get("requests") or {}).items()})
    return {k: v for k, v in out.items() if v is not None}


# --- Markdown ---------------------------------------------------------------------------


class Cells:
    """Median (min-max) over the repeats of one node's (or comparison's) figures."""

    def __init__(self, figures: list[dict[str, float]]) -> None:
        self.figures = figures

    def __call__(self, key: str, digits: int = 0, scale: float = 1.0) -> str:
        return format_summary(summarize([f[key] for f in self.figures if key in f]),
                              digits, scale)

    def usd(self, key: str) -> str:
        summary = summarize([f[key] for f in self.figures if key in f])
        digits = 5 if summary is not None and abs(summary.median) < 0.01 else 2
        return format_summary(summary, digits)


def node_names(results: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(n["name"] for n in results["nodes"]))


def grouped(results: dict[str, Any]) -> dict[str, tuple[Cells, str]]:
    """Per node name: the cells of its successful repeats, and its name as shown (with
    how many repeats failed, and why)."""
    out = {}
    for name in node_names(results):
        runs = [n for n in results["nodes"] if n["name"] == name]
        ok = [n for n in runs if n["status"] == "ok"]
        shown = name
        if len(ok) < len(runs):
            reasons = sorted({n["status"] for n in runs if n["status"] != "ok"})
            shown = f"{name} ({len(runs) - len(ok)} of {len(runs)} failed: {'; '.join(reasons)})"
        out[name] = (Cells([node_figures(n, results) for n in ok]), shown)
    return out


MB = 1e-6


def node_rows(results: dict[str, Any]) -> list[str]:
    rows = ["| node | epoch s | files/s | MB/s | origin GET / HEAD / LIST | origin MB "
            "| link-bound s (origin / shared) | shared GET / PUT / other "
            "| shared MB down / up | unmount s | daemon CPU s (epoch / life) "
            "| CPU per file, ms | bad reads |",
            "| --- | ---: | ---: | ---: | --- | ---: | --- | --- | --- | ---: | --- | ---: "
            "| ---: |"]
    for c, shown in grouped(results).values():
        rows.append(
            f"| {shown} | {c('epoch_s', 1)} | {c('files_per_s')} | {c('mb_per_s', 1)} "
            f"| {c('origin_GET')} / {c('origin_HEAD')} / {c('origin_LIST')} "
            f"| {c('origin_bytes', 1, MB)} | {c('origin_link_s', 1)} / {c('shared_link_s', 1)} "
            f"| {c('shared_GET')} / {c('shared_PUT')} / {c('shared_other')} "
            f"| {c('shared_bytes_down', 1, MB)} / {c('shared_bytes_up', 1, MB)} "
            f"| {c('unmount_s', 1)} | {c('cpu_s', 1)} / {c('cpu_life_s', 1)} "
            f"| {c('cpu_ms_per_file', 2)} | {c('bad_reads')} |")
    return rows


#: The `shared` section's counters, and their column headings.
STATUS_KEYS = {"lookups": "lookups", "hits": "hits", "misses": "misses",
               "invalid": "invalid", "errors": "errors", "skipped": "skipped",
               "bytes_read": "MB read", "writes": "writes", "bytes_written": "MB written",
               "dropped": "dropped"}


def status_rows(results: dict[str, Any]) -> list[str]:
    rows = ["| node | " + " | ".join(STATUS_KEYS.values())
            + " | requests get / put / list / delete |",
            "| --- |" + " ---: |" * len(STATUS_KEYS) + " --- |"]
    for name, (c, shown) in grouped(results).items():
        if not any(n["shared"] for n in results["nodes"] if n["name"] == name):
            continue
        if not any(k.startswith("status_") for f in c.figures for k in f):
            rows.append(f"| {shown} | " + " | ".join(["—"] * len(STATUS_KEYS))
                        + " | no `shared` section in `bucketfs status --json` |")
            continue
        cells = [c(f"status_{k}", 1, MB) if k.startswith("bytes") else c(f"status_{k}")
                 for k in STATUS_KEYS]
        requests = " / ".join(c(f"status_requests_{k}")
                              for k in ("get", "put", "list", "delete"))
        rows.append(f"| {shown} | " + " | ".join(cells) + f" | {requests} |")
    return rows


def cost_rows(results: dict[str, Any]) -> list[str]:
    files = results["dataset"]["images"]
    rows = ["| node | origin requests $ | origin egress $ | shared tier $ | total $ "
            "| total per 1M files $ |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for c, shown in grouped(results).values():
        per_million = Cells([{"x": costs.per_million_files(f["total_usd"], files)}
                             for f in c.figures if "total_usd" in f])
        rows.append(f"| {shown} | {c.usd('origin_requests_usd')} "
                    f"| {c.usd('origin_egress_usd')} | {c.usd('shared_usd')} "
                    f"| {c.usd('total_usd')} | {per_million.usd('x')} |")
    return rows


def saving_rows(comparisons: list[dict[str, Any]]) -> list[str]:
    rows = ["| node 2 against | epoch s (then → node 2) | speedup | origin requests saved "
            "| origin MB saved | requests $ saved | egress $ saved | shared tier $ difference "
            "| net $ saved per epoch | net $ saved per 1M files |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for ref in ("node 1", "baseline"):
        c = Cells([r[ref] for r in comparisons if ref in r])
        if not c.figures:
            continue
        rows.append(f"| {ref} | {c('epoch_s_before', 1)} → {c('epoch_s_after', 1)} "
                    f"| {c('speedup', 2)}x | {c('origin_requests_saved')} "
                    f"| {c('origin_bytes_saved', 1, MB)} | {c.usd('origin_requests_usd_saved')} "
                    f"| {c.usd('origin_egress_usd_saved')} | {c.usd('shared_usd_difference')} "
                    f"| {c.usd('net_usd_saved')} | {c.usd('net_usd_saved_per_million_files')} |")
    return rows


def fill_line(comparisons: list[dict[str, Any]]) -> list[str]:
    c = Cells([r["fill"] for r in comparisons if "fill" in r])
    if not c.figures:
        return []
    return ["", f"Filling the shared tier (node 1's requests to it) cost ${c.usd('usd')} "
            f"(${c.usd('usd_per_million_files')} per million files), once per dataset; "
            f"keeping the {c('stored_bytes', 1, MB)} MB there costs "
            f"${c.usd('storage_usd_per_month')} a month "
            f"(${c.usd('storage_usd_per_month_per_million_files')} per million files)."]


def problem_lines(results: dict[str, Any]) -> list[str]:
    out = []
    for n in results["nodes"]:
        label = f"{n['name']}, repeat {n.get('repeat', 0) + 1}"
        found = n.get("log_problems", {})
        if found.get("count"):
            out.append(f"- {label}: {found['count']} warning/error lines in the daemon "
                       f"log, e.g. `{found['lines'][0]}`")
        if n.get("epoch", {}).get("bad_reads"):
            out.append(f"- {label}: {n['epoch']['bad_reads']} bad reads, e.g. "
                       f"{n['epoch']['bad_examples'][:1]}")
    return ["", "Problems:", *out] if out else []


def load_text(loads: list[list[float]] | None) -> str:
    """The load average before the run (at its end it is mostly the run's own readers)."""
    if not loads:
        return ""
    return f" Load average (1 min) before the run: {loads[0][0]:.1f}."


def markdown(results: dict[str, Any]) -> str:
    """The report: setup, per-node figures, the daemon's own counters, costs, savings."""
    data, links = results["dataset"], results["links"]
    o, s = links["origin"], links["shared"]
    sizes = data.get("sizes", {})
    source = results.get("bucketfs_source") or [{}]
    changed = len({x.get("digest") for x in source}) > 1
    repeats = len({n.get("repeat", 0) for n in results["nodes"]})
    lines = [
        "# The shared cache tier: node 2's cold epoch against node 1's", "",
        f"Command: `{results['command']}`. Machine: {results['machine']}.",
        f"Run: {results.get('started', '?')} to {results.get('finished', '?')}; bucketfs at "
        f"{source[0].get('commit', '?')} (+{source[0].get('modified_files', '?')} modified "
        f"files, sources {source[0].get('digest', '?')}"
        + (", **changed during the run**)." if changed else ").")
        + load_text(results.get("load_average")),
        "",
        f"Dataset `{results['scenario']}`: {data['images']:,} JPEGs, "
        f"{data['image_bytes'] / 1e6:,.1f} MB (mean {sizes.get('mean', 0) / 1e3:,.0f} KB, "
        f"median {sizes.get('median', 0) / 1e3:,.0f} KB). Origin: {o['rtt_ms']:g} ms RTT, "
        f"{o['mbit']} Mbit/s (proxy on port {o['port']}); shared tier: {s['rtt_ms']:g} ms "
        f"RTT, {s['mbit']} Mbit/s (port {s['port']}); both on one SeaweedFS, two htb "
        "classes split by port.",
    ]
    if results.get("rtt_ms"):
        lines.append("Measured HEAD round trip from the client namespace (boto3, median of "
                     "5): " + ", ".join(f"{k} {v:.1f} ms"
                                        for k, v in results["rtt_ms"].items()) + ".")
    cells = "median (min\u2013max) of " + (f"{repeats} repeats" if repeats > 1 else "1 run")
    if repeats < results.get("repeats", 1):
        cells += f" (of {results['repeats']} asked for: the run was cut short)"
    lines += ["", f"Each node: a fresh mount and `--cache-dir`, page cache dropped, every "
              f"image read once by {results['threads']} threads in a shuffled order "
              "(open/read, CRC checked). Requests and bytes: counted by the proxies over "
              "the node's whole life (mount, epoch, unmount with its drain of background "
              "PUTs). Link-bound: those bytes at the link's rate. Cells: "
              f"{cells}; each repeat fills an empty shared prefix.", "",
              *node_rows(results), "",
              "The daemon's own shared-tier counters (`bucketfs status --json`, at the end "
              "of the epoch, before the unmount's drain):", "", *status_rows(results), "",
              "Cost of each node's requests (origin at S3 Standard, egress at the "
              "inter-region rate, shared tier at S3 Express One Zone; prices read "
              f"{results['prices']['read']}, see `bench/shared_report.py`):", "",
              *cost_rows(results)]
    comparisons = results.get("comparisons") or []
    if any(ref in r for r in comparisons for ref in ("node 1", "baseline")):
        lines += ["", *saving_rows(comparisons)]
    lines += fill_line(comparisons)
    tc = results.get("tc_class_bytes", {}).get("bfsb-origin")
    if tc:
        lines += ["", "Bytes the origin end's htb classes sent over the run (1:10 origin "
                  "port, 1:11 shared port): " + ", ".join(f"{k} {v / 1e6:,.1f} MB"
                                                         for k, v in sorted(tc.items()))
                  + "."]
    lines += problem_lines(results)
    return "\n".join(lines) + "\n"
