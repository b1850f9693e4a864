"""Telling a mount's daemon the order in which a job will read its files.

`send_order` (and `send_next_order`, the next epoch's order announced ahead) never
raises into a training loop: a path under no bucketfs mount, an unreachable daemon or
a refusal is a warning (once per distinct reason), and training goes on without hints.
`strict=True` (the CLI) raises HintError instead.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bucketfs.hints import location, protocol
from bucketfs.hints.protocol import End, Message, Order, ProtocolError, Reply

DEFAULT_TIMEOUT = 10.0


class HintError(Exception):
    """Hints could not be delivered; the message is one line."""


class HintWarning(UserWarning):
    """Hints were not delivered; training is unaffected."""


_warned: set[str] = set()
_warned_lock = threading.Lock()  # orders are also sent from a thread (`send_later`)
_job: str | None = None


def default_job() -> str:
    """One id per training process, made once: DataLoader workers forked later inherit
    it (and the sampler runs in the main process anyway)."""
    global _job
    if _job is None:
        _job = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return _job


def warn_once(reason: str) -> None:
    with _warned_lock:
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"bucketfs hints: {reason}", HintWarning, stacklevel=2)


@dataclass(frozen=True, slots=True)
class Target:
    """A bucketfs mount that paths fall under."""

    mountpoint: str
    owner_uid: int | None


Place = tuple[Target, str]
#: The mounts each job has told, so that end_job(job) can tell each of them.
_told: dict[str, set[Target]] = {}


def resolve(paths: Iterable[str | os.PathLike[str]], base: str | None = None,
            ) -> list[Place | None]:
    """For each path, its bucketfs mount and its path relative to that mount's root, or
    None if it is under no bucketfs mount. Relative paths are taken from `base`
    (default: the working directory)."""
    mounts = location.read_mounts()
    base = os.path.abspath(base) if base is not None else os.getcwd()
    # realpath each directory once, not each file: a million lstat()s would each be a
    # FUSE lookup, and bucketfs has no symlinks below the mountpoint anyway.
    directories: dict[str, Place | None] = {}
    places: list[Place | None] = []
    for path in paths:
        directory, name = os.path.split(os.path.join(base, os.fspath(path)))
        if directory not in directories:
            directories[directory] = _place(os.path.realpath(directory), mounts)
        place = directories[directory]
        if place is None or name in ("", ".", ".."):
            places.append(None)
        else:
            target, relative = place
            places.append((target, f"{relative}/{name}" if relative else name))
    return places


def _place(real_dir: str, mounts: list[location.Mount]) -> Place | None:
    mount = location.mount_of(real_dir, mounts)
    if mount is None:
        return None
    relative = real_dir[len(mount.mountpoint):].strip("/")
    return Target(mount.mountpoint, mount.owner_uid), relative


def group(places: Iterable[Place | None]) -> dict[Target, list[str]]:
    """Mount-relative paths per mount, in the given order; paths under none dropped."""
    groups: dict[Target, list[str]] = {}
    for place in places:
        if place is not None:
            groups.setdefault(place[0], []).append(place[1])
    return groups


def send_order(paths: Iterable[str | os.PathLike[str]], *, epoch: int, job: str | None = None,
               rank: int = 0, world_size: int = 1, mount: str | None = None,
               timeout: float = DEFAULT_TIMEOUT, strict: bool = False,
               next_epoch: bool = False, next_follows: bool = False) -> bool:
    """Tell each bucketfs mount under which `paths` lie that this rank of `job` will
    read them in this order during `epoch`. Relative paths are relative to `mount` if
    given (then only that mount is told), else to the working directory. Returns True
    if every mount concerned accepted its order. `next_follows`: `send_next_order`
    will announce the next epoch's order shortly. With `next_epoch`, see
    `send_next_order`."""
    try:
        places = resolve(paths, mount)
        if mount is not None:
            places = _only_mount(places, mount, strict)
        return send_groups(group(places), epoch=epoch, job=job, rank=rank,
                           world_size=world_size, timeout=timeout, strict=strict,
                           next_epoch=next_epoch, next_follows=next_follows)
    except Exception as exc:
        return _failed(exc, strict)


def send_next_order(paths: Iterable[str | os.PathLike[str]], *, epoch: int,
                    job: str | None = None, rank: int = 0, world_size: int = 1,
                    mount: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                    strict: bool = False) -> bool:
    """Announce, while this rank of `job` reads the order it sent last, the order it
    will read in the next epoch, `epoch` (later than that order's). The daemon lays
    the files read now out on its SSD in that order; it prefetches nothing for it (the
    epoch's own `send_order`, when it starts, does). Arguments as for `send_order`;
    send that order with `next_follows=True`, so the daemon waits for this one."""
    return send_order(paths, epoch=epoch, job=job, rank=rank, world_size=world_size,
                      mount=mount, timeout=timeout, strict=strict, next_epoch=True)


def send_groups(groups: dict[Target, list[str]], *, epoch: int, job: str | None = None,
                rank: int = 0, world_size: int = 1, timeout: float = DEFAULT_TIMEOUT,
                strict: bool = False, next_epoch: bool = False,
                next_follows: bool = False) -> bool:
    """send_order for paths already resolved and grouped (HintSampler resolves its
    dataset once, not every epoch)."""
    try:
        if not groups:
            raise HintError("no path is under a bucketfs mount; nothing to hint")
        job = job or default_job()
        delivered = True
        for target, relative in groups.items():
            order = Order(job, rank, world_size, epoch, _encodable(relative, strict),
                          next_epoch, next_follows)
            if _deliver(target, order, timeout, strict):
                _told.setdefault(job, set()).add(target)
            else:
                delivered = False
        return delivered
    except Exception as exc:
        return _failed(exc, strict)


def end_job(job: str | None = None, *, mount: str | None = None,
            timeout: float = DEFAULT_TIMEOUT, strict: bool = False) -> bool:
    """Tell the daemon of `mount`, or else of every mount `job` sent orders to, that
    `job` is done with it. Returns True if all acknowledged."""
    job = job or default_job()
    wait_sent()  # an order still being sent must not arrive after the END
    try:
        if mount is None:
            targets = _told.pop(job, set())
        else:
            found = location.mount_of(os.path.realpath(mount), location.read_mounts())
            if found is None:
                raise HintError(f"{mount} is not under a bucketfs mount")
            targets = {Target(found.mountpoint, found.owner_uid)}
        return all([_deliver(target, End(job), timeout, strict) for target in targets])
    except Exception as exc:
        return _failed(exc, strict)


# --- Sending in the background -------------------------------------------------------

_sending: set[threading.Thread] = set()
_fork_hook = False


def send_later(send: Callable[[], object]) -> None:
    """Run `send` (a send that never raises) in a thread of its own, so a million paths
    do not hold up the training loop. `wait_sent` waits for it; so does `end_job`, and
    so does a fork: a child (a DataLoader worker) must not start with a lock held by a
    thread that does not exist there."""
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(before=wait_sent)
        _fork_hook = True

    def run() -> None:
        try:
            send()
        finally:
            _sending.discard(thread)

    thread = threading.Thread(target=run, name="bucketfs-hints", daemon=True)
    _sending.add(thread)
    thread.start()


def wait_sent() -> None:
    """Until every `send_later` started so far has finished."""
    for thread in list(_sending):
        if thread is not threading.current_thread():
            thread.join()


def _failed(exc: Exception, strict: bool) -> bool:
    """Hints are advice: outside strict mode no failure reaches the caller."""
    if isinstance(exc, HintError | ProtocolError):
        if strict:
            raise HintError(str(exc)) from None
        warn_once(str(exc))
    elif strict:
        raise exc
    else:
        warn_once(f"{type(exc).__name__}: {exc}")
    return False


def _only_mount(places: list[Place | None], mount: str, strict: bool) -> list[Place | None]:
    found = location.mount_of(os.path.realpath(mount), location.read_mounts())
    if found is None:
        raise HintError(f"{mount} is not under a bucketfs mount")
    kept = [p if p is not None and p[0].mountpoint == found.mountpoint else None
            for p in places]
    stray = kept.count(None)
    if stray and strict:
        raise HintError(f"{stray} of {len(kept)} paths are not files under "
                        f"{found.mountpoint}")
    return kept


def _encodable(paths: list[str], strict: bool) -> list[str]:
    """Bucket names are UTF-8: a local name that is not (os.fsdecode gives surrogates)
    cannot be a bucketfs file, so it is dropped rather than failing the whole order."""
    try:
        "\0".join(paths).encode("utf-8")
        return paths
    except UnicodeEncodeError:
        if strict:
            raise HintError("a path is not valid UTF-8") from None
        return [p for p in paths if p.isascii() or _is_utf8(p)]


def _is_utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _deliver(target: Target, message: Message, timeout: float, strict: bool) -> bool:
    reply = request(target, message, timeout)
    if not reply.ok:
        reason = f"the daemon of {target.mountpoint} refused: {reply.reason}"
        if strict:
            raise HintError(reason)
        warn_once(reason)
    return reply.ok


# --- One request on the mount's socket ----------------------------------------------


def request(target: Target, message: Message, timeout: float = DEFAULT_TIMEOUT) -> Reply:
    """Send one message to the daemon of `target` and return its reply. Raises
    HintError if no daemon answers there."""
    reply = ask(target, message, timeout)
    if not isinstance(reply, Reply):
        raise HintError(f"the daemon of {target.mountpoint} answered a "
                        f"{protocol.kind_of(reply).name}, not a REPLY")
    return reply


def ask(target: Target, message: Message, timeout: float = DEFAULT_TIMEOUT) -> Message:
    """Send one message to the daemon of `target` and return its answer: a REPLY, or
    the reply kind of the request (STATUS_REPLY, WARM_REPLY). Raises HintError if no
    daemon answers there."""
    frame = protocol.encode(message)
    candidates = location.socket_candidates(target.mountpoint, target.owner_uid)
    checked = location.SOCKET_ENV not in os.environ
    problems = []
    for path in candidates:
        if checked and not _trusted(path, target.owner_uid):
            continue
        try:
            return _exchange(str(path), frame, timeout)
        except FileNotFoundError:
            continue
        except (OSError, ProtocolError) as exc:
            problems.append(f"{path}: {_describe(exc)}")
    if not problems:
        looked = ", ".join(str(p) for p in candidates)
        raise HintError(f"no hints socket for {target.mountpoint} (looked at {looked})")
    raise HintError(f"cannot reach the daemon of {target.mountpoint}: {problems[0]}")


def _trusted(path: os.PathLike[str], owner_uid: int | None) -> bool:
    """Only a socket the mount's owner (or root) made: a socket someone else planted
    under /tmp must not learn the job's file order."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid in (0, owner_uid, os.getuid())


def _exchange(path: str, frame: bytes, timeout: float) -> Message:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        # A daemon that refuses a frame stops reading it; its reply says why.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(frame)
        kind, length, flags = protocol.parse_header(_receive(sock, protocol.HEADER_SIZE))
        reply = protocol.decode_body(kind, _receive(sock, length), flags)
    if not isinstance(reply, protocol.REPLIES):
        raise ProtocolError(f"expected a reply, got {kind.name}")
    return reply


def _receive(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ProtocolError("the daemon closed the connection without a reply")
        data += chunk
    return bytes(data)


def _describe(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
