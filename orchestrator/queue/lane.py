"""The creation lane: a host's sandbox creations for rollouts, a few at once, first come
first served, except that the rollouts of one group are seated together.

A group is the rollouts of one dataset item (a GRPO group: the trainer samples it n times
and can use none of the n until all are done). A burst of 256 rollouts from 32 items
arrives interleaved; seated strictly in arrival order, every group would have a member
near the end of the queue, and no group would be complete before the whole burst is
seated. Here a member goes ahead of the other groups' members queued since its group's
first arrived, next to its group's members already queued. A group keeps that place for
:data:`GROUP_WINDOW_S` from its first member: a trainer sends a group within a second,
and a stream of one item's rollouts must not hold everyone else back for longer.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.observability.logging import get_logger

log = get_logger(__name__)

GROUP_WINDOW_S = 10.0
"""How long after a group's first member its later ones still go ahead of others."""


@dataclass(order=True)
class _Job:
    rank: tuple[int, int]
    run: Callable[[], None] = field(compare=False)
    dropped: Callable[[], None] = field(compare=False)


class GroupedLane:
    """At most ``workers`` jobs run at once, in the order described in the module's
    docstring. ``close`` drops the jobs not started (each one's ``dropped`` is called)."""

    def __init__(self, workers: int, name: str, *, group_window_s: float = GROUP_WINDOW_S) -> None:
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        # group -> (its first member's place, when it came); oldest first.
        self._groups: dict[str, tuple[int, float]] = {}
        self._window_s = group_window_s
        self._closed = False
        for index in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True).start()

    def submit(
        self, run: Callable[[], None], group: str | None, dropped: Callable[[], None]
    ) -> None:
        """Queue ``run``; ``dropped`` is called instead if the lane closes before it starts."""
        with self._cond:
            if self._closed:
                dropped()
                return
            heapq.heappush(self._queue, _Job(self._rank(group), run, dropped))
            self._cond.notify()

    def waiting(self) -> int:
        """Jobs queued and not started."""
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._queue = self._queue, []
            self._cond.notify_all()
        for job in jobs:
            job.dropped()

    def _rank(self, group: str | None) -> tuple[int, int]:
        seq = next(self._seq)
        now = time.monotonic()
        while self._groups:  # forget groups past their window, oldest first
            oldest = next(iter(self._groups))
            if now - self._groups[oldest][1] <= self._window_s:
                break
            del self._groups[oldest]
        if group is None:
            return (seq, seq)
        first = self._groups.get(group)
        if first is None:
            first = self._groups[group] = (seq, now)
        return (first[0], seq)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                job = heapq.heappop(self._queue)
            try:
                job.run()
            except Exception:  # a job's own failure must not take the lane's thread
                log.exception("lane.job_crashed")
