"""The order in which `make test` deals test files to its workers: the costliest first.

xdist's `--dist loadfile` gives whole files to whichever worker runs low, in collection order
when `--no-loadscope-reorder` is set (its default sorts files by test count, which put the
serve files, a few long tests each, last, where one worker finished them alone). Dealt
longest first, the workers end within about one short file of each other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

COSTS = Path(__file__).with_name("file_costs.json")
# A file the table does not know yet (a new one) is costed per test at about what the
# unlisted files take on a quiet 2-core machine (most under a tenth of a second a test).
SECONDS_PER_UNKNOWN_TEST = 0.1


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_costs(path: Path = COSTS) -> dict[str, float]:
    return json.loads(path.read_text())


def rank_files(nodeids: Iterable[str], costs: dict[str, float]) -> list[str]:
    """The files of `nodeids`, costliest first; ties keep their collection order."""
    tests_per_file: dict[str, int] = {}
    for nodeid in nodeids:
        file = file_of(nodeid)
        tests_per_file[file] = tests_per_file.get(file, 0) + 1

    def cost(file: str) -> float:
        return costs.get(file, SECONDS_PER_UNKNOWN_TEST * tests_per_file[file])

    return sorted(tests_per_file, key=cost, reverse=True)


def write_costs(seconds_per_file: dict[str, float], path: Path = COSTS) -> None:
    """Merge a run's seconds per file into the table, costliest first; files gone are dropped."""
    root = path.parent.parent
    table = load_costs(path) if path.exists() else {}
    table.update({file: round(seconds, 1) for file, seconds in seconds_per_file.items()})
    kept = {file: seconds for file, seconds in table.items() if (root / file).exists()}
    ranked = dict(sorted(kept.items(), key=lambda entry: (-entry[1], entry[0])))
    path.write_text(json.dumps(ranked, indent=1) + "\n")
