"""HintSampler: wraps a sampler, yields exactly what it yields, and tells the daemon
of the mount the dataset lives on in which order this epoch will read its files."""

from __future__ import annotations

import atexit
import itertools
import operator
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed
from torch.utils.data import Sampler

from bucketfs.hints import client

_samplers = itertools.count()
_ending: set[str] = set()


class HintSampler(Sampler[Any]):
    """`HintSampler(sampler, dataset)` or `HintSampler(sampler, paths=[...])`.

    `sampler` is any sampler: RandomSampler, DistributedSampler (set_epoch is
    forwarded), a BatchSampler (its items are lists of indices). Index i is the file
    `dataset.samples[i][0]` (or `dataset.imgs[i][0]`: ImageFolder, DatasetFolder), or
    `paths[i]`. Sending hints never raises: a failure is a warning, once.
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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        # Also through a BatchSampler, to the DistributedSampler inside it.
        for candidate in (self.sampler, getattr(self.sampler, "sampler", None)):
            if hasattr(candidate, "set_epoch"):
                candidate.set_epoch(epoch)
                return

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        # One full iteration of the wrapped sampler, so its RNG is consumed exactly as
        # without us; then the same items, in the same order.
        items = list(iter(self.sampler))
        epoch = self.epoch if self.epoch is not None else self.iterations
        self.iterations += 1
        self._hint(items, epoch)
        return iter(items)

    def _hint(self, items: list[Any], epoch: int) -> None:
        try:
            if self._places is None:
                # Datasets do not move between epochs: resolve the paths once.
                self._places = client.resolve(self.paths)
                if self.job not in _ending and any(self._places):
                    _ending.add(self.job)
                    atexit.register(_end_at_exit, self.job, os.getpid())
            places = self._places
            groups = client.group(places[i] for i in _indices(items))
            rank, world_size = _rank_and_world(self.sampler)
            client.send_groups(groups, epoch=epoch, job=self.job, rank=rank,
                               world_size=world_size)
        except Exception as exc:
            # Hints are advice: the training loop must never see them fail.
            client.warn_once(f"{type(exc).__name__}: {exc}")


def _dataset_paths(dataset: Any) -> list[str]:
    for name in ("samples", "imgs"):
        samples = getattr(dataset, name, None)
        if samples is not None:
            return [sample[0] for sample in samples]
    raise TypeError("HintSampler needs a dataset with .samples or .imgs (ImageFolder, "
                    "DatasetFolder), or paths=[one file path per index]")


def _indices(items: list[Any]) -> Iterator[int]:
    """The dataset indices in `items`: ints, or lists of ints from a BatchSampler."""
    for item in items:
        try:
            yield operator.index(item)
        except TypeError:
            yield from map(operator.index, item)


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
