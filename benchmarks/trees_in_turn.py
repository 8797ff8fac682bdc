"""Two trees' deepwell measured in turn: each measurement a fresh process of the calling
script with `--measure` (and its own arguments), importing one tree's package; the trees'
order alternates round by round, and each part's median over the rounds is kept."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_tree(script: str, tree: Path, arguments: list[str]) -> dict[str, float]:
    """`script --measure *arguments` in a fresh process importing `tree`'s deepwell: the JSON
    object it prints last."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, script, "--measure", *arguments]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def medians_in_turn(
    script: str, baseline: Path, rounds: int, parts: tuple[str, ...], arguments: list[str]
) -> dict[str, dict[str, float]]:
    """{"baseline": ..., "this": ...}: each part's median over `rounds` of `run_tree`, for
    the baseline tree and the tree holding `script`."""
    trees = {"baseline": baseline.resolve(), "this": Path(script).resolve().parents[1]}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_index in range(rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in order:
            results[name].append(run_tree(script, trees[name], arguments))
    return {
        name: {p: statistics.median(r[p] for r in runs) for p in parts}
        for name, runs in results.items()
    }
