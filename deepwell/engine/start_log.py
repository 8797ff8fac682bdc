"""What a start is doing and how long each phase took, in log lines: `phase` names one step
(reading weights, building the model, the KV pool) and its time, `progress` reports a long
loop every few seconds, as log lines rather than a terminal bar so JSON logs stay lines."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

logger = logging.getLogger("deepwell.engine.start")

# A loop shorter than this says nothing on its way; a longer one reports this often.
PROGRESS_INTERVAL_S = 2.0

Item = TypeVar("Item")


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Log `what` as it starts and its duration when it ends."""
    logger.info("%s ...", what)
    started = time.monotonic()
    yield
    logger.info("%s: done in %.1f s", what, time.monotonic() - started)


def progress(items: Iterable[Item], what: str, total: int) -> Iterator[Item]:
    """`items`, logging `what: done/total (percent)` every PROGRESS_INTERVAL_S seconds."""
    next_report = time.monotonic() + PROGRESS_INTERVAL_S
    for done, item in enumerate(items):
        now = time.monotonic()
        if now >= next_report:
            logger.info("%s: %d/%d (%.0f%%)", what, done, total, 100 * done / max(total, 1))
            next_report = now + PROGRESS_INTERVAL_S
        yield item
