"""What a run is made of: the dataset of a scenario and the link to the origin."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024**2


@dataclass(frozen=True)
class Scenario:
    name: str
    classes: int
    per_class: int
    mean_kb: float
    large_files: int
    large_mib: int
    seed: int = 1

    @property
    def images(self) -> int:
        return self.classes * self.per_class


@dataclass(frozen=True)
class Link:
    """A path to the origin: one-way delay (added by the proxy) and bandwidth (tc htb)."""

    name: str
    rtt_ms: float
    mbit: int

    @property
    def one_way_delay_ms(self) -> float:
        return self.rtt_ms / 2

    def transfer_seconds(self, nbytes: int) -> float:
        """The least time the link needs to carry nbytes (payload only)."""
        return nbytes * 8 / (self.mbit * 1e6)


SCENARIOS = {
    s.name: s
    for s in (
        # A smoke run: a couple of minutes for every contender.
        Scenario("tiny", classes=4, per_class=50, mean_kb=110, large_files=1, large_mib=32),
        # ImageNet-like sizes (lognormal around 110 KB), a few thousand files; sized so
        # that every contender, 3 repeats, fits in about 40 minutes on a 2-core machine.
        Scenario("imagenet-small", classes=20, per_class=100, mean_kb=110, large_files=2,
                 large_mib=128),
    )
}

LINKS = {
    link.name: link
    for link in (
        Link("near", rtt_ms=2, mbit=1000),  # a bucket in the same region
        Link("far", rtt_ms=30, mbit=200),  # a bucket a continent away
        # 20 ms away on a thin pipe: slow enough that a 2-core machine decodes the
        # images as fast as they arrive, so the link, not the CPU, bounds an epoch.
        Link("slow", rtt_ms=20, mbit=50),
    )
}
