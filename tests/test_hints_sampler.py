"""HintSampler: training sees exactly what the wrapped sampler yields, and the daemon
(a real hints server on a real socket) receives each epoch's order as file paths, and
the next epoch's where the sampler makes it certain.

The "mount" is a directory the injected mount table calls a bucketfs mount.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torchvision.datasets import DatasetFolder

from bucketfs.hints import HintSampler, HintWarning, client, location
from bucketfs.hints.location import FSTYPE, Mount
from bucketfs.hints.protocol import Order
from tests.test_hints_server import Daemon, daemon_thread

N = 60
EPOCHS = 3


def read_name(path: str) -> str:
    return Path(path).name


@pytest.fixture
def mount(monkeypatch) -> Iterator[Path]:
    """A directory with a small DatasetFolder, listed as a bucketfs mount."""
    top = Path(tempfile.mkdtemp(prefix="bfh-"))
    root = top / "mnt"
    for i in range(N):
        (root / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"class{i % 3}" / f"{i:03d}.bin").write_bytes(b"x")
    mounts = [Mount("/", "ext4"), Mount(str(root), FSTYPE, "file:///data", "0:99",
                                        "rw,user_id=0,group_id=0")]
    monkeypatch.setattr(location, "read_mounts", lambda: mounts)
    monkeypatch.setattr(client, "_warned", set())
    yield root
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def daemon(mount, monkeypatch) -> Iterator[Daemon]:
    sock = mount.parent / "state" / "hints.sock"
    monkeypatch.setenv(location.SOCKET_ENV, str(sock))
    with daemon_thread(sock) as running:
        yield running
        client.wait_sent()  # a next order still being sent reaches this daemon


@pytest.fixture
def dataset(mount) -> DatasetFolder:
    return DatasetFolder(str(mount), loader=read_name, extensions=(".bin",))


def relative(dataset: DatasetFolder, indices: list[int], root: Path) -> list[str]:
    return [str(Path(dataset.samples[i][0]).relative_to(root)) for i in indices]


def current(daemon: Daemon) -> list[Order]:
    """The orders of epochs as they start, without the next epochs announced."""
    return [order for order in daemon.orders if not order.next_epoch]


def announced(daemon: Daemon) -> list[Order]:
    client.wait_sent()
    return [order for order in daemon.orders if order.next_epoch]


def test_random_sampler_yields_identically_and_each_epoch_is_hinted(dataset, daemon, mount):
    plain = RandomSampler(dataset, generator=torch.Generator().manual_seed(7))
    hinted = HintSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(7)),
                         dataset)
    assert len(hinted) == len(plain) == N
    for epoch in range(EPOCHS):
        expected = list(plain)
        assert list(hinted) == expected
        order = daemon.orders[epoch]
        assert (order.job, order.rank, order.world_size, order.epoch) == (
            hinted.job, 0, 1, epoch)
        assert order.paths == relative(dataset, expected, mount)
    assert len({tuple(o.paths) for o in daemon.orders}) == EPOCHS


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_sampler_with_set_epoch(dataset, daemon, mount, rank):
    plain = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
    hinted = HintSampler(DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True,
                                            seed=3), dataset)
    for epoch in (5, 6, 7):
        plain.set_epoch(epoch)
        hinted.set_epoch(epoch)
        expected = list(plain)
        assert list(hinted) == expected and len(expected) == N // 2
        order = current(daemon)[-1]
        assert (order.rank, order.world_size, order.epoch) == (rank, 2, epoch)
        assert order.paths == relative(dataset, expected, mount)


def test_batch_sampler_items_are_lists_and_hinted_flat(dataset, daemon, mount):
    def batches(seed: int) -> BatchSampler:
        return BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)),
                            batch_size=8, drop_last=False)

    plain, hinted = batches(1), HintSampler(batches(1), dataset)
    assert len(hinted) == len(plain) == 8
    for epoch in range(EPOCHS):
        expected = list(plain)
        assert list(hinted) == expected
        flat = [i for batch in expected for i in batch]
        assert daemon.orders[epoch].paths == relative(dataset, flat, mount)


def test_set_epoch_reaches_a_distributed_sampler_inside_a_batch_sampler(dataset, daemon):
    inner = DistributedSampler(dataset, num_replicas=2, rank=1, seed=0)
    hinted = HintSampler(BatchSampler(inner, batch_size=4, drop_last=True), dataset)
    hinted.set_epoch(9)
    list(hinted)
    assert inner.epoch == 9
    assert (daemon.orders[0].rank, daemon.orders[0].world_size, daemon.orders[0].epoch) == (
        1, 2, 9)
    assert not daemon.orders[0].next_epoch


def test_dataloader_with_persistent_workers_sees_the_same_batches(dataset, daemon, mount):
    def loader(sampler) -> DataLoader:
        return DataLoader(dataset, batch_size=5, sampler=sampler, num_workers=2,
                          persistent_workers=True)

    torch.manual_seed(0)
    plain = loader(RandomSampler(dataset, generator=torch.Generator().manual_seed(11)))
    expected = [[list(names) for names, _ in plain] for _ in range(EPOCHS)]
    torch.manual_seed(0)
    hinted = loader(HintSampler(RandomSampler(dataset,
                                              generator=torch.Generator().manual_seed(11)),
                                dataset))
    for epoch in range(EPOCHS):
        got = []
        for names, _ in hinted:
            # The order was acknowledged before the first batch was asked for.
            assert len(daemon.orders) == epoch + 1
            got.append(list(names))
        assert got == expected[epoch]
        hinted_names = [Path(p).name for p in daemon.orders[epoch].paths]
        assert hinted_names == [name for batch in got for name in batch]


def test_paths_argument_and_end_job(daemon, mount):
    files = sorted(str(p) for p in mount.rglob("*.bin"))
    hinted = HintSampler(list(range(len(files)))[::-1], paths=files, job="my-job")
    assert list(hinted) == list(range(len(files)))[::-1]
    assert daemon.orders[0].job == "my-job"
    assert daemon.orders[0].paths[0] == str(Path(files[-1]).relative_to(mount))
    assert client.end_job("my-job") and daemon.ends == ["my-job"]


def test_without_a_mount_it_warns_once_and_yields_normally(monkeypatch, tmp_path):
    monkeypatch.setattr(location, "read_mounts", lambda: [Mount("/", "ext4")])
    monkeypatch.setattr(client, "_warned", set())
    files = [str(tmp_path / f"{i}.jpg") for i in range(10)]
    plain = RandomSampler(files, generator=torch.Generator().manual_seed(2))
    hinted = HintSampler(RandomSampler(files, generator=torch.Generator().manual_seed(2)),
                         paths=files)
    with pytest.warns(HintWarning, match="no path is under a bucketfs mount") as caught:
        for _ in range(EPOCHS):
            assert list(hinted) == list(plain)
    assert len(caught) == 1


def test_an_unreachable_daemon_warns_once_and_never_raises(dataset, mount, monkeypatch):
    monkeypatch.setenv(location.SOCKET_ENV, str(mount.parent / "nobody-listens.sock"))
    hinted = HintSampler(RandomSampler(dataset), dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(EPOCHS):
            assert sorted(hinted) == list(range(N))
    assert [str(w.message) for w in caught] == [
        f"bucketfs hints: no hints socket for {mount} (looked at "
        f"{mount.parent / 'nobody-listens.sock'})"]


def test_bad_indices_warn_instead_of_breaking_training(daemon, mount):
    hinted = HintSampler([0, 1, 99], paths=[str(mount / "class0" / "000.bin")] * 2)
    with pytest.warns(HintWarning, match="IndexError"):
        assert list(hinted) == [0, 1, 99]


def test_a_dataset_without_paths_is_a_clear_error():
    with pytest.raises(TypeError, match=r"\.samples or \.imgs"):
        HintSampler(range(3), object())


# --- The next epoch's order ----------------------------------------------------------------


def messages(daemon: Daemon) -> list[tuple[int, bool]]:
    client.wait_sent()
    return [(order.epoch, order.next_epoch) for order in daemon.orders]


@pytest.mark.parametrize("batched", [False, True])
def test_the_next_epoch_of_a_distributed_sampler_is_announced(dataset, daemon, mount,
                                                              batched):
    def make() -> Sampler:
        inner = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
        return BatchSampler(inner, batch_size=4, drop_last=False) if batched else inner

    def set_epoch(sampler, epoch: int) -> None:
        (sampler.sampler if batched else sampler).set_epoch(epoch)

    def flat(items: list) -> list[int]:
        return [i for batch in items for i in batch] if batched else items

    plain, hinted, oracle = make(), HintSampler(make(), dataset), make()
    for epoch in (2, 3, 4):
        set_epoch(plain, epoch)
        hinted.set_epoch(epoch)
        expected = list(plain)
        assert list(hinted) == expected
        # The prediction ran on a copy: the wrapped sampler is still at this epoch.
        assert (hinted.sampler.sampler if batched else hinted.sampler).epoch == epoch
        set_epoch(oracle, epoch + 1)
        upcoming = announced(daemon)[-1]
        assert (upcoming.job, upcoming.rank, upcoming.world_size, upcoming.epoch) == (
            hinted.job, 1, 2, epoch + 1)
        assert upcoming.paths == relative(dataset, flat(list(oracle)), mount)
        assert current(daemon)[-1].paths == relative(dataset, flat(expected), mount)
    # Each epoch's own order first, saying the next one's follows, never overtaken.
    assert messages(daemon) == [(2, False), (3, True), (3, False), (4, True), (4, False),
                                (5, True)]
    assert all(order.next_follows for order in current(daemon))


def test_a_sequential_sampler_announces_the_same_order(dataset, daemon, mount):
    for sampler in (SequentialSampler(dataset),
                    BatchSampler(SequentialSampler(dataset), batch_size=7, drop_last=False)):
        hinted = HintSampler(sampler, dataset)
        for _ in range(2):
            assert list(hinted) == list(sampler)
    assert messages(daemon) == [(0, False), (1, True), (1, False), (2, True)] * 2
    every = relative(dataset, list(range(N)), mount)
    assert all(order.paths == every for order in daemon.orders)


def test_no_next_epoch_where_the_sampler_does_not_make_it_certain(dataset, daemon):
    samplers = [
        RandomSampler(dataset, generator=torch.Generator().manual_seed(1)),
        BatchSampler(RandomSampler(dataset), batch_size=4, drop_last=False),
        # set_epoch never called: the epoch it will read next is not known
        DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True),
        list(range(N)),  # a list may be reshuffled in place between epochs
    ]
    for sampler in samplers:
        hinted = HintSampler(sampler, dataset)
        for _ in range(2):
            list(hinted)
    assert len(current(daemon)) == 2 * len(samplers) and announced(daemon) == []
    assert not any(order.next_follows for order in daemon.orders)


class DrawsEverywhere(Sampler[int]):
    """Has set_epoch, yet draws from the global generators and its own: its next order
    is predicted wrong, but predicting it must change nothing training sees."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0
        self.generator = torch.Generator().manual_seed(1)
        self.rng = random.Random(2)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        shift = (int(torch.randint(self.n, ())) + random.randrange(self.n) + self.epoch
                 + int(numpy.random.randint(self.n)) + self.rng.randrange(self.n)) % self.n
        return iter(order[shift:] + order[:shift])


