"""`bench.dataplane`'s tables: its results (JSON, as `run` returns them) as markdown."""

from __future__ import annotations

from typing import Any


def requests_text(per_file: dict[str, float] | None) -> str:
    """"1.00 IOCTL, 1.00 READ": the kinds sent at least once per 100 files."""
    if per_file is None:
        return "not counted"
    shown = [f"{n:.2f} {kind}" for kind, n in per_file.items() if n >= 0.01]
    return ", ".join(shown) or "none"


def report(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']}", "",
             "| data path | CPU per file | files/s | wall | FUSE requests per file |",
             "| --- | ---: | ---: | ---: | --- |"]
    for row in results["clients"]:
        lines.append(f"| {row['client']} (in the reader) | {row['cpu_ms_per_file']:.2f} ms "
                     f"| {row['files_per_s']:.0f} | {row['wall_s']:.2f} s | |")
    for name, row in results["passes"].items():
        lines.append(f"| bucketfs {name} (daemon) | {row['cpu_ms_per_file']:.2f} ms "
                     f"| {row['files_per_s']:.0f} | {row['wall_s']:.2f} s "
                     f"| {requests_text(row.get('requests_per_file'))} |")
    if results.get("large"):
        lines += ["", "| large object | MB/s | CPU-s per GiB |", "| --- | ---: | ---: |"]
        for row in results["large"]:
            backed = ", memory backed first" if row.get("memory_backed_first") else ""
            if row.get("from_ssd_tier"):
                backed = ", from the SSD tier (remounted)" + backed
            if row.get("small_ram_tier"):
                backed = f", RAM tier {row['small_ram_tier']}" + backed
            if row.get("data_processes"):
                backed = f", {row['data_processes']} data processes" + backed
            if row.get("ram_only"):
                backed = (", again from the RAM tier (page cache dropped)"
                          if row.get("from_ram_tier") else ", no SSD tier" + backed)
            lines.append(f"| {row['reader']}{backed} | {row['mb_per_s']:.0f} "
                         f"| {row['cpu_s_per_gib']:.2f} |")
    lines += ["", "| pass | event loop | worker threads | other threads | files/s one "
              "event loop allows | context switches per file (loop / workers / other) |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, row in results["passes"].items():
        lines.append(f"| {name} | {by_thread_text(row)} | {switches_text(row)} |")
    lines += ["", "| readers | cold files/s | cold MB/s | cold CPU/file | cold CPU-s/GiB "
              "| cold loop CPU/file | warm files/s | warm MB/s | warm CPU/file "
              "| warm loop CPU/file |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["scale"]:
        c, w = row["cold"], row["warm_ram"]
        procs = row.get("data_processes")
        who = f"{row['readers']}, {procs} data processes" if procs else row["readers"]
        lines.append(f"| {who} | {c['files_per_s']:.0f} | {c['mb_per_s']:.0f} "
                     f"| {c['cpu_ms_per_file']:.2f} ms | {c['cpu_s_per_gib']:.2f} "
                     f"| {loop_ms(c)} | {w['files_per_s']:.0f} | {w['mb_per_s']:.0f} "
                     f"| {w['cpu_ms_per_file']:.2f} ms | {loop_ms(w)} |")
    return "\n".join(lines) + "\n"


def loop_ms(row: dict[str, Any]) -> str:
    split = row.get("cpu_ms_per_file_by_thread")
    return "—" if split is None else f"{split['loop']:.3f} ms"


def by_thread_text(row: dict[str, Any]) -> str:
    """"0.310 ms | 0.110 ms | 0.115 ms | 3,226": a pass's CPU per file by thread, and the
    files/s at which its event loop would fill one core."""
    split = row.get("cpu_ms_per_file_by_thread")
    if split is None:
        return "— | — | — | —"
    ceiling = f"{1000 / split['loop']:,.0f}" if split["loop"] > 0 else "—"
    return (f"{split['loop']:.3f} ms | {split['workers']:.3f} ms | {split['other']:.3f} ms "
            f"| {ceiling}")


def switches_text(row: dict[str, Any]) -> str:
    """"0.95 / 7.18 / 2.46": a pass's voluntary context switches per file by thread. Each
    is a thread that blocked and was woken again (a hand-off between threads, a wait for
    the GIL, for I/O or for work): what a many-core node pays most for, counted the same
    on two cores as on sixty-four."""
    split = row.get("switches_per_file_by_thread")
    if split is None:
        return "—"
    return f"{split['loop']:.2f} / {split['workers']:.2f} / {split['other']:.2f}"
