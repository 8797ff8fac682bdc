"""The suite's file order on pytest-xdist workers (costliest first, `suite_order.py`), and
`--record-file-costs`, which rewrites that cost table from a run's own durations."""

from __future__ import annotations

from collections import defaultdict

import pytest
from suite_order import COSTS, file_of, load_costs, rank_files, write_costs


def pytest_addoption(parser):
    parser.addoption(
        "--record-file-costs",
        action="store_true",
        help=f"write each test file's seconds (setup, call and teardown) to tests/{COSTS.name}",
    )


class FileCostRecorder:
    """Sums each file's reported durations; under xdist the controller sees every report."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session):
        write_costs(self.seconds)


def pytest_configure(config):
    is_worker = hasattr(config, "workerinput")
    if config.getoption("record_file_costs") and not is_worker:
        config.pluginmanager.register(FileCostRecorder(), "file-cost-recorder")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # xdist deals out its workers' collection; a plain run keeps the folder order.
    if not hasattr(config, "workerinput"):
        return
    files = rank_files((item.nodeid for item in items), load_costs())
    rank = {file: index for index, file in enumerate(files)}
    items.sort(key=lambda item: rank[file_of(item.nodeid)])
