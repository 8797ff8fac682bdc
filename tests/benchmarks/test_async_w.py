"""benchmarks/async_w.py: the voluntary context switches it counts per step."""

import time

from async_w import voluntary_switches


def test_a_sleep_counts_as_a_voluntary_switch():
    before = voluntary_switches()
    time.sleep(0.01)
    assert voluntary_switches() > before
