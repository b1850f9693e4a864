"""The report of a run: results.json (every figure of every repeat), report.md (medians
with min-max over repeats) and PNG plots, all in the run's directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness.costs import gcs_cost, per_million_files, s3_cost
from bench.harness.stats import Key, Summary, aggregate, format_summary

REQUEST_KINDS = ("GET", "HEAD", "LIST")


def with_costs(records: list[dict[str, Any]], files: int) -> list[dict[str, Any]]:
    """Records with the request cost of each measured phase added (S3 and GCS prices;
    also scaled to a million files read the same way)."""
    out = []
    for record in records:
        if record.get("status") == "ok" and "origin_GET" in record:
            counts = {kind: record.get(f"origin_{kind}", 0) for kind in (*REQUEST_KINDS,
                                                                          "OTHER")}
            s3, gcs = s3_cost(counts), gcs_cost(counts)
            record = {**record, "cost_s3_usd": s3, "cost_gcs_usd": gcs,
                      "cost_s3_usd_per_million_files": per_million_files(s3, files),
                      "cost_gcs_usd_per_million_files": per_million_files(gcs, files)}
        out.append(record)
    return out


def write_json(path: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    tmp.replace(path)


class Table:
    """Markdown cells from the aggregate, with "n/a: reason" where a figure is missing."""

    def __init__(self, summary: dict[Key, dict[str, Any]]) -> None:
        self.summary = summary
        self.notes: list[str] = []

    def metric(self, contender: str, workload: str, item: str, name: str) -> Summary | None:
        entry = self.summary.get((contender, workload, item))
        return entry["metrics"].get(name) if entry else None

    def cell(self, contender: str, workload: str, item: str, name: str, digits: int = 1,
             scale: float = 1.0) -> str:
        entry = self.summary.get((contender, workload, item))
        value = entry["metrics"].get(name) if entry else None
        if value is not None:
            text = format_summary(value, digits, scale)
            if entry and entry["ok"] < entry["repeats"]:
                text += f" ({entry['ok']} of {entry['repeats']} repeats)"
            return text
        if entry and entry["problems"]:
            return self._note(entry["problems"][0])
        return "—"

    def requests(self, contender: str, workload: str, item: str) -> str:
        """"GET / HEAD / LIST" medians."""
        values = [self.metric(contender, workload, item, f"origin_{k}") for k in REQUEST_KINDS]
        if any(v is None for v in values):
            return self.cell(contender, workload, item, "origin_GET")
        return " / ".join(f"{v.median:,.0f}" for v in values if v is not None)

    def _note(self, problem: str) -> str:
        if problem not in self.notes:
            self.notes.append(problem)
        kind = "n/a" if problem.startswith("n/a") else "error"
        return f"{kind} [{self.notes.index(problem) + 1}]"


def _warm_epochs(epochs: int) -> str:
    if epochs <= 1:
        return "there is no later epoch"
    return "epoch 2 is" if epochs == 2 else f"epochs 2-{epochs} are"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _epochs(summary: dict[Key, dict[str, Any]]) -> int:
    items = [item for (_c, workload, item) in summary if workload == "train"]
    numbers = [int(item.split()[1]) for item in items if item.startswith("epoch ")]
    return max(numbers, default=0)


def markdown(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    summary = aggregate(records)
    contenders = meta["contenders"]
    table = Table(summary)
    epochs = _epochs(summary)
    last = f"epoch {epochs}"
    parts = [f"# bucketfs and its peers: `{meta['scenario']}` over the `{meta['link']}` link",
             "", _preamble(meta), ""]

    parts += ["## Training loop", "",
              f"Epoch 1 is cold (fresh mount, empty caches, page cache dropped); "
              f"{_warm_epochs(epochs)} warm (nothing dropped: as a user would see it). "
              f"Stall: time "
              f"the loop waited for its next batch. Requests: GET / HEAD / LIST the origin "
              f"served during the epoch.", ""]
    header = ["contender", *[f"epoch {e} s" for e in range(1, epochs + 1)],
              "img/s cold", f"img/s {last}", "stall cold s", f"stall {last} s",
              "requests cold", f"requests {last}", "MB from origin, cold"]
    rows = []
    for c in contenders:
        rows.append([c, *[table.cell(c, "train", f"epoch {e}", "seconds")
                          for e in range(1, epochs + 1)],
                     table.cell(c, "train", "epoch 1", "images_per_s", 0),
                     table.cell(c, "train", last, "images_per_s", 0),
                     table.cell(c, "train", "epoch 1", "stall_s"),
                     table.cell(c, "train", last, "stall_s"),
                     table.requests(c, "train", "epoch 1"),
                     table.requests(c, "train", last),
                     table.cell(c, "train", "epoch 1", "origin_bytes_down", 0, 1e-6)])
    parts += [_table(header, rows), ""]

    parts += ["## Request cost of an epoch", "",
              "At S3 Standard and GCS Standard request prices (see `bench/harness/costs.py`; "
              "egress not included), and scaled to a dataset of a million files read the "
              "same way.", ""]
    header = ["contender", "cold epoch S3 $", "cold epoch GCS $", f"{last} S3 $",
              "cold, per 1M files S3 $", "cold, per 1M files GCS $"]
    rows = [[c, table.cell(c, "train", "epoch 1", "cost_s3_usd", 5),
             table.cell(c, "train", "epoch 1", "cost_gcs_usd", 5),
             table.cell(c, "train", last, "cost_s3_usd", 5),
             table.cell(c, "train", "epoch 1", "cost_s3_usd_per_million_files", 2),
             table.cell(c, "train", "epoch 1", "cost_gcs_usd_per_million_files", 2)]
            for c in contenders]
    parts += [_table(header, rows), ""]

    parts += ["## Raw reads (no decode)", "",
              f"Every image once in a shuffled order, {meta['threads']} threads, on a fresh "
              f"mount with the page cache dropped (cold), then again (warm).", ""]
    header = ["contender", "cold s", "cold MB/s", "warm s", "warm MB/s", "requests cold",
              "requests warm"]
    rows = [[c, table.cell(c, "raw", "cold", "seconds"), table.cell(c, "raw", "cold", "MBps"),
             table.cell(c, "raw", "warm", "seconds"), table.cell(c, "raw", "warm", "MBps"),
             table.requests(c, "raw", "cold"), table.requests(c, "raw", "warm")]
            for c in contenders]
    parts += [_table(header, rows), ""]

    parts += ["## Sequential reads of the large files", "",
              "Each large file front to back in 1 MiB reads, one at a time, cold.", ""]
    header = ["contender", "MB/s (all files)", "seconds", "requests", "MB from origin"]
    rows = [[c, table.cell(c, "sequential", "all", "MBps"),
             table.cell(c, "sequential", "all", "seconds"),
             table.requests(c, "sequential", "all"),
             table.cell(c, "sequential", "all", "origin_bytes_down", 0, 1e-6)]
            for c in contenders]
    parts += [_table(header, rows), ""]

    parts += ["## Metadata", "",
              "First byte: from starting the mount daemon (or making a client) to the first "
              "byte of one image. Listing: `find` over the whole mount (SDKs: a listing of "
              "the whole bucket), right after the first byte.", ""]
    header = ["contender", "first byte s", "listing s", "entries", "requests at mount",
              "requests of the listing"]
    rows = [[c, table.cell(c, "metadata", "first byte", "seconds", 2),
             table.cell(c, "metadata", "list", "seconds", 2),
             table.cell(c, "metadata", "list", "entries", 0),
             table.requests(c, "metadata", "first byte"),
             table.requests(c, "metadata", "list")]
            for c in contenders]
    parts += [_table(header, rows), ""]

    parts += ["## CPU and memory", "",
              "Daemon: the mount process tree (peak RSS is its VmHWM; CPU is user + system "
              "time). Client: the process running the loop and its DataLoader workers.", ""]
    header = ["contender", "daemon peak RSS MiB (training session)",
              "daemon peak RSS MiB (raw + sequential session)", "daemon CPU s, cold epoch",
              f"daemon CPU s, {last}", "client CPU s, cold epoch", f"client CPU s, {last}"]
    rows = [[c, table.cell(c, "daemon", "training session", "peak_rss_mib", 0),
             table.cell(c, "daemon", "raw session", "peak_rss_mib", 0),
             table.cell(c, "train", "epoch 1", "daemon_cpu_s"),
             table.cell(c, "train", last, "daemon_cpu_s"),
             table.cell(c, "train", "epoch 1", "client_cpu_s"),
             table.cell(c, "train", last, "client_cpu_s")]
            for c in contenders]
    parts += [_table(header, rows), ""]

    parts += targets(summary, meta, epochs)

    if table.notes:
        parts += ["## Not measured, and errors", ""]
        parts += [f"{i}. {note}" for i, note in enumerate(table.notes, 1)]
        parts.append("")
    return "\n".join(parts)


def _median(summary: dict[Key, dict[str, Any]], key: Key, metric: str) -> float | None:
    entry = summary.get(key)
    value = entry["metrics"].get(metric) if entry else None
    return value.median if value is not None else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "—"


def targets(summary: dict[Key, dict[str, Any]], meta: dict[str, Any], epochs: int) -> list[str]:
    """The issue's targets next to what was measured (medians), met or not."""
    last = f"epoch {epochs}"

    def epoch(contender: str, item: str) -> float | None:
        return _median(summary, (contender, "train", item), "seconds")

    rows = []
    local_warm = epoch("local", last)
    for mode in ("bucketfs-cache", "bucketfs-hints"):
        warm = epoch(mode, last)
        rows.append([f"warm epoch, {mode} / local", "≤ 1.10x", _ratio(warm, local_warm)])
        for peer in ("s3fs", "rclone"):
            rows.append([f"warm epoch, {peer} / {mode}", "> 1x", _ratio(epoch(peer, last), warm)])
    cold = epoch("bucketfs-nocache", "epoch 1")
    for peer in ("s3fs", "rclone"):
        rows.append([f"cold epoch, {peer} / bucketfs-nocache", "≥ 3x",
                     _ratio(epoch(peer, "epoch 1"), cold)])
    link_bound = meta["link_bound_images_s"]
    hinted = epoch("bucketfs-hints", "epoch 1")
    rows.append(["cold epoch, bucketfs-hints / link-bound time", "≤ 1.25x",
                 _ratio(hinted, link_bound)])
    local_cold = epoch("local", "epoch 1")
    if local_cold is not None:
        rows.append(["cold epoch, bucketfs-hints / max(link-bound, local cold epoch)",
                     "(what is reachable here)", _ratio(hinted, max(link_bound, local_cold))])
    stall = _median(summary, ("bucketfs-hints", "train", "epoch 1"), "stall_fraction")
    rows.append(["stall share of the cold epoch, bucketfs-hints", "< 10%",
                 f"{stall:.0%}" if stall is not None else "—"])
    files = meta["dataset"]["images"]
    for mode in ("bucketfs-nocache", "bucketfs-cache", "bucketfs-hints"):
        gets = _median(summary, (mode, "train", "epoch 1"), "origin_GET")
        warm_requests = [_median(summary, (mode, "train", last), f"origin_{k}")
                         for k in REQUEST_KINDS]
        rows.append([f"GETs per image in the cold epoch, {mode}", "≤ 1",
                     f"{gets / files:.2f}" if gets is not None else "—"])
        rows.append([f"requests in {last}, {mode}", "0",
                     f"{sum(warm_requests):,.0f}" if None not in warm_requests else "—"])
    listing = _median(summary, ("bucketfs-cache", "metadata", "list"), "origin_LIST")
    prefixes = meta["dataset"]["classes"] + 3  # the classes, train/, large/ and the root
    rows.append(["LISTs for `find` over the mount, bucketfs-cache",
                 f"≤ {prefixes} (one per prefix: ⌈N/1000⌉ each)",
                 f"{listing:,.0f}" if listing is not None else "—"])
    return ["## Against the issue's targets", "",
            "Medians of the tables above; a ratio is the first figure over the second.", "",
            _table(["what", "target", "measured"], rows), ""]


