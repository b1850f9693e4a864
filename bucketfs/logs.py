"""Logging setup, with a filter that keeps credentials out of every line.

The SDKs are quiet below WARNING; on top of that every record is scrubbed of the
secret values found in the environment and of signature-bearing fragments
(Authorization headers, presigned-URL query parameters).
"""

from __future__ import annotations

import logging
import os
import re
import sys

from bucketfs.private import open_private_log

_SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
_SECRET_PATTERNS = re.compile(
    r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)[^\"',\s]+(?:\s[^\"',\s]+)?"
    r"|((?:x-amz-)?(?:signature|credential|security-token)=)[^&\s\"']+"
    r"|(access_token[\"']?\s*[:=]\s*[\"']?)[^\"',\s]+"
)
REDACTED = "<redacted>"


def redact(text: str, secrets: tuple[str, ...] | None = None) -> str:
    if secrets is None:
        secrets = _env_secrets()
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return _SECRET_PATTERNS.sub(
        lambda m: (m.group(1) or m.group(2) or m.group(3) or "") + REDACTED, text
    )


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


def setup_logging(level: str, log_file: str | None) -> None:
    handler: logging.Handler
    if log_file:
        # Opened without following a link, and only if it is our own file (private.py).
        stream = os.fdopen(open_private_log(os.path.abspath(log_file)), "a", buffering=1)
        handler = logging.StreamHandler(stream)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "google", "pyfuse3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
