"""A large body's socket wakes the GET driver only once a good part more of it has
arrived (SO_RCVLOWAT, bucketfs.backends.curl_multi): fewer rounds through trio and
libcurl while it trickles in, a slow body not taken for a stalled one, and a kept-alive
connection that wakes at every byte again for the next GET. Against the small HTTP
server of test_curl_gets, sending the body in pieces with pauses (a slow link)."""

from __future__ import annotations

import time

import pytest
import trio

from bucketfs.backends import curl_multi
from bucketfs.backends.curl_multi import LARGE_BODY, CurlSettings, Transfer, TrioCurl
from tests.test_curl_gets import BODY, server  # noqa: F401 (fixture)


def get_all(engine: TrioCurl, endpoint: str, lengths: list[int]) -> list[bytes]:
    """GETs of these lengths from the start of the body, at once; their bodies."""
    bodies: dict[int, bytes] = {}

    async def main() -> None:
        async def one(i: int, length: int) -> None:
            transfer = await engine.get(Transfer(
                f"{endpoint}/obj", [f"Range: bytes=0-{length - 1}"], length))
            assert (transfer.error, transfer.status) == (0, 206), transfer.message
            bodies[i] = bytes(transfer.take_body())

        async with trio.open_nursery() as nursery:
            for i, length in enumerate(lengths):
                nursery.start_soon(one, i, length)

    trio.run(main)
    return [bodies[i] for i in range(len(lengths))]


@pytest.fixture
def rounds(monkeypatch) -> list[int]:
    """How many rounds the driver went (one per wakeup: the figure the mark lowers)."""
    count = [0]
    real = TrioCurl._round

    def counted(self: TrioCurl) -> None:
        count[0] += 1
        real(self)

    monkeypatch.setattr(TrioCurl, "_round", counted)
    return count


