"""How many GETs hinted prefetch keeps in flight: the fewest that carry about as many
bytes per second as more would (DLCache: enough fetches in flight that their requests
cover the reader; on a full link every GET too many splits the bandwidth, so the file a
reader needs next arrives later). Judged on the link's whole throughput, from fetch
durations passed in with their timestamps. Pure and deterministic: no clocks, no I/O.
"""

from __future__ import annotations

import math


class AdaptiveConcurrency:
    """How many GETs to keep in flight: the fewest that carry about as many bytes per
    second as more would.

    Why the fewest: on a link that is already full, one more GET does not add
    throughput, it splits the bandwidth further, so every file, the one a reader needs
    next included, arrives later. (Measured on a 50 Mbit/s link: with a rule that
    climbed to 24 GETs a GPU-bound loop waited 16% of its cold epoch; with 4 GETs, 7%.)

    Time is cut into periods of `period_s` (timestamps are passed in). A period counts
    when the fetches kept the GETs busy (mean GETs in flight, the sum of fetch durations
    over the period, at least `saturation` * target); one where they were not says
    nothing about the link (the readers did not need more) and changes nothing.
    - Holding a level, its throughput is the mean of its latest counted periods. Every
      `probe_every` counted periods it tries another level for `trial_periods` counted
      periods, alternately one step up (x `step`, at least +1) and one step down.
    - A step up stays if the throughput grew by at least `min_gain`, and then it climbs
      again at once; otherwise it goes back. A fresh controller starts by climbing, one
      period per step, until a step does not pay: it can start low and still reach a
      long link's level within seconds.
    - A step down stays if the throughput fell by less than `min_gain` (the link was
      full with fewer), and then it descends again at once; otherwise it goes back.
      The asymmetry is deliberate: noise alone rarely passes a step up and usually
      passes a step down, so noise drifts the level down to the knee, not up.
    - A period with a failed fetch halves the target (at least `minimum`): errors and
      throttling (S3 SlowDown) mean too many requests.

    This is DLCache's rule (workers >= t_fetch / t_req) without knowing either time: it
    settles near fetch latency x link bandwidth / object size.
    """

    def __init__(self, *, minimum: int = 2, maximum: int = 64, initial: int | None = None,
                 period_s: float = 1.0, min_gain: float = 0.05, step: float = 1.5,
                 probe_every: int = 10, trial_periods: int = 2,
                 saturation: float = 0.75) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        if period_s <= 0 or min_gain < 0 or step <= 1 or probe_every < 1 \
                or trial_periods < 1:
            raise ValueError("need period_s > 0, min_gain >= 0, step > 1, probe_every >= 1, "
                             "trial_periods >= 1")
        self.minimum = minimum
        self.maximum = maximum
        self.period_s = period_s
        self.min_gain = min_gain
        self.step = step
        self.probe_every = probe_every
        self.trial_periods = trial_periods
        self.saturation = saturation
        self.target = min(maximum, max(minimum, initial if initial is not None else minimum))
        self._level = self.target  # the level held (a trial returns to it if it fails)
        self._held: list[float] = []  # throughputs of the latest counted periods at it
        self._counted = 0  # counted periods since it was last taken up
        self._trial: list[float] | None = None  # throughputs of the level on trial
        self._climbing = True  # the direction of the trial under way or next
        # Until the first step that does not pay: climb at once, one period per step.
        self._fresh = True
        self._period_start: float | None = None
        self._bytes = 0
        self._busy_s = 0.0
        self._errors = 0

    def record(self, started: float, finished: float, nbytes: int, *, ok: bool = True) -> int:
        """One fetch ended (successfully or not); `nbytes` came over the link since the
        last call (this fetch's, or also other GETs' sharing the link). Returns the
        current target."""
        self.update(finished)
        if ok:
            self._bytes += nbytes
        else:
            self._errors += 1
        self._busy_s += max(0.0, finished - started)
        return self.target

    def update(self, now: float) -> int:
        """Close the periods that ended by `now`. Returns the current target."""
        if self._period_start is None:
            self._period_start = now
            return self.target
        if now < self._period_start + self.period_s:
            return self.target
        self._close_period()
        self._period_start += self.period_s
        if now >= self._period_start + self.period_s:
            # Idle periods in between carry no evidence: skip to the one holding `now`.
            skipped = math.floor((now - self._period_start) / self.period_s)
            self._period_start += skipped * self.period_s
        return self.target

    def _close_period(self) -> None:
        busy = self._busy_s / self.period_s
        throughput = self._bytes / self.period_s
        errors = self._errors
        self._bytes, self._busy_s, self._errors = 0, 0.0, 0
        if errors:
            self._hold(max(self.minimum, self.target // 2), [])
            self._fresh = False
            return
        if busy < self.saturation * self.target:
            return  # demand-limited: no evidence about the link
        if self._trial is None:
            self._held = [*self._held, throughput][-self.probe_every:]
            self._counted += 1
            if self._fresh or self._counted >= self.probe_every:
                self._try(climbing=self._climbing)
            return
        self._trial.append(throughput)
        if len(self._trial) < (1 if self._fresh else self.trial_periods):
            return
        tried = sum(self._trial) / len(self._trial)
        base = sum(self._held) / len(self._held) if self._held else 0.0
        if self._climbing:
            kept = tried >= base * (1 + self.min_gain)
        else:
            kept = tried > base * (1 - self.min_gain)
        if kept:
            self._hold(self.target, self._trial)
            self._try(climbing=self._climbing)  # the same way again, at once
        else:
            self._hold(self._level, self._held)
            self._climbing = not self._climbing  # next time, the other way
            self._fresh = False

    def _hold(self, level: int, samples: list[float]) -> None:
        self.target = self._level = level
        self._held = list(samples)
        self._counted = 0
        self._trial = None

    def _try(self, *, climbing: bool) -> None:
        """Put the next level up (or down) on trial; at a bound, the other way."""
        up = min(self.maximum, max(self.target + 1, math.ceil(self.target * self.step)))
        down = max(self.minimum, min(self.target - 1, math.floor(self.target / self.step)))
        if (up if climbing else down) == self.target:
            climbing = not climbing
        level = up if climbing else down
        self._climbing = climbing
        if level == self.target:
            return  # minimum == maximum: nothing to try
        self.target, self._trial = level, []