def _source_line(meta: dict[str, Any]) -> str:
    states = meta.get("bucketfs_source") or []
    if not states:
        return "bucketfs: source not recorded.  "
    first, last = states[0], states[-1]
    text = (f"bucketfs: commit {first['commit']} with {first['modified_files']} modified "
            f"file(s), source digest {first['digest']}")
    if last["digest"] != first["digest"]:
        text += (f"; **the sources changed during the run** (digest {last['digest']} at "
                 f"{last['at']}, commit {last['commit']}): per-session digests are in "
                 f"results.json")
    return text + ".  "


def _preamble(meta: dict[str, Any]) -> str:
    data = meta["dataset"]
    link = meta["link_profile"]
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Started {meta['started']}, {meta['repeats']} repeat(s); cells are medians with "
        f"(min-max) over the repeats; every figure is in `results.json`.  ",
        f"Machine: {meta['machine']}  ",
        f"Dataset: {data['images']:,} JPEGs in {data['classes']} classes, "
        f"{data['image_bytes'] / 1e6:,.0f} MB (mean {data['sizes']['mean'] / 1e3:.0f} KB, "
        f"median {data['sizes']['median'] / 1e3:.0f} KB, p10-p90 "
        f"{data['sizes']['p10'] / 1e3:.0f}-{data['sizes']['p90'] / 1e3:.0f} KB); "
        f"{len(data['large'])} large file(s), {data['large_bytes'] / 2**20:,.0f} MiB in all.  ",
        f"Link: {link['rtt_ms']:g} ms RTT (user-space delay proxy), {link['mbit']} Mbit/s "
        f"(tc htb). Link-bound time of one cold pass over the images: "
        f"{meta['link_bound_images_s']:.1f} s; of the large files: "
        f"{meta['link_bound_large_s']:.1f} s.  ",
        _source_line(meta),
        f"Training loop: batch {meta['batch_size']}, {meta['workers']} DataLoader workers, "
        f"{meta['gpu_ms']:g} ms of simulated GPU time per batch, {meta['epochs']} epochs.",
        "",
        "Contenders:",
        "",
        *[f"- `{name}`: {text}" for name, text in meta["contender_descriptions"].items()],
    ]
    return "\n".join(lines)


