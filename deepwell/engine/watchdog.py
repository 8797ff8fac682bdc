"""StallWatchdog: the step loop's proof that every unfinished request is on a list it looks at,
and the end of a request that has gone too long without being scheduled.

The invariant: a request in the engine's table is compiling its grammar (a named future),
waiting (its store read is a named future, or it is next in line) or running; and every
request the scheduler holds is in the table, so `has_unfinished()` sees it. Checked each step
by counting (O(1)); only a broken count pays for finding which request is astray. The
timeout reads each running request's clock once a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

from deepwell.engine.request import Request, RequestStatus
from deepwell.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stranded:
    """A request the step loop would never finish by itself, and why."""

    request: Request
    reason: str


class StallWatchdog:
    """`timeout_s` 0: the invariant is still checked, but no running request is timed out."""

    def __init__(
        self,
        timeout_s: float,
        requests: dict[str, Request],
        scheduler: Scheduler,
        compiling: dict[str, object],
    ) -> None:
        self.timeout_s = timeout_s
        self._requests = requests
        self._scheduler = scheduler
        self._compiling = compiling

    def check(self, now: float) -> list[Stranded]:
        """The requests to fail now: those astray from the loop's lists, and running ones
        not scheduled for `timeout_s`."""
        stranded = self._astray()
        if self.timeout_s:
            # One pass over the running requests: a step already costs that much.
            stranded += self._stuck(now)
        for entry in stranded:
            logger.error(
                "watchdog: request %s %s (status %s, %d tokens computed of %d, %d pending, "
                "%d KV blocks); ending it with an error",
                entry.request.request_id,
                entry.reason,
                entry.request.status.value,
                entry.request.num_computed_tokens,
                entry.request.num_tokens,
                entry.request.num_pending_tokens,
                len(entry.request.block_ids),
            )
        return stranded

    def _astray(self) -> list[Stranded]:
        scheduler = self._scheduler
        held = len(scheduler.running) + len(scheduler.waiting) + len(self._compiling)
        if held == len(self._requests):
            return []
        # The count broke: find which side holds a request the other does not.
        listed = {id(r) for r in chain(scheduler.running, scheduler.waiting)}
        listed |= {id(self._requests[i]) for i in self._compiling if i in self._requests}
        table = {id(r) for r in self._requests.values()}
        astray = [
            Stranded(r, "is scheduled but missing from the engine's table")
            for r in chain(scheduler.running, scheduler.waiting)
            if id(r) not in table
        ]
        astray += [
            Stranded(r, "is in the engine's table but on no list the step loop looks at")
            for r in self._requests.values()
            if id(r) not in listed
        ]
        return astray

    def _stuck(self, now: float) -> list[Stranded]:
        limit = now - self.timeout_s
        return [
            Stranded(r, f"was not scheduled for {now - r.last_scheduled:.0f} s")
            for r in self._scheduler.running
            if r.status is RequestStatus.RUNNING and r.last_scheduled < limit
        ]
