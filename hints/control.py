"""The control requests of a mount's socket: what the mount is doing (`bucketfs status`)
and warming its cache (`bucketfs warm`). Standard library only, like the rest of the
client side; the socket is found as for hints (docs/HINTS.md), and the same peers may
use it (the owner, root, `--hints-group`).

Unlike hints, these are asked for by a person or a script, so every failure raises
HintError with one line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from bucketfs.hints import location
from bucketfs.hints.client import DEFAULT_TIMEOUT, HintError, Target, ask
from bucketfs.hints.protocol import (
    CancelWarm,
    Message,
    ProtocolError,
    Reply,
    StatusQuery,
    StatusReport,
    Warm,
    WarmStarted,
)


def target_of(path: str | os.PathLike[str]) -> Target:
    """The bucketfs mount `path` is in (the mountpoint itself or anything under it)."""
    found = location.mount_of(os.path.realpath(path), location.read_mounts())
    if found is None:
        raise HintError(f"{os.fspath(path)} is not in a bucketfs mount")
    return Target(found.mountpoint, found.owner_uid)


def status(target: Target, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """The daemon's status report (a JSON object; docs/HINTS.md lists its keys)."""
    return _expect(target, StatusQuery(), StatusReport, "status", timeout).data


def start_warm(target: Target, paths: Sequence[str],
               timeout: float = DEFAULT_TIMEOUT) -> int:
    """Have the daemon fetch these files (relative to the mountpoint) into its cache;
    returns the warm job's id, whose progress `status` reports under "warm"."""
    try:
        message = Warm(paths)
        return _expect(target, message, WarmStarted, "warm", timeout).id
    except ProtocolError as exc:
        raise HintError(str(exc)) from None


def cancel_warm(target: Target, number: int, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Stop warm job `number`; what it fetched stays cached."""
    _expect(target, CancelWarm(number), Reply, "warm", timeout)


def _expect(target: Target, message: Message, kind: type, what: str,
            timeout: float) -> Any:
    answer = ask(target, message, timeout)
    if isinstance(answer, Reply) and not answer.ok:
        if answer.reason.startswith("unknown message kind"):
            raise HintError(f"the daemon of {target.mountpoint} is older than this "
                            f"command and has no {what}; mount it again to get it")
        raise HintError(f"the daemon of {target.mountpoint} refused: {answer.reason}")
    if not isinstance(answer, kind):
        raise HintError(f"the daemon of {target.mountpoint} answered {what} with a "
                        f"{type(answer).__name__}")
    return answer