def plots(out: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> list[Path]:
    """epochs.png, stall.png, requests.png (matplotlib, when installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    summary = aggregate(records)
    contenders = [c for c in meta["contenders"]
                  if any(key[0] == c and key[1] == "train" for key in summary)]
    epochs = _epochs(summary)
    written: list[Path] = []
    if not contenders or not epochs:
        return written

    def bars(metric: str, items: list[str], labels: list[str], workload: str, title: str,
             ylabel: str, filename: str, log: bool = False,
             reference: tuple[float, str] | None = None) -> None:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(contenders) + 2), 4.2))
        width = 0.8 / max(1, len(items))
        for i, (item, label) in enumerate(zip(items, labels, strict=True)):
            xs, heights, low, high = [], [], [], []
            for j, contender in enumerate(contenders):
                entry = summary.get((contender, workload, item))
                value = entry["metrics"].get(metric) if entry else None
                if value is None:
                    continue
                xs.append(j + (i - (len(items) - 1) / 2) * width)
                heights.append(value.median)
                low.append(value.median - value.low)
                high.append(value.high - value.median)
            ax.bar(xs, heights, width, yerr=[low, high], capsize=2, label=label)
        if reference is not None:
            ax.axhline(reference[0], color="black", linestyle="--", linewidth=1,
                       label=reference[1])
        ax.set_xticks(range(len(contenders)), contenders, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    caption = f"{meta['scenario']}, {meta['link']} link; median, bars min-max"
    epoch_items = [f"epoch {e}" for e in range(1, epochs + 1)]
    epoch_labels = ["epoch 1 (cold)", *[f"epoch {e}" for e in range(2, epochs + 1)]]
    bars("seconds", epoch_items, epoch_labels, "train", f"Epoch time ({caption})", "seconds",
         "epochs.png", reference=(meta["link_bound_images_s"], "link-bound time"))
    bars("stall_s", epoch_items, epoch_labels, "train",
         f"Time the loop waited for data ({caption})", "seconds", "stall.png")
    # Requests by kind in the cold epoch and in the last one, side by side (linear scale:
    # the point is how many; zero is zero).
    panels = ["epoch 1"] if epochs == 1 else ["epoch 1", f"epoch {epochs}"]
    fig, axes = plt.subplots(1, len(panels), sharey=True, squeeze=False,
                             figsize=(max(6.0, 1.1 * len(contenders) + 1) * len(panels), 4.4))
    width = 0.8 / len(REQUEST_KINDS)
    for ax, item in zip(axes[0], panels, strict=True):
        for i, kind in enumerate(REQUEST_KINDS):
            heights = []
            for contender in contenders:
                entry = summary.get((contender, "train", item))
                value = entry["metrics"].get(f"origin_{kind}") if entry else None
                heights.append(value.median if value is not None else 0)
            ax.bar([j + (i - 1) * width for j in range(len(contenders))], heights, width,
                   label=kind)
        ax.set_xticks(range(len(contenders)), contenders, rotation=30, ha="right")
        ax.set_title(f"{item} ({'cold' if item == 'epoch 1' else 'warm'})")
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("requests to the origin (median)")
    fig.suptitle(f"Origin requests per epoch ({meta['scenario']}, {meta['link']} link)")
    fig.tight_layout()
    fig.savefig(out / "requests.png", dpi=110)
    plt.close(fig)
    written.append(out / "requests.png")
    return written


def rewrite(directory: Path) -> None:
    """report.md and the plots again, from a run's results.json."""
    saved = json.loads((directory / "results.json").read_text())
    (directory / "report.md").write_text(markdown(saved["meta"], saved["records"]))
    plots(directory, saved["meta"], saved["records"])
