"""docs/benchmarks.md, the current figures, points into docs/benchmarks-log.md by section:
every such link must land on a heading the log has."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def github_anchor(heading: str) -> str:
    # GitHub's slug: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def log_anchors() -> set[str]:
    lines = (DOCS / "benchmarks-log.md").read_text().splitlines()
    return {github_anchor(line.lstrip("#")) for line in lines if line.startswith("#")}


def test_the_anchor_follows_githubs_slug():
    heading = "engine: the device check (`benchmarks/gpu_check.sh`, issue 29)"
    assert github_anchor(heading) == "engine-the-device-check-benchmarksgpu_checksh-issue-29"


def test_every_link_into_the_log_names_one_of_its_sections():
    page = (DOCS / "benchmarks.md").read_text()
    links = re.findall(r"\(benchmarks-log\.md#([^)]+)\)", page)
    assert links, "docs/benchmarks.md links no section of the log"
    missing = sorted(set(links) - log_anchors())
    assert not missing, f"docs/benchmarks.md links sections the log lacks: {missing}"
