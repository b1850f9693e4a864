"""The comparison harness of `python -m bench run`: a shaped origin, a dataset, the
contenders and the workloads they are measured on, and the report.

Modules, one job each:
  scenarios   what a run is made of: dataset sizes and link profiles
  netlab      network namespaces, the veth pair and `tc htb` (set up, torn down, cleaned)
  httpcount   counting HTTP/1.1 requests in a client->server byte stream (pure)
  delayproxy  the user-space TCP proxy that adds round-trip time and counts requests
  origin      SeaweedFS in the origin namespace, the proxy in front of it, the upload
  upload      the upload itself (run inside the origin namespace)
  dataset     the ImageFolder tree of JPEGs and the large files, kept on local disk
  procstats   CPU time and peak RSS of a process tree, from /proc
  probe       snapshots of the origin's counters and a daemon's CPU, for per-phase deltas
  mounts      starting, timing and unmounting FUSE mounts (bucketfs, s3fs, rclone)
  contenders  the contenders and what each can and cannot do
  workloads   the training loop, raw reads, sequential reads, SDK metadata (run in the
              client namespace as a subprocess)
  costs       request prices and the cost of a phase
  stats       medians and ranges over repeats
  report      results.json, the Markdown tables and the PNG plots
  runner      the orchestration of one run
  tree        which bucketfs a spawned daemon imports: this checkout's
  saving      where a one-command benchmark (bench.dataplane and the like) leaves its
              JSON and Markdown
"""
