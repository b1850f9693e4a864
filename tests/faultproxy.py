"""A small HTTP/1.1 reverse proxy that injects faults between a client and an object store.

    with FaultProxy("127.0.0.1", 8333, seed=1) as proxy:
        proxy.add_rule(method="GET", path_contains="/bucket/key", action="status:503", times=2)
        proxy.add_rule(method="GET", action="reset", probability=0.05)
        ...  # point the client at proxy.endpoint

Requests are forwarded verbatim (Host header included, so SigV4 signatures still match),
client connections are kept alive, and response bodies are streamed. Each client
connection gets one thread and one upstream connection. Request bodies are buffered
(a read-only mount sends none), which lets a request that met a stale upstream
keep-alive connection be replayed once on a fresh one.

Actions:
  "status:NNN"       reply NNN without forwarding (S3 XML or GCS JSON error body, per `flavor`)
  "status:NNN:SECS"  the same with a `Retry-After: SECS` header
  "drop"             close the client connection without a reply
  "truncate"         forward, send half the body under the original Content-Length, then close
  "reset"            forward, send half the body, then reset the connection (RST)
  "stall:SECS"       forward, send half the body, then say nothing for SECS and close
  "delay:SECS"       wait, then forward
  "unpin"            forward without the version precondition (If-Match; GCS's generation
                     and ifGenerationMatch), as a store that ignores it would; for S3, whose
                     signature covers If-Match, the proxy needs a `signer` (tests/sigv4.py)
  "hide:HEADER"      forward, leaving that header out of the response

A rule with a `probability` below 1 applies to that share of the requests it matches,
drawn from the proxy's RNG (`seed`). `faults` tallies what was injected, by action.

`require_credential(header, value)` makes the proxy a store that checks a credential
the upstream does not: a request without that header and value is refused (403 for
"s3", 401 for "gcs", or `refusal`'s status and message) and never forwarded; one with
it goes on without it, signed anew by `signer` where given (a session token, which the
S3 test server cannot check). `signed=True` also refuses a request whose SigV4
signature does not cover the header, as S3 does. With `param`, a request to GCS's JSON
API must carry it as that query parameter instead (a requester-pays bucket's project).

`bucket_region(region)` makes the proxy answer as S3 does for a bucket in `region`: a
request signed for another region gets 400 AuthorizationHeaderMalformed naming the
right one (a HEAD, no body), and every answer, refusals included, carries
`x-amz-bucket-region`.

`outage("refuse")` takes the link down: the port is closed (connects are refused) and
open connections are cut. `outage("blackhole")` leaves the port open but answers nothing:
requests and bodies in flight wait until the link is back (the client gives up first if
its timeout is shorter). `restore()` brings the link back on the same port.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import BinaryIO, Self

_CHUNK = 64 * 1024
#: (method, target, headers) -> the headers, signed anew for the rewritten request.
Signer = Callable[[str, str, list[tuple[str, str]]], list[tuple[str, str]]]
_CUTS = ("truncate", "reset", "stall")
# Lower-case names of the query parameters and headers that pin a version.
_PIN_PARAMS = ("generation", "ifgenerationmatch")
_PIN_HEADERS = ("if-match", "x-goog-if-generation-match")
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
    probability: float

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
        code, _, retry_after = arg.partition(":")
        HTTPStatus(int(code))  # a status we can name in the reply
        if retry_after:
            int(retry_after)
        return
    if kind in ("drop", "truncate", "reset", "unpin") and not arg:
        return
    if kind in ("delay", "stall"):
        float(arg)
        return
    if kind == "hide" and arg:
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
        """Wake the thread whatever it is blocked on (stop() and outages call this)."""
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
        if request is None or not self.proxy._pass(request=True):
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
        if not self.proxy._admit(request):
            status, message = self.proxy.refusal or (
                401 if self.proxy.flavor == "gcs" else 403, "")
            self._reply_error(request, status, "", message)
            return keep_alive
        wrong = self.proxy._signed_for(request)
        if wrong is not None:
            self._reply_wrong_region(request, wrong)
            return keep_alive
        kind, _, arg = (action or "").partition(":")
        if kind == "status":
            code, _, retry_after = arg.partition(":")
            self._reply_error(request, int(code), retry_after)
            return keep_alive
        if kind == "delay" and self.proxy.stopping.wait(float(arg)):
            return False  # stopping
        if kind == "unpin":
            self._unpin(request)
        return self._forward(request, action or "") and keep_alive

    def _unpin(self, request: _Request) -> None:
        """The request as a store that ignores version preconditions would act on it."""
        request.headers = [(k, v) for k, v in request.headers if k.lower() not in _PIN_HEADERS]
        path, sep, query = request.target.partition("?")
        if sep:
            kept = [p for p in query.split("&") if p.partition("=")[0].lower() not in _PIN_PARAMS]
            request.target = path + ("?" + "&".join(kept) if kept else "")
        if self.proxy.signer is not None:
            request.headers = self.proxy.signer(request.method, request.target, request.headers)

    def _reply_error(self, request: _Request, status: int, retry_after: str,
                     message: str = "") -> None:
        if self.proxy.flavor == "gcs":
            error = {"code": status, "message": message or "injected by FaultProxy"}
            body = json.dumps({"error": {**error, "errors": [error]}}).encode()
            content_type = "application/json; charset=UTF-8"
        else:
            code, text = _S3_ERRORS.get(status, (str(status), "Injected by FaultProxy."))
            message = message or text
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
            ).encode()
            content_type = "application/xml"
        extra = f"Retry-After: {retry_after}\r\n" if retry_after else ""
        if self.proxy.region is not None:  # S3 names it even in a refusal
            extra += f"x-amz-bucket-region: {self.proxy.region}\r\n"
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n{extra}"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        self.client.sendall(head if request.method == "HEAD" else head + body)

    def _reply_wrong_region(self, request: _Request, wrong: str) -> None:
        region = self.proxy.region
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AuthorizationHeaderMalformed'
            f"</Code><Message>The authorization header is malformed; the region '{wrong}' "
            f"is wrong; expecting '{region}'</Message><Region>{region}</Region></Error>"
        ).encode()
        head = (
            "HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\n"
            f"x-amz-bucket-region: {region}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        self.client.sendall(head if request.method == "HEAD" else head + body)

    def _send(self, request: _Request) -> http.client.HTTPResponse:
        assert self.upstream is not None
        self.upstream.putrequest(
            request.method, request.target, skip_host=True, skip_accept_encoding=True
        )
        for name, value in request.headers:
            if self.proxy.flavor == "gcs" and name.lower() == "host":
                # Unsigned requests, and the emulator routes its XML API (what obstore
                # speaks) by the Host it was told to answer for: its own.
                value = "{}:{}".format(*self.proxy.upstream)
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

    def _forward(self, request: _Request, action: str) -> bool:
        """Relay the upstream response (cut short if `action` says so); False when the
        connection must close."""
        resp = self._exchange(request)
        self.proxy._answered(request.method, request.target, resp.status)
        kind, _, arg = action.partition(":")
        hidden = arg.lower() if kind == "hide" else None
        version = "1.0" if resp.version == 10 else "1.1"
        head = f"HTTP/{version} {resp.status} {resp.reason}\r\n"
        head += "".join(
            f"{name}: {value}\r\n" for name, value in resp.getheaders() if name.lower() != hidden
        )
        if self.proxy.region is not None:
            head += f"x-amz-bucket-region: {self.proxy.region}\r\n"
        self.client.sendall((head + "\r\n").encode("latin-1"))
        if kind in _CUTS:
            return self._cut(resp, kind, arg)
        while data := resp.read1(_CHUNK):
            if not self.proxy._pass():
                return False  # the link went down mid-body
            self.client.sendall(b"%x\r\n%s\r\n" % (len(data), data) if resp.chunked else data)
        if resp.chunked:
            self.client.sendall(b"0\r\n\r\n")
        # Marks the response done (read1 never does for HEAD), so the upstream connection
        # can carry the next request.
        resp.close()
        return not resp.will_close

    def _cut(self, resp: http.client.HTTPResponse, kind: str, arg: str) -> bool:
        """Half the body under the original framing, then hang up, reset or go silent."""
        body = resp.read()
        half = body[: len(body) // 2]
        if half and resp.chunked:
            half = b"%x\r\n%s\r\n" % (len(half), half)
        self.client.sendall(half)
        if kind == "reset":
            # Linger 0: closing sends RST instead of FIN.
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif kind == "stall":
            self.proxy.stopping.wait(float(arg))
        return False


class FaultProxy:
    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        flavor: str = "s3",
        seed: int | None = None,
        signer: Signer | None = None,
    ) -> None:
        """`flavor` ("s3" or "gcs") picks the error body of injected statuses; `seed` the
        draws of rules with a probability; `signer` signs requests that "unpin" rewrote."""
        if flavor not in ("s3", "gcs"):
            raise ValueError(f"flavor must be 's3' or 'gcs', not {flavor!r}")
        self.upstream = (upstream_host, upstream_port)
        self.flavor = flavor
        self.signer = signer
        self.port = 0
        #: Every request seen, faulted or not: (method, path with query as sent).
        self.requests: list[tuple[str, str]] = []
        #: Every response the upstream gave: (method, path as forwarded, status).
        self.answers: list[tuple[str, str, int]] = []
        #: Faults injected since the start, by action ("blackhole": requests that arrived
        #: while the link was blackholed; "cut": connections an outage cut).
        self.faults: Counter[str] = Counter()
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        # The link's state: "up", "refuse" or "blackhole"; the acceptor follows it.
        self._link = "up"
        self._link_changed = threading.Condition(self._lock)
        self._rng = random.Random(seed)
        self._rules: list[_Rule] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._active: dict[_Connection, threading.Thread] = {}
        #: (header, value, signed, param) that every request must carry
        #: (`require_credential`), the answer to one without, and how many were refused.
        self._credential: tuple[str, str, bool, str | None] | None = None
        self.refusal: tuple[int, str] | None = None
        self.refused = 0
        #: The region S3 would say the bucket is in (`bucket_region`), and the requests
        #: refused for being signed for another.
        self.region: str | None = None
        self.wrong_region = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_rule(
        self,
        method: str | None = None,
        path_contains: str | None = None,
        action: str = "status:503",
        times: int | None = None,
        probability: float = 1.0,
    ) -> None:
        """Fault the requests that match (all given criteria); `times=None` means always.
        Rules are tried in the order they were added; the first live match that its
        probability draw lets through applies."""
        _check_action(action)
        if not 0 < probability <= 1:
            raise ValueError(f"probability must be in (0, 1], not {probability}")
        with self._lock:
            self._rules.append(_Rule(method, path_contains, action, times, probability))

    def require_credential(self, header: str, value: str, *, signed: bool = False,
                           param: str | None = None,
                           refusal: tuple[int, str] | None = None) -> None:
        """Refuse every request that lacks `header: value` (see the module docstring)."""
        with self._lock:
            self._credential, self.refusal = (header.lower(), value, signed, param), refusal

    def bucket_region(self, region: str) -> None:
        """Answer as S3 for a bucket in `region` (see the module docstring)."""
        with self._lock:
            self.region = region

    def _signed_for(self, request: _Request) -> str | None:
        """The region a request is signed for where it is not the bucket's (S3 refuses
        it); None where it is, or the request is unsigned."""
        if (region := self.region) is None:
            return None
        scope = (request.header("Authorization") or "").partition("Credential=")[2]
        signed = scope.split(",")[0].split("/")[2:3]
        if signed and signed[0] != region:
            with self._lock:
                self.wrong_region += 1
            return signed[0]
        return None

    def _admit(self, request: _Request) -> bool:
        """Whether the request carries the required credential; if so, it is taken off
        (and the request signed anew, where there is a signer)."""
        with self._lock:
            credential = self._credential
        if credential is None:
            return True
        header, value, signed, param = credential
        if param is not None and request.target.startswith(("/storage/", "/download/")):
            # GCS's JSON API: the query names it (left there: the upstream ignores it).
            carried = f"{param}={value}" in request.target.partition("?")[2].split("&")
        else:
            signed_headers = (request.header("Authorization") or "").partition(
                "SignedHeaders=")[2].split(",")[0].split(";")
            covered = header in signed_headers
            carried = request.header(header) == value and (covered or not signed)
            if carried:
                request.headers = [(k, v) for k, v in request.headers if k.lower() != header]
                if self.signer is not None:
                    request.headers = self.signer(request.method, request.target,
                                                  request.headers)
        if not carried:
            with self._lock:
                self.refused += 1
        return carried

    def clear(self) -> None:
        """Drop every rule and forget the requests and answers seen so far (not `faults`)."""
        with self._lock:
            self._rules.clear()
            self.requests.clear()
            self.answers.clear()

    def count(self, method: str | None = None, path_contains: str | None = None) -> int:
        """How many requests seen so far match."""
        with self._lock:
            return sum(
                (method is None or m == method) and (path_contains is None or path_contains in p)
                for m, p in self.requests
            )

    def outage(self, mode: str = "refuse") -> None:
        """Take the link down (see the module docstring); returns once it is down."""
        if mode not in ("refuse", "blackhole"):
            raise ValueError(f"outage mode must be 'refuse' or 'blackhole', not {mode!r}")
        with self._link_changed:
            self._link = mode
            self._link_changed.notify_all()
        if mode == "refuse":
            self._await_listener(listening=False)
            with self._lock:
                active = list(self._active)
                self.faults["cut"] += len(active)
            for conn in active:
                conn.abort()

    def restore(self) -> None:
        """Bring the link back; returns once the port accepts connections again."""
        with self._link_changed:
            self._link = "up"
            self._link_changed.notify_all()
        self._await_listener(listening=True)

    def _await_listener(self, *, listening: bool) -> None:
        with self._link_changed:
            if not self._link_changed.wait_for(
                lambda: (self._listener is not None) == listening or self.stopping.is_set(),
                timeout=10,
            ):
                raise RuntimeError(f"the proxy's port did not {'open' if listening else 'close'}")

    def _pass(self, *, request: bool = False) -> bool:
        """Hold the caller (a new `request`, or a body in flight) while the link is
        blackholed; False once it is refused or the proxy stops (the connection closes)."""
        with self._link_changed:
            if request and self._link == "blackhole":
                self.faults["blackhole"] += 1
            while self._link == "blackhole" and not self.stopping.is_set():
                self._link_changed.wait(0.1)
            return self._link == "up" and not self.stopping.is_set()

    def _record(self, method: str, path: str) -> str | None:
        """Log a request and pick its fault, if any."""
        with self._lock:
            self.requests.append((method, path))
            for rule in self._rules:
                if rule.matches(method, path) and (
                    rule.probability >= 1 or self._rng.random() < rule.probability
                ):
                    if rule.times is not None:
                        rule.times -= 1
                    self.faults[rule.action] += 1
                    return rule.action
        return None

    def _answered(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.answers.append((method, path, status))

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._active.pop(conn, None)

    def start(self) -> Self:
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        self._acceptor.start()
        return self

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.create_server(("127.0.0.1", port))
        # accept() polls, so stop() and outages do not depend on close() waking it.
        listener.settimeout(0.1)
        return listener

    def _listening(self) -> socket.socket | None:
        """The listener, opened or closed to follow the link's state (acceptor thread)."""
        with self._link_changed:
            up = self._link != "refuse"
            if up and self._listener is None:
                self._listener = self._listen(self.port)  # same port: clients keep it
                self._link_changed.notify_all()
            elif not up and self._listener is not None:
                self._listener.close()
                self._listener = None
                self._link_changed.notify_all()
            return self._listener

    def _accept(self) -> None:
        while not self.stopping.is_set():
            listener = self._listening()
            if listener is None:
                with self._link_changed:
                    self._link_changed.wait(0.1)
                continue
            try:
                client, _ = listener.accept()
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
        with self._link_changed:
            self.stopping.set()
            self._link_changed.notify_all()
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
