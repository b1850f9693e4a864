"""Count S3 requests in the client->server half of an HTTP/1.1 connection.

The delay proxy feeds every chunk a client sends to a `RequestStream`, which finds the
request heads (pipelined or split across chunks), skips request bodies by their framing
(Content-Length or chunked), and classifies each request the way S3 bills it:

  GET   GetObject (a path with a key; ranged or not)
  HEAD  HeadObject / HeadBucket
  LIST  ListObjects (v1 or v2): a GET of the bucket itself with a listing query
  OTHER anything else (ListBuckets, GetBucketLocation, PUT, ...)

The counting happens outside every contender, so nothing here is self-reported.
Path-style addressing is assumed (every contender is configured for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

KINDS = ("GET", "HEAD", "LIST", "OTHER")

#: Query parameters that make a GET of a bucket a listing (ListObjects v1 and v2).
_LIST_PARAMS = frozenset({"list-type", "prefix", "delimiter", "max-keys", "marker",
                          "continuation-token", "start-after", "encoding-type",
                          "fetch-owner"})
#: Query parameters that make a GET of a bucket something other than a listing.
_BUCKET_SUBRESOURCES = frozenset({"location", "acl", "versioning", "policy", "cors",
                                  "lifecycle", "tagging", "uploads", "versions",
                                  "object-lock", "encryption", "website", "logging"})
_MAX_HEAD = 64 * 1024


def classify(method: str, target: str) -> str:
    """The request kind of one request line's method and target (path-style)."""
    method = method.upper()
    parts = urlsplit(target)
    key_part = parts.path.lstrip("/").partition("/")[2]
    if method == "HEAD":
        return "HEAD"
    if method != "GET":
        return "OTHER"
    if key_part:
        return "GET"
    if not parts.path.strip("/"):
        return "OTHER"  # GET / is ListBuckets
    params = set(parse_qs(parts.query, keep_blank_values=True))
    if params & _BUCKET_SUBRESOURCES:
        return "OTHER"
    # A bare GET of a bucket is ListObjects v1 with no parameters.
    if not params or params & _LIST_PARAMS:
        return "LIST"
    return "OTHER"


@dataclass
class RequestStream:
    """Parses one connection's client->server bytes; counts into `counts`."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: When given, requests are also counted by HTTP method here (PUT and DELETE are
    #: both OTHER above, and a store that is written to bills them differently).
    methods: dict[str, int] | None = None
    #: Set when the stream stopped making sense; counting stops for this connection.
    broken: bool = False
    _buffer: bytearray = field(default_factory=bytearray)
    _body_left: int = 0
    _chunked: bool = False

    def feed(self, data: bytes) -> None:
        if self.broken:
            return
        self._buffer += data
        try:
            while self._step():
                pass
        except ValueError:
            self.broken = True
            self._buffer.clear()

    def _step(self) -> bool:
        """Consume one unit (a body, a chunk, a head); False when more bytes are needed."""
        if self._body_left:
            taken = min(self._body_left, len(self._buffer))
            del self._buffer[:taken]
            self._body_left -= taken
            return bool(self._buffer) and not self._body_left
        if self._chunked:
            return self._skip_chunk()
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise ValueError("request head too long")
            return False
        head = bytes(self._buffer[:end]).decode("latin-1")
        del self._buffer[: end + 4]
        lines = head.split("\r\n")
        while lines and not lines[0]:
            lines.pop(0)  # stray CRLF between requests is allowed
        if not lines:
            return bool(self._buffer)
        method, target, version = lines[0].split(" ", 2)
        if not version.startswith("HTTP/"):
            raise ValueError(f"not a request line: {lines[0]!r}")
        self.counts[classify(method, target)] += 1
        if self.methods is not None:
            self.methods[method.upper()] = self.methods.get(method.upper(), 0) + 1
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        else:
            self._body_left = int(headers.get("content-length", "0") or 0)
        return bool(self._buffer)

    def _skip_chunk(self) -> bool:
        end = self._buffer.find(b"\r\n")
        if end < 0:
            return False
        size = int(bytes(self._buffer[:end]).split(b";")[0], 16)
        if size == 0:
            # The last chunk: no trailers from our clients, just the closing CRLF.
            if len(self._buffer) < end + 4:
                return False
            del self._buffer[: end + 4]
            self._chunked = False
            return bool(self._buffer)
        del self._buffer[: end + 2]
        self._body_left = size + 2  # the data and its CRLF
        return bool(self._buffer)