def test_a_large_body_that_trickles_in_wakes_the_driver_far_less_than_it_comes(
        server, rounds, monkeypatch) -> None:  # noqa: F811
    endpoint, behaviour = server
    behaviour.trickle = 4096
    length = LARGE_BODY + 3
    pieces = 2 * -(-length // 4096)
    marks: list[tuple[int, int]] = []  # after each action: (a socket's mark, bytes lacking)
    real = TrioCurl._act

    def noted(self: TrioCurl, fd: int, mask: int) -> None:
        real(self, fd, mask)
        marks.extend((t._wake_at, t.length - t._buffer.tell())
                     for t in self._running.values()
                     if t._wake_at > 1)

    monkeypatch.setattr(TrioCurl, "_act", noted)
    engine = TrioCurl(CurlSettings(connections=4))
    assert get_all(engine, endpoint, [length, length]) == [BODY[:length]] * 2
    engine.close()
    assert rounds[0] < pieces / 8, (rounds[0], pieces)
    # Never more than the body still lacks: the socket must wake for its last bytes.
    assert marks and all(mark <= lacking for mark, lacking in marks), marks


def test_without_the_mark_the_same_body_takes_a_round_a_piece(
        server, rounds, monkeypatch) -> None:  # noqa: F811
    """The control: what the test above measures is the mark's doing."""
    endpoint, behaviour = server
    behaviour.trickle = 4096
    monkeypatch.setattr(curl_multi, "WAKE_BYTES", 1)
    length = LARGE_BODY + 3
    engine = TrioCurl(CurlSettings(connections=4))
    assert get_all(engine, endpoint, [length]) == [BODY[:length]]
    engine.close()
    assert rounds[0] > -(-length // 4096) / 8  # per body, the bound the test above beats


def test_the_next_get_on_a_kept_alive_connection_is_not_held(
        server, monkeypatch) -> None:  # noqa: F811
    """One connection: after a trickled large body, its socket's mark is one byte
    again, and a small answer (shorter than any mark the large one's socket had)
    comes at once, not at libcurl's next timer."""
    endpoint, behaviour = server
    behaviour.trickle = 4096
    marks: list[tuple[int, int]] = []  # (socket, mark) as set
    real = curl_multi._set_low_water
    monkeypatch.setattr(curl_multi, "_set_low_water",
                        lambda fd, nbytes: (marks.append((fd, nbytes)), real(fd, nbytes)))
    engine = TrioCurl(CurlSettings(connections=1, read_timeout=5))
    length = LARGE_BODY + 3
    assert get_all(engine, endpoint, [length]) == [BODY[:length]]
    # The connection libcurl keeps: back to waking at every byte.
    assert marks and marks[-1][1] == 1, marks
    behaviour.trickle = None
    started = time.monotonic()
    assert get_all(engine, endpoint, [100]) == [BODY[:100]]
    assert time.monotonic() - started < 2
    assert len({fd for fd, _ in marks}) == 1
    engine.close()


def test_a_slow_body_is_not_taken_for_a_stalled_one(server) -> None:  # noqa: F811
    """~200 KB/s against a read timeout of one second: the mark holds the socket's
    wakeups ~2.6 s apart, but the timeout is on libcurl's average speed (under a byte a
    second), so the body still comes whole; and the last piece, less than the mark, is
    read."""
    endpoint, behaviour = server
    behaviour.trickle, behaviour.pause = 4096, 0.02
    engine = TrioCurl(CurlSettings(connections=1, read_timeout=1))
    length = LARGE_BODY + 3
    assert get_all(engine, endpoint, [length]) == [BODY[:length]]
    engine.close()


def test_a_mark_longer_than_the_read_timeout_does_not_cut_a_slow_body(
        server, monkeypatch) -> None:  # noqa: F811
    """At ~16 KB/s a 128 KiB mark holds the socket quiet for ~8 s, past what libcurl
    allows a transfer at zero speed (the one-second read timeout after its ~5 s
    average): libcurl still reads the socket on its own timer every second, below the
    mark, so it sees the body come and does not cut it (a stalled body is cut after
    ~7 s: test_curl_gets)."""
    endpoint, behaviour = server
    behaviour.trickle, behaviour.pause = 4096, 0.25
    monkeypatch.setattr(curl_multi, "LARGE_BODY", 64 * 1024)
    monkeypatch.setattr(curl_multi, "WAKE_BYTES", 128 * 1024)
    marks: list[int] = []
    real = curl_multi._set_low_water
    monkeypatch.setattr(curl_multi, "_set_low_water",
                        lambda fd, nbytes: (marks.append(nbytes), real(fd, nbytes)))
    engine = TrioCurl(CurlSettings(connections=1, read_timeout=1))
    length = 160 * 1024
    assert get_all(engine, endpoint, [length]) == [BODY[:length]]
    engine.close()
    assert 128 * 1024 in marks, marks


def test_a_chunked_body_gets_no_mark(server, monkeypatch) -> None:  # noqa: F811
    """A body in chunks ends with a last chunk of a few bytes, which may come after the
    body's own: a mark would hold them until libcurl's next timer, so none is set."""
    endpoint, behaviour = server
    behaviour.trickle, behaviour.chunked = 4096, True
    marks: list[int] = []
    real = curl_multi._set_low_water
    monkeypatch.setattr(curl_multi, "_set_low_water",
                        lambda fd, nbytes: (marks.append(nbytes), real(fd, nbytes)))
    engine = TrioCurl(CurlSettings(connections=1))
    length = LARGE_BODY + 3
    assert get_all(engine, endpoint, [length]) == [BODY[:length]]
    engine.close()
    assert marks == []


def test_adding_a_get_does_not_cut_short_the_drivers_wait(server, monkeypatch) -> None:  # noqa: F811
    """libcurl asks its timer to fire at once as each GET is added; `get` acts at once
    anyway, so the waiting driver keeps its wait, where moving its deadline to "now"
    cut it short (a cancel scope fired and rebuilt) for many (18-31 of these 160)."""
    endpoint, _ = server
    cut_short = [0]
    real_wait = trio.lowlevel.wait_readable

    async def counted_wait(fd: int) -> None:
        try:
            await real_wait(fd)
        except trio.Cancelled:
            cut_short[0] += 1
            raise

    monkeypatch.setattr(trio.lowlevel, "wait_readable", counted_wait)
    engine = TrioCurl(CurlSettings(connections=16))
    chains, each = 16, 10

    async def main() -> None:
        async def one_after_another(offset: int) -> None:
            for i in range(each):
                start = offset + i
                transfer = await engine.get(Transfer(
                    f"{endpoint}/obj", [f"Range: bytes={start}-{start + 999}"], 1000))
                assert (transfer.error, transfer.status) == (0, 206), transfer.message
                assert bytes(transfer.take_body()) == BODY[start:start + 1000]

        async with trio.open_nursery() as nursery:  # the driver waits while GETs start
            for chain in range(chains):
                nursery.start_soon(one_after_another, chain * 5000)

    trio.run(main)
    engine.close()
    # libcurl's own timers may still cut a wait or two (0-1 were seen; 18-31 before).
    assert cut_short[0] <= 5, cut_short[0]
