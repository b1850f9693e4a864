"""A small HTTP/1.1 reverse proxy that injects faults between a client and an object store.

    with FaultProxy("127.0.0.1", 8333) as proxy:
        proxy.add_rule(method="GET", path_contains="/bucket/key", action="status:503", times=2)
        ...  # point the client at proxy.endpoint

Requests are forwarded verbatim (Host header included, so SigV4 signatures still match),
client connections are kept alive, and response bodies are streamed. Each client
connection gets one thread and one upstream connection. Request bodies are buffered
(a read-only mount sends none), which lets a request that met a stale upstream
keep-alive connection be replayed once on a fresh one.

Actions:
  "status:NNN"   reply NNN without forwarding (S3 XML or GCS JSON error body, per `flavor`)
  "drop"         close the client connection without a reply
  "truncate"     forward, send half the body under the original Content-Length, then close
  "delay:SECS"   wait, then forward
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import BinaryIO, Self

_CHUNK = 64 * 1024
_S3_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


@dataclass(slots=True)
class _Rule:
    method: str | None
    path_contains: str | None
    action: str
    times: int | None

    def matches(self, method: str, path: str) -> bool:
        return (
            (self.times is None or self.times > 0)
            and (self.method is None or self.method == method)
            and (self.path_contains is None or self.path_contains in path)
        )


@dataclass(slots=True)
class _Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def _check_action(action: str) -> None:
    kind, _, arg = action.partition(":")
    if kind == "status":
        HTTPStatus(int(arg))  # a status we can name in the reply
        return
    if kind in ("drop", "truncate") and not arg:
        return
    if kind == "delay":
        float(arg)
        return
    raise ValueError(f"unknown fault action {action!r}")


def _read_head(rfile: BinaryIO) -> _Request | None:
    line = rfile.readline(65537)
    if not line.strip():
        return None  # the client closed the connection
    method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers = []
    while (raw := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return _Request(method, target, headers)


def _read_body(rfile: BinaryIO, request: _Request) -> bytes:
    """The body as it came, framing included, so it can be sent on verbatim."""
    if (request.header("Transfer-Encoding") or "").lower() == "chunked":
        raw = bytearray()
        while True:
            size_line = rfile.readline(65537)
            raw += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                    raw += trailer
                return bytes(raw + b"\r\n")
            raw += rfile.read(size + 2)
    return rfile.read(int(request.header("Content-Length") or 0))


class _Connection:
    """One client connection and the upstream connection that serves it."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: http.client.HTTPConnection | None = None

    def abort(self) -> None:
        """Wake the thread whatever it is blocked on (stop() calls this)."""
        for sock in (self.client, self.upstream.sock if self.upstream else None):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        rfile = self.client.makefile("rb")
        try:
            while not self.proxy.stopping.is_set() and self._serve_one(rfile):
                pass
        except (OSError, ValueError, http.client.HTTPException):
            pass  # a peer went away mid-exchange: close both sides
        finally:
            rfile.close()
            self.client.close()
            if self.upstream is not None:
                self.upstream.close()
            self.proxy._forget(self)

    def _serve_one(self, rfile: BinaryIO) -> bool:
        """Handle one request; False when the connection must close."""
        request = _read_head(rfile)
        if request is None:
            return False
        action = self.proxy._record(request.method, request.target)
        if action == "drop":
            return False
        if (request.header("Expect") or "").lower() == "100-continue":
            # Answer it here: an upstream 100 would arrive ahead of the response we relay.
            self.client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.headers = [(k, v) for k, v in request.headers if k.lower() != "expect"]
        request.body = _read_body(rfile, request)
        keep_alive = (request.header("Connection") or "").lower() != "close"
        if action is not None and action.startswith("status:"):
            self._reply_error(request, int(action.partition(":")[2]))
            return keep_alive
        if (
            action is not None
            and action.startswith("delay:")
            and self.proxy.stopping.wait(float(action.partition(":")[2]))
        ):
            return False  # stopping
        return self._forward(request, truncate=action == "truncate") and keep_alive

    def _reply_error(self, request: _Request, status: int) -> None:
        if self.proxy.flavor == "gcs":
            error = {"code": status, "message": "injected by FaultProxy"}
            body = json.dumps({"error": {**error, "errors": [error]}}).encode()
            content_type = "application/json; charset=UTF-8"
        else:
            code, message = _S3_ERRORS.get(status, (str(status), "Injected by FaultProxy."))
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
            ).encode()
            content_type = "application/xml"
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        self.client.sendall(head if request.method == "HEAD" else head + body)

    def _send(self, request: _Request) -> http.client.HTTPResponse:
        assert self.upstream is not None
        self.upstream.putrequest(
            request.method, request.target, skip_host=True, skip_accept_encoding=True
        )
        for name, value in request.headers:
            self.upstream.putheader(name, value)
        self.upstream.endheaders(request.body or None)
        return self.upstream.getresponse()

    def _exchange(self, request: _Request) -> http.client.HTTPResponse:
        if self.upstream is None:
            self.upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
        elif self.upstream.sock is not None:
            try:
                return self._send(request)
            except ConnectionError:
                # The server closed the idle keep-alive connection: replay once on a fresh
                # one (http.client reconnects after close()), as any proxy does.
                self.upstream.close()
        return self._send(request)

    def _forward(self, request: _Request, *, truncate: bool) -> bool:
        """Relay the upstream response; False when the connection must close."""
        resp = self._exchange(request)
        version = "1.0" if resp.version == 10 else "1.1"
        head = f"HTTP/{version} {resp.status} {resp.reason}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in resp.getheaders())
        self.client.sendall((head + "\r\n").encode("latin-1"))
        if truncate:
            # Half the body under the original framing, then hang up: a short read.
            body = resp.read()
            half = body[: len(body) // 2]
            if resp.chunked:
                half = b"%x\r\n%s\r\n" % (len(half), half)
            self.client.sendall(half)
            return False
        while data := resp.read1(_CHUNK):
            self.client.sendall(b"%x\r\n%s\r\n" % (len(data), data) if resp.chunked else data)
        if resp.chunked:
            self.client.sendall(b"0\r\n\r\n")
        # Marks the response done (read1 never does for HEAD), so the upstream connection
        # can carry the next request.
        resp.close()
        return not resp.will_close


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, flavor: str = "s3") -> None:
        """`flavor` ("s3" or "gcs") picks the error body of injected statuses."""
        if flavor not in ("s3", "gcs"):
            raise ValueError(f"flavor must be 's3' or 'gcs', not {flavor!r}")
        self.upstream = (upstream_host, upstream_port)
        self.flavor = flavor
        self.port = 0
        #: Every request seen, faulted or not: (method, path with query as sent).
        self.requests: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._active: dict[_Connection, threading.Thread] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_rule(
        self,
        method: str | None = None,
        path_contains: str | None = None,
        action: str = "status:503",
        times: int | None = None,
    ) -> None:
        """Fault the requests that match (all given criteria); `times=None` means always.
        Rules are tried in the order they were added; the first live match applies."""
        _check_action(action)
        with self._lock:
            self._rules.append(_Rule(method, path_contains, action, times))

    def clear(self) -> None:
        """Drop every rule and forget the requests seen so far."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()

    def count(self, method: str | None = None, path_contains: str | None = None) -> int:
        """How many requests seen so far match."""
        with self._lock:
            return sum(
                (method is None or m == method) and (path_contains is None or path_contains in p)
                for m, p in self.requests
            )

    def _record(self, method: str, path: str) -> str | None:
        """Log a request and pick its fault, if any."""
        with self._lock:
            self.requests.append((method, path))
            for rule in self._rules:
                if rule.matches(method, path):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule.action
        return None

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._active.pop(conn, None)

    def start(self) -> Self:
        self._listener = socket.create_server(("127.0.0.1", 0))
        # accept() polls, so stop() does not depend on close() waking a blocked accept.
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        self._acceptor.start()
        return self

    def _accept(self) -> None:
        assert self._listener is not None
        while not self.stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client)
            thread = threading.Thread(target=conn.serve, name="faultproxy-conn", daemon=True)
            with self._lock:
                self._active[conn] = thread
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self._acceptor is not None:
            self._acceptor.join()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            active = list(self._active.items())
        for conn, thread in active:
            conn.abort()
            thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
