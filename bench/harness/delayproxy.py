"""A TCP proxy that adds a fixed delay per direction and counts the S3 requests it carries.

    python -m bench.harness.delayproxy --listen HOST:PORT --upstream HOST:PORT \
        --delay-ms D --control /path/control.sock

This kernel has no `netem`, so round-trip time comes from here: every chunk read from
one side is written to the other `delay` later (order kept, reading never waits for the
delay, so a connection still carries a full window in flight), and a new connection's
first request waits one extra round trip, as a TCP handshake would cost. Bandwidth is
not limited here; `tc htb` on the veth does that.

Counting, from outside every contender: request kinds parsed from the client->server
stream (`httpcount`), bytes each way, connections. A client on the control socket (a
path, so it works from any network namespace) sends one line and gets one JSON line:
  stats        -> {"GET": n, "HEAD": n, "LIST": n, "OTHER": n, "bytes_down": n, ...,
                   "methods": {"GET": n, "PUT": n, ...}}  (the one value that is not a number)
  delay MS     -> {"delay_ms": MS}   (change the one-way delay from now on)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
from pathlib import Path

from bench.harness.httpcount import KINDS, RequestStream

_CHUNK = 256 * 1024
#: Chunks held per direction while waiting out the delay (bounds memory: 16 MiB).
_QUEUE_CHUNKS = 64


class Counters:
    def __init__(self) -> None:
        self.values: dict[str, int] = {
            **dict.fromkeys(KINDS, 0), "bytes_down": 0, "bytes_up": 0, "connections": 0,
            "unparsed_connections": 0,
        }
        self.methods: dict[str, int] = {}


class DelayProxy:
    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.counters = Counters()

    async def handle(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        self.counters.values["connections"] += 1
        with contextlib.suppress(OSError):
            client_w.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        stream = RequestStream(counts=self._live_counts(), methods=self.counters.methods)
        # SYN, SYN-ACK and the request itself: the first bytes reach the server after
        # three one-way delays, not one.
        not_before = accepted + 2 * self.delay_s
        up = asyncio.create_task(self._pipe(client_r, server_w, "bytes_up", stream,
                                            not_before))
        down = asyncio.create_task(self._pipe(server_r, client_w, "bytes_down", None, 0.0))
        try:
            await asyncio.gather(up, down)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for task in (up, down):
                task.cancel()
            for writer in (client_w, server_w):
                writer.close()
            if stream.broken:
                self.counters.values["unparsed_connections"] += 1

    def _live_counts(self) -> dict[str, int]:
        # The stream counts straight into the shared totals (one event loop: no races).
        return self.counters.values

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    counter: str, stream: RequestStream | None, not_before: float) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)

        async def read_side() -> None:
            try:
                while data := await reader.read(_CHUNK):
                    self.counters.values[counter] += len(data)
                    if stream is not None:
                        stream.feed(data)
                    await queue.put((max(loop.time() + self.delay_s, not_before), data))
            except OSError:
                pass  # a reset reads as the end of this direction
            finally:
                await queue.put((loop.time() + self.delay_s, b""))

        async def write_side() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()  # pass the half-close on
                    return
                writer.write(data)
                await writer.drain()

        reading = asyncio.create_task(read_side())
        try:
            await write_side()
        finally:
            reading.cancel()

    async def control(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode().strip()
            command, _, arg = line.partition(" ")
            if command == "stats":
                reply: dict[str, object] = {**self.counters.values,
                                            "methods": dict(self.counters.methods)}
            elif command == "delay":
                self.delay_s = float(arg) / 1000
                reply = {"delay_ms": self.delay_s * 1000}
            else:
                reply = {"error": f"unknown command {command!r}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(args: argparse.Namespace) -> None:
    proxy = DelayProxy(_host_port(args.upstream), args.delay_ms / 1000)
    host, port = _host_port(args.listen)
    server = await asyncio.start_server(proxy.handle, host, port, backlog=512)
    control_path = Path(args.control)
    control_path.unlink(missing_ok=True)
    control = await asyncio.start_unix_server(proxy.control, str(control_path))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server, control:
        await stop.wait()
    control_path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument("--control", required=True, help="path of the control socket")
    args = parser.parse_args()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