def test_predicting_draws_nothing_from_any_generator(dataset, daemon):
    def run(sampler) -> list:
        torch.manual_seed(3)
        random.seed(3)
        numpy.random.seed(3)
        seen = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            seen.append(list(sampler))
            # what training draws next, from each global generator
            seen.append((torch.rand(()).item(), random.random(), numpy.random.rand()))
        return seen

    plain = run(DrawsEverywhere(N))
    hinted = HintSampler(DrawsEverywhere(N), dataset)
    assert run(hinted) == plain
    assert [order.epoch for order in announced(daemon)] == [1, 2, 3], "it did predict"


def test_a_prediction_that_fails_warns_once_and_changes_nothing(dataset, daemon):
    class Fragile(DistributedSampler):
        def set_epoch(self, epoch: int) -> None:
            if epoch > 1:
                raise RuntimeError("no such epoch")
            super().set_epoch(epoch)

    def make() -> Fragile:
        return Fragile(dataset, num_replicas=1, rank=0, seed=6)

    plain, hinted = make(), HintSampler(make(), dataset)
    with pytest.warns(HintWarning, match="cannot predict the next epoch's order: "
                                          "RuntimeError: no such epoch") as caught:
        for _ in range(3):
            plain.set_epoch(1)
            hinted.set_epoch(1)
            assert list(hinted) == list(plain)
    assert len(caught) == 1
    assert len(current(daemon)) == 3 and announced(daemon) == []


def test_as_a_dataloaders_batch_sampler_with_workers_it_yields_identically(dataset, daemon):
    """A DataLoader with workers makes an iterator of its batch sampler, drops it, forks
    and makes another: the dropped one must draw nothing and send nothing."""
    def loader(batches) -> DataLoader:
        return DataLoader(dataset, batch_sampler=batches, num_workers=2)

    def batches(seed: int) -> BatchSampler:
        return BatchSampler(DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed),
                            batch_size=5, drop_last=False)

    for make in (batches, lambda seed: BatchSampler(
            RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)),
            batch_size=5, drop_last=False)):
        plain, hinted = make(4), HintSampler(make(4), dataset)
        for epoch in range(2):
            if isinstance(plain.sampler, DistributedSampler):
                plain.sampler.set_epoch(epoch)
            hinted.set_epoch(epoch)
            expected = [list(names) for names, _ in loader(plain)]
            assert [list(names) for names, _ in loader(hinted)] == expected
            assert [Path(path).name for path in current(daemon)[-1].paths] == [
                name for batch in expected for name in batch]
    # one order per epoch each; the next epoch announced for the DistributedSampler only
    assert messages(daemon) == [(0, False), (1, True), (1, False), (2, True),
                                (0, False), (1, False)]
