"""Mount configuration: one table of options feeds the TOML loader, the command line
and mount.conf.example, so the three cannot drift apart.

A key is written `section.name` in TOML (`[cache]` then `block_size = "4MiB"`) and
`--name-with-dashes` on the command line; flags override the file.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from bucketfs.backends.urls import parse_bucket_url
from bucketfs.placement import parse_cpus


class ConfigError(ValueError):
    """A malformed configuration; the message is one line naming the key."""


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
#: Sizes end up in C off_t / u64 fields (kernel read-ahead, file offsets).
MAX_SIZE = 2**63 - 1
#: Timeouts and backoffs: socket.settimeout() overflows past time_t, and a day is already
#: far beyond any sensible wait.
MAX_SECONDS = 24 * 3600.0
#: uid_t and gid_t are 32 bits, and (uid_t)-1 means "no change", not an owner.
MAX_ID = 2**32 - 2


def parse_size(value: object) -> int:
    """`4GiB`, `512MB`, `65536` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 64MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size such as 64MiB")
        number, unit = match.group(1), _SIZE_UNITS[match.group(2).lower()]
        if len(number.partition(".")[0].lstrip("0")) > 20:
            size = MAX_SIZE + 1  # refused below, without multiplying a million digits
        else:  # Decimal, not float: exact, and never inf
            size = int(Decimal(number) * unit)
    else:
        raise ValueError("expected a size such as 64MiB")
    if size < 0:
        raise ValueError("a size cannot be negative")
    if size > MAX_SIZE:
        raise ValueError(f"a size cannot exceed {MAX_SIZE} bytes")
    return size


