"""HintSampler: wraps a sampler, yields exactly what it yields, and tells the daemon
of the mount the dataset lives on in which order this epoch will read its files, and,
where the wrapped sampler makes that certain, in which order the next epoch will."""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import itertools
import operator
import os
import random
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed
from torch.utils.data import BatchSampler, Sampler, SequentialSampler

from bucketfs.hints import client
from bucketfs.hints.protocol import MAX_EPOCH

_samplers = itertools.count()
_ending: set[str] = set()


class HintSampler(Sampler[Any]):
    """`HintSampler(sampler, dataset)` or `HintSampler(sampler, paths=[...])`.

    `sampler` is any sampler: RandomSampler, DistributedSampler (set_epoch is
    forwarded), a BatchSampler (its items are lists of indices). Index i is the file
    `dataset.samples[i][0]` (or `dataset.imgs[i][0]`: ImageFolder, DatasetFolder), or
    `paths[i]`. Sending hints never raises: a failure is a warning, once.

    Where the next epoch's order follows from the epoch alone (a sampler with
    `set_epoch`, once `set_epoch` was called; a SequentialSampler), it is announced too,
    from a background thread, so the daemon lays out what it reads now in that order.
    """

    def __init__(self, sampler: Sampler[Any] | Sequence[Any], dataset: Any = None, *,
                 paths: Sequence[str | os.PathLike[str]] | None = None,
                 job: str | None = None) -> None:
        self.sampler = sampler
        self.paths = paths if paths is not None else _dataset_paths(dataset)
        # Each sampler is its own stream of reads (train and validation loaders keep
        # separate plans), so by default each gets its own job id.
        self.job = job or f"{client.default_job()}-{next(_samplers)}"
        self.epoch: int | None = None
        self.iterations = 0
        self._places: list[client.Place | None] | None = None
        #: When every path is under one mount: that mount and each index's path in it.
        self._single: tuple[client.Target, list[str]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        # Also through a BatchSampler, to the DistributedSampler inside it.
        target = _epoch_target(self.sampler)
        if target is not None:
            target.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        # A generator, so nothing happens until the first item is asked for: a
        # DataLoader makes an iterator of its batch sampler and drops it before it forks
        # its workers and makes the one it uses; like the wrapped sampler's, ours must
        # draw nothing then. Then one full iteration of the wrapped sampler, so its RNG
        # is consumed exactly as without us, and the same items, in the same order.
        items = list(iter(self.sampler))
        epoch = self.epoch if self.epoch is not None else self.iterations
        self.iterations += 1
        # The next order announced last epoch must reach the daemon before this order.
        client.wait_sent()
        predictable = epoch < MAX_EPOCH and self._predictable()
        if self._hint(items, epoch, next_follows=predictable) and predictable:
            upcoming = self._predict(items)
            if upcoming is not None:
                client.send_later(functools.partial(self._hint, upcoming, epoch + 1,
                                                    next_epoch=True))
        yield from items

    def _predictable(self) -> bool:
        """The next epoch's order follows from the epoch alone: a sampler with
        set_epoch, once set_epoch was called on us; a SequentialSampler (the same order
        every epoch). Not a RandomSampler: its next order depends on the random draws
        the DataLoader makes meanwhile."""
        sampler = self.sampler
        if _epoch_target(sampler) is not None:
            return self.epoch is not None  # else which epoch comes next is unknown
        return isinstance(sampler, SequentialSampler | range) or (
            isinstance(sampler, BatchSampler) and isinstance(sampler.sampler, SequentialSampler))

    def _predict(self, items: list[Any]) -> list[Any] | None:
        """What a `_predictable` sampler will yield next epoch (None if that fails).
        Computed on a copy, with the global generators given back what it drew, so
        training sees no difference."""
        sampler = self.sampler
        target = _epoch_target(sampler)
        if target is None:
            return items  # the same order every epoch
        assert self.epoch is not None
        try:
            with _global_generators_kept():
                twin = _detached(sampler)
                if target is not sampler:  # the one inside a BatchSampler
                    twin.sampler = _detached(target)
                    target = twin.sampler
                else:
                    target = twin
                target.set_epoch(self.epoch + 1)
                return list(iter(twin))
        except Exception as exc:
            client.warn_once(f"cannot predict the next epoch's order: "
                             f"{type(exc).__name__}: {exc}")
            return None

    def _hint(self, items: list[Any], epoch: int, *, next_epoch: bool = False,
              next_follows: bool = False) -> bool:
        """Send `items` as the order of `epoch`; True if every mount accepted it."""
        try:
            groups = self._groups(items)
            rank, world_size = _rank_and_world(self.sampler)
            return client.send_groups(groups, epoch=epoch, job=self.job, rank=rank,
                                      world_size=world_size, next_epoch=next_epoch,
                                      next_follows=next_follows)
        except Exception as exc:
            # Hints are advice: the training loop must never see them fail.
            client.warn_once(f"{type(exc).__name__}: {exc}")
            return False

    def _groups(self, items: list[Any]) -> dict[client.Target, list[str]]:
        if self._places is None:
            # Datasets do not move between epochs: resolve the paths once.
            places = client.resolve(self.paths)
            found = [place for place in places if place is not None]
            targets = {target for target, _ in found}
            if len(targets) == 1 and len(found) == len(places):
                self._single = (next(iter(targets)), [relative for _, relative in found])
            self._places = places
            if self.job not in _ending and found:
                _ending.add(self.job)
                atexit.register(_end_at_exit, self.job, os.getpid())
        indices = _indices(items)
        if self._single is not None:
            # A million indices: C-speed lookups, no per-item Python (the common case).
            target, relative = self._single
            return {target: list(map(relative.__getitem__, indices))}
        places = self._places
        return client.group(places[i] for i in indices)


def _dataset_paths(dataset: Any) -> list[str]:
    for name in ("samples", "imgs"):
        samples = getattr(dataset, name, None)
        if samples is not None:
            return [sample[0] for sample in samples]
    raise TypeError("HintSampler needs a dataset with .samples or .imgs (ImageFolder, "
                    "DatasetFolder), or paths=[one file path per index]")


def _indices(items: list[Any]) -> list[int]:
    """The dataset indices in `items`: ints, or lists of ints from a BatchSampler."""
    try:
        return list(map(operator.index, items))
    except TypeError:
        return [operator.index(i) for item in items for i in _batch(item)]


def _batch(item: Any) -> Any:
    try:
        return (operator.index(item),)
    except TypeError:
        return item


def _epoch_target(sampler: Any) -> Any:
    """The sampler whose set_epoch decides the order: this one, or the one inside a
    BatchSampler; None if neither has set_epoch."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(candidate, "set_epoch"):
            return candidate
    return None


def _detached(sampler: Any) -> Any:
    """A shallow copy whose generators are copies too, so iterating it draws nothing
    from the original's (a sampler that keeps its own generator)."""
    twin = copy.copy(sampler)
    for name, value in list(getattr(twin, "__dict__", {}).items()):
        if isinstance(value, torch.Generator):
            clone = torch.Generator(device=value.device)
            clone.set_state(value.get_state())
            setattr(twin, name, clone)
        elif isinstance(value, random.Random):
            setattr(twin, name, copy.copy(value))
    return twin


@contextlib.contextmanager
def _global_generators_kept() -> Iterator[None]:
    """torch's, `random`'s and numpy's global generators are as they were afterwards.
    Main thread only: another thread drawing meanwhile would have its draws undone."""
    numpy = sys.modules.get("numpy")
    saved = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(saved[0])
        if numpy is not None:
            numpy.random.set_state(saved[1])


def _rank_and_world(sampler: Any) -> tuple[int, int]:
    """From the wrapped DistributedSampler (also inside a BatchSampler), else from
    torch.distributed, else a single process."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(candidate, "rank") and hasattr(candidate, "num_replicas"):
            return int(candidate.rank), int(candidate.num_replicas)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _end_at_exit(job: str, pid: int) -> None:
    # Forked children (DataLoader workers) inherit atexit handlers: only the process
    # that sent the orders ends the job.
    if os.getpid() == pid:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nobody is left to read a warning now
            client.end_job(job, timeout=2.0)
