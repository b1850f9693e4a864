"""Logging setup, with a filter that keeps credentials out of every line.

The SDKs are quiet below WARNING; on top of that every record is scrubbed of the
secret values found in the environment, of the user:password@ of any URL (an
--endpoint-url may carry one) and of signature-bearing fragments (Authorization
headers, presigned-URL query parameters). Lines are text, or one JSON object each
(`--log-format json`) for a log collector.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

from bucketfs.private import UnsafePath, open_private_log

_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
_SECRET_PATTERNS = re.compile(
    r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)[^\"',\s]+(?:\s[^\"',\s]+)?"
    r"|((?:x-amz-)?(?:signature|credential|security-token)=)[^&\s\"']+"
    r"|(access_token[\"']?\s*[:=]\s*[\"']?)[^\"',\s]+"
    # The userinfo of an endpoint: everything before its last "@", even a password
    # with a "/" in it (unencoded, as users paste one); an endpoint's path has no "@".
    r"|(https?://)[^\s\"'<>]+@"
    # The userinfo of any other URL: scheme://user:password@host (also a bare user@),
    # never past a "/", since a bucket key may hold an "@".
    r"|([a-z][a-z0-9+.-]*://)[^/\s@\"']+@"
)
REDACTED = "<redacted>"


def redact(text: str, secrets: tuple[str, ...] | None = None) -> str:
    if secrets is None:
        secrets = _env_secrets()
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return _SECRET_PATTERNS.sub(_redacted, text)


def _redacted(match: re.Match[str]) -> str:
    lead = match.group(1) or match.group(2) or match.group(3)
    if lead is not None:
        return lead + REDACTED
    return f"{match.group(4) or match.group(5)}{REDACTED}@"  # a URL's userinfo


def _env_secrets() -> tuple[str, ...]:
    # Short values would redact ordinary words; real keys are long.
    return tuple(v for name in _SECRET_ENV if len(v := os.environ.get(name, "")) >= 8)


class RedactingFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets = _env_secrets()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            record.exc_text = None
        record.msg = redact(message, self.secrets)
        record.args = None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message. A
    traceback is already part of the message (RedactingFilter), so it stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        return json.dumps({
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }, ensure_ascii=False)


class Throttle:
    """At most one log line per kind of event every `interval` seconds. Why: a client
    reading, in a loop, a file the bucket refuses would otherwise have the daemon write
    a line per request, thousands a second, until the log's disk is full. Kinds are few
    (an operation and an exception class, say), so the memory is bounded."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def admit(self, kind: str) -> int | None:
        """None if a line of this kind was let through less than `interval` ago (this one
        is held back and counted); else how many were held back since that line."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._held[kind] += 1
            return None
        self._last[kind] = now
        return self._held.pop(kind, 0)


def held_back(count: int) -> str:
    """The suffix of a line whose kind was held back `count` times since its last line."""
    return f" ({count} more like it since the last)" if count else ""


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PrivateLogFile(logging.StreamHandler):  # type: ignore[type-arg]
    """Appends to the log file at `path`, opened as `open_private_log` opens it (our own
    regular file, never through a link). When the path stops naming that file (logrotate
    renamed or removed it), the next line opens the path afresh: rotation needs no
    signal and no copytruncate. If the new file cannot be opened safely (a link planted
    there, a file of another user), lines go on to the file already open.

    The check is `logging.handlers.WatchedFileHandler`'s, but that handler's stat
    follows links and it closes the old file before it opens the new one, so a refused
    open would lose the lines; and it cannot take the daemon's stdout and stderr along."""

    def __init__(self, path: str) -> None:
        self.path = path
        stream, self._identity = self._open()
        #: A rotated log could not be opened, and the open file says so (once).
        self._refused = False
        super().__init__(stream)

    def _open(self) -> tuple[io.TextIOWrapper, tuple[int, int]]:
        """The log at `path`, and its (device, inode)."""
        stream = os.fdopen(open_private_log(self.path), "a", buffering=1)
        info = os.fstat(stream.fileno())
        return stream, (info.st_dev, info.st_ino)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._follow_rotation()  # under the handler's lock, as `emit` is
        except Exception:  # a full disk, say: handled as a failed write, never raised
            self.handleError(record)
        super().emit(record)

    def _follow_rotation(self) -> None:
        try:
            info = os.stat(self.path, follow_symlinks=False)
            if (info.st_dev, info.st_ino) == self._identity:
                return
        except FileNotFoundError:
            pass
        except OSError:
            return  # cannot tell: keep the file that is open
        old_identity = self._identity
        try:
            stream, identity = self._open()
        except (UnsafePath, OSError) as exc:
            if not self._refused:
                self._refused = True
                self.stream.write(self.format(logging.LogRecord(
                    __name__, logging.WARNING, __file__, 0,
                    "cannot open the rotated log %s (%s); writing on to this file",
                    (self.path, exc), None)) + self.terminator)
            return
        self._refused = False
        try:
            old = self.setStream(stream)  # flushes the old one: a full disk may refuse
        except BaseException:
            stream.close()
            raise
        self._identity = identity
        if old is not None:
            old.close()
        # A background daemon's stdout and stderr are the log too (what Python or
        # libfuse print themselves, a fatal error's traceback): they follow.
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) == old_identity:
                    os.dup2(stream.fileno(), fd)


def setup_logging(level: str, log_file: str | None, log_format: str = "text") -> None:
    handler: logging.Handler
    if log_file:
        handler = PrivateLogFile(os.path.abspath(log_file))
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "google", "pyfuse3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