def parse_duration(value: object) -> float:
    """Seconds as a number, or `forever` (infinity)."""
    if isinstance(value, str) and value.strip().lower() in ("forever", "inf", "infinite"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("expected seconds or 'forever'")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds or 'forever'") from None
    except OverflowError:
        seconds = math.inf  # an integer past float's range, as "1e999" would read
    if seconds < 0 or math.isnan(seconds):
        raise ValueError("a duration cannot be negative")
    return seconds


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("expected a positive integer")
    number = int(value)
    if number <= 0:
        raise ValueError("expected a positive integer")
    return number


def _bounded_int(low: int, high: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"expected an integer from {low} to {high}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer from {low} to {high}") from None
        if not low <= number <= high:
            raise ValueError(f"expected an integer from {low} to {high}")
        return number

    return parse


def _optional_id(value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("expected an integer")
    number = int(value)
    if not 0 <= number <= MAX_ID:
        raise ValueError(f"expected a user or group id from 0 to {MAX_ID}")
    return number


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("expected a port number")
    number = int(value)
    if not 0 <= number <= 65535:
        raise ValueError("expected a port number from 0 to 65535")
    return number


def _seconds(value: object) -> float:
    """A timeout or backoff: positive and finite (an infinite one breaks sockets)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("expected a positive number of seconds")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not 0 < number <= MAX_SECONDS:
        raise ValueError(f"expected a positive number of seconds, at most {MAX_SECONDS:.0f}")
    return number


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
        return False
    raise ValueError("expected true or false")


def _optional_str(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _nonempty_str(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _shared_url(value: object) -> str | None:
    """The shared tier's URL: s3:// only (a GCS bucket through its S3-compatible XML
    API works as s3:// with that endpoint and HMAC keys)."""
    text = _optional_str(value)
    if text is None:
        return None
    url = parse_bucket_url(text)
    if url.scheme != "s3":
        raise ValueError("the shared tier must be an s3:// bucket (S3 Express One Zone, "
                         "MinIO, SeaweedFS, or GCS through its S3-compatible endpoint)")
    return str(url)


def _choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return str(value)

    return parse


@dataclass(frozen=True, slots=True)
class Option:
    section: str
    name: str
    parse: Callable[[object], Any]
    default: Any
    help: str
    #: How the default reads in mount.conf.example (None: commented out, no default value).
    example: str | None
    #: The command-line flag, when it is not the name with dashes.
    flag_name: str | None = None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("mount", "uid", _optional_id, None,
           "owner of every file and directory (default: the mounting user)", None),
    Option("mount", "gid", _optional_id, None,
           "group of every file and directory (default: the mounting user's group)", None),
    Option("mount", "allow_other", _bool, False,
           "let other users read the mount (needs user_allow_other in /etc/fuse.conf "
           "unless root)", "false"),
    Option("mount", "metadata_ttl", parse_duration, math.inf,
           "how long a directory listing is trusted before it is listed again; "
           "training data does not change, so by default for the life of the mount",
           '"forever"'),
    Option("mount", "refresh", _bool, False,
           "list the bucket again at mount instead of trusting the listings kept in "
           "cache_dir (they are trusted for metadata_ttl)", "false"),
    Option("mount", "kernel_ttl", parse_duration, 3600.0,
           "seconds the kernel may cache names, attributes and missing names "
           "(capped by metadata_ttl)", "3600"),
    Option("mount", "kernel_opens", _bool, True,
           "let the kernel open and close files itself (FUSE no_open), so that reads "
           "its page cache holds ask the daemon nothing; needs the pyfuse3 that `make "
           "venv` builds (packaging/pyfuse3/build.py), and is off under a stock one",
           "true"),
    Option("mount", "kernel_background", _bounded_int(1, 65535), 64,
           "read-ahead requests the kernel keeps in flight (FUSE max_background; its "
           "own 12 starves many readers); needs the same pyfuse3", "64"),
    Option("mount", "cpus", parse_cpus, None,
           "cores the daemon's threads run on: a count (the last N it may use) or a "
           "list such as 8-11; on a 16-core node 4 served as many files/s at 10 to 15 "
           "percent less CPU per file (bucketfs/placement.py; default: every core)",
           None),
    Option("mount", "data_processes", _bounded_int(0, 64), 0,
           "processes that serve reads beside the daemon, each owning a share of the "
           "objects, its share of the RAM, read-ahead and SSD budgets, and writing its "
           "replies to the kernel itself (docs/DATA_PROCESSES.md); 0: the daemon serves "
           "every read. Needs the pyfuse3 that `make venv` builds; hints, packing, warm "
           "and the shared tier are off with them for now", "0"),
    Option("mount", "log_level", _choice("debug", "info", "warning", "error"), "info",
           "log verbosity", '"info"'),
    Option("mount", "log_file", _optional_str, None,
           "where the daemon logs (default: ~/.local/state/bucketfs/<mountpoint>.log; "
           "stderr with --foreground)", None),
    Option("mount", "log_format", _choice("text", "json"), "text",
           "log line format: text, or json (one object per line with time, level, "
           "logger and message, for a log collector)", '"text"'),
    Option("s3", "endpoint_url", _optional_str, None,
           "S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS)", None),
    Option("s3", "region", _optional_str, None,
           "region (default: the AWS SDK's chain: AWS_DEFAULT_REGION, ~/.aws/config)", None),
    Option("s3", "addressing_style", _choice("auto", "path", "virtual"), "auto",
           "path-style addressing is what most S3-compatible stores want", '"auto"'),
    Option("s3", "profile", _optional_str, None,
           "AWS profile from ~/.aws/config (default: AWS_PROFILE or 'default')", None),
    Option("s3", "sign_request", _bool, True,
           "sign requests with the credentials found; --no-sign-request (false) reads a "
           "public bucket without credentials, as the AWS CLI's flag", "true"),
    Option("s3", "requester_pays", _bool, False,
           "read a requester-pays bucket: every request says that the requester pays "
           "for it (the AWS CLI's --request-payer requester)", "false"),
    Option("gcs", "project", _optional_str, None,
           "GCS project (default: from application default credentials)", None),
    Option("gcs", "anonymous", _bool, False,
           "read a public bucket without credentials", "false"),
    Option("gcs", "billing_project", _optional_str, None,
           "read a requester-pays bucket, billing its requests to this project (as "
           "gsutil -u PROJECT)", None),
    Option("read", "readahead_max", parse_size, 64 * 1024**2,
           "most bytes read ahead for one open file; the window doubles while reads "
           "stay sequential", '"64MiB"'),
    Option("read", "readahead_budget", parse_size, 512 * 1024**2,
           "most bytes held for read-ahead across all open files together", '"512MiB"'),
    Option("cache", "cache_dir", _optional_str, None,
           "directory of the SSD tier and its index; without it the cache is RAM only",
           None),
    Option("cache", "cache_group", _optional_str, None,
           "a group (name or gid) that may read the cache directory too; without it only "
           "the mount's user may (it holds the bucket's bytes and key names)", None),
    Option("cache", "ram_cache", parse_size, 2 * 1024**3,
           "bytes of blocks kept in RAM", '"2GiB"'),
    Option("cache", "disk_cache", parse_size, 16 * 1024**3,
           "bytes of blocks kept in cache_dir", '"16GiB"'),
    Option("cache", "disk_free_floor", parse_size, 1024**3,
           "free space the SSD tier always leaves on its device", '"1GiB"'),
    Option("cache", "block_size", parse_size, 4 * 1024**2,
           "cache granularity and GET size: objects up to this size are cached whole "
           "(one GET), larger ones in blocks of this size", '"4MiB"'),
    Option("cache", "eviction", _choice("cost-lrfu", "lrfu", "lru", "lfu"), "cost-lrfu",
           "eviction policy of both tiers: cost-aware LRFU (DLCache), LRFU, LRU or LFU",
           '"cost-lrfu"'),
    Option("cache", "eviction_cooldown", _positive_int, 64,
           "references during which a just-admitted block is not evicted while anything "
           "else can be (protects read-ahead until the reader gets there)", "64"),
    Option("read", "kernel_readahead", parse_size, 4 * 1024**2,
           "the kernel's own read-ahead for this mount (its bdi read_ahead_kb); larger "
           "means fewer, larger FUSE reads of big files. Set when mounting as root",
           '"4MiB"'),
    Option("read", "huge_buffers", _choice("auto", "always", "never"), "auto",
           "large blocks' buffers (a GET's body, a read from the SSD tier) in "
           "transparent huge pages, one fault per 2 MiB: auto uses them unless the host "
           "takes freed memory back (a VM's free page reporting), where each fresh huge "
           "page costs the host 512 faults; glibc's heap follows the same choice "
           "(bucketfs/huge_buffers.py, huge_pages.py)", '"auto"'),
    Option("cache", "shared", _shared_url, None,
           "a bucket (s3://BUCKET[/PREFIX]) that nodes training on the same data share as "
           "a third tier between cache_dir and the origin: blocks are looked up there "
           "before the origin, and what the origin sends is written there in the "
           "background (docs/SHARED_CACHE.md)", None, "--shared-cache"),
    Option("cache", "shared_endpoint_url", _optional_str, None,
           "S3 endpoint of the shared tier (default: the origin's s3.endpoint_url, else "
           "AWS_ENDPOINT_URL, else AWS); credentials, region and addressing style are "
           "the origin's", None, "--shared-cache-endpoint-url"),
    Option("cache", "shared_max_object", parse_size, 16 * 1024**2,
           "only objects up to this size go to the shared tier (small files are where "
           "the origin's latency hurts)", '"16MiB"', "--shared-cache-max-object"),
    Option("cache", "shared_write_queue", parse_size, 64 * 1024**2,
           "bytes waiting to be written to the shared tier; past it, blocks are not "
           "shared (a reader never waits for the shared tier)", '"64MiB"',
           "--shared-cache-write-queue"),
    Option("cache", "shared_timeout", _seconds, 2.0,
           "seconds a request to the shared tier may take before it counts as a miss "
           "(and the tier is given a rest)", "2", "--shared-cache-timeout"),
    Option("hints", "prefetch_window", parse_size, 256 * 1024**2,
           "bytes a job's hinted files are fetched ahead of its reader (refilled when "
           "half is read; at most half of ram_cache); 0 turns hints off (the socket still "
           "answers status and warm)",
           '"256MiB"'),
    Option("hints", "prefetch_budget", parse_size, 512 * 1024**2,
           "bytes in flight or fetched and not yet read, over all jobs together (at "
           "most half of ram_cache)", '"512MiB"'),
    Option("hints", "prefetch_connections", _positive_int, 24,
           "most parallel GETs of hinted prefetch; it starts with 4, adds more while "
           "they raise the throughput and drops some while the throughput holds without "
           "them (kept below origin.max_connections, so a reader's own miss always finds "
           "a connection)", "24"),
    Option("hints", "hints_group", _optional_str, None,
           "a group (name or gid) whose members may also send hints; the mount owner "
           "and root always may", None),
    Option("metrics", "metrics_port", _port, 0,
           "serve Prometheus metrics on this port (0: off)", "0"),
    Option("metrics", "metrics_address", _nonempty_str, "127.0.0.1",
           "address the metrics endpoint listens on", '"127.0.0.1"'),
    Option("origin", "max_connections", _positive_int, 32,
           "parallel requests to the bucket (worker threads and pooled connections)", "32"),
    Option("origin", "connect_timeout", _seconds, 10.0,
           "seconds to wait for a connection", "10"),
    Option("origin", "read_timeout", _seconds, 30.0,
           "seconds to wait for data on an open connection (a GET slower than 1 KiB/s "
           "for that long is cut too, and retried)", "30"),
    Option("origin", "retry_attempts", _positive_int, 6,
           "attempts per request on throttling, 5xx, timeouts and dropped connections "
           "before the read fails with EIO", "6"),
    Option("origin", "retry_base_delay", _seconds, 0.1,
           "first backoff in seconds; it doubles per attempt, with full jitter", "0.1"),
    Option("origin", "retry_max_delay", _seconds, 5.0,
           "longest backoff in seconds", "5"),
    Option("origin", "list_page_size", _positive_int, 1000,
           "keys per LIST request (1000 is the S3 maximum)", "1000"),
)

OPTIONS_BY_KEY = {option.key: option for option in OPTIONS}
OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}
assert len(OPTIONS_BY_NAME) == len(OPTIONS), "option names must be unique across sections"


class Config:
    """Validated option values, read as attributes by option name (`config.block_size`)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = {option.name: option.default for option in OPTIONS}
        self._values.update(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)


def _parse(option: Option, value: object, where: str) -> Any:
    try:
        return option.parse(value)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ConfigError(f"{where}: bad value for {option.key}: {exc}") from None


def _key(*parts: str) -> str:
    """A key as the user wrote it; quoted if it holds a line break or a control
    character, so the message stays one line."""
    key = ".".join(parts)
    return key if key.isprintable() else repr(key)


def load_config(path: str | os.PathLike[str] | None, overrides: dict[str, Any]) -> Config:
    """Read the TOML file (if any), then apply command-line overrides (by option name)."""
    values: dict[str, Any] = {}
    if path is not None:
        where = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such config file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: cannot read config file: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: not valid TOML: {exc}") from None
        except RecursionError:  # tomllib recurses once per level of nested arrays
            raise ConfigError(f"{where}: not valid TOML: values nested too deeply") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{where}: unknown key {section!r} (options live in "
                                  "sections such as [mount] or [read])")
            for name, value in table.items():
                option = OPTIONS_BY_KEY.get(f"{section}.{name}")
                if option is None:
                    raise ConfigError(f"{where}: unknown key {_key(section, name)}")
                values[option.name] = _parse(option, value, where)
    for name, value in overrides.items():
        option = OPTIONS_BY_NAME[name]
        values[name] = _parse(option, value, f"option {option.flag}")
    config = Config(values)
    if config.readahead_max > config.readahead_budget:
        raise ConfigError("read.readahead_max must not exceed read.readahead_budget")
    if config.block_size == 0:
        raise ConfigError("cache.block_size must be positive")
    if config.anonymous and config.billing_project:
        raise ConfigError("gcs.billing_project needs credentials: a request billed to a "
                          "project cannot be anonymous (gcs.anonymous)")
    return config


#: The sections whose options reach buckets of one scheme only.
_SCHEME_OF_SECTION = {"s3": "s3", "gcs": "gs"}
#: [s3] options the shared tier (an s3:// bucket) follows too, whatever the origin is.
_SHARED_TIER_FOLLOWS = {"endpoint_url", "region", "addressing_style", "profile"}


def options_for_other_buckets(config: Config, scheme: str) -> list[str]:
    """The options set away from their defaults that do nothing for a bucket of `scheme`
    (`--billing-project` for an s3:// bucket, say), each as its key and flag. Not an
    error: one config file may serve mounts of both clouds."""
    found = []
    for option in OPTIONS:
        value = getattr(config, option.name)
        if _SCHEME_OF_SECTION.get(option.section, scheme) == scheme or value == option.default:
            continue
        if config.shared is not None and option.name in _SHARED_TIER_FOLLOWS:
            continue
        flag = "--no-" + option.flag[2:] if value is False else option.flag
        found.append(f"{option.key} ({flag})")
    return found


def render_example() -> str:
    """The text of mount.conf.example (a test checks the file matches)."""
    lines = [
        "# bucketfs mount configuration (TOML). Every option with its default.",
        "# Use: bucketfs mount URL MOUNTPOINT --config FILE; command-line flags override",
        "# the file (each option's flag is its name with dashes: block_size -> --block-size).",
        "# Sizes accept B, KB, MB, GB, KiB, MiB, GiB; durations are seconds or \"forever\".",
    ]
    sections = list(dict.fromkeys(option.section for option in OPTIONS))
    for section in sections:
        lines += ["", f"[{section}]"]
        for option in (o for o in OPTIONS if o.section == section):
            lines += [f"# {line}" for line in textwrap.wrap(option.help, 86)]
            if option.example is None:
                lines.append(f"# {option.name} =")
            else:
                lines.append(f"{option.name} = {option.example}")
    return "\n".join(lines) + "\n"
