"""One model load by start-up phase, in wall and thread CPU seconds: what `make run`, every
test that builds an engine and every worker restart pays.

Builds the engine (`build_engine`: checkpoint, model, packing, KV pool) `--loads` times in this
process with one torch thread, and times each phase the start log names
(engine/start_log.py) by its own log lines. Load 1 pays the C++ kernels' loading (a warm
compile cache: run once before measuring) and first-use costs; later loads show the steady
cost. Compare trees by running it in turn from each (own processes, A B A B):

    PYTHONPATH=. .venv/bin/python benchmarks/model_load.py [--model PATH] [--dtype bfloat16]
        [--quantization int4] [--loads 2] [--json]
"""

import argparse
import json
import logging
import time

import torch

from deepwell.engine.start_log import logger as start_logger


class PhaseClock(logging.Handler):
    """Wall and thread CPU seconds of each start-log phase ("<what> ..." to "<what>: done")."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, tuple[float, float]] = {}
        self.phases: dict[str, tuple[float, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        now = (time.perf_counter(), time.thread_time())
        if message.endswith(" ..."):
            self.started[message.removesuffix(" ...")] = now
        elif ": done in " in message:
            what = message.split(": done in ")[0]
            wall, cpu = self.started.pop(what)
            self.phases[_short(what)] = (now[0] - wall, now[1] - cpu)


def _short(what: str) -> str:
    """A phase's name without the file it names (the same across models)."""
    for prefix in ("reading the checkpoint", "building", "packing", "planning"):
        if what.startswith(prefix):
            return prefix
    return "reading metadata and vocabulary" if "metadata" in what else what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--loads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON line per load")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from deepwell.engine.args import EngineArgs
    from deepwell.engine.build import build_engine

    clock = PhaseClock()
    start_logger.addHandler(clock)
    start_logger.setLevel(logging.INFO)
    engine_args = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        num_kv_blocks=64,
        max_model_len=4096,
    )
    for load in range(1, args.loads + 1):
        clock.phases.clear()
        wall, cpu = time.perf_counter(), time.thread_time()
        build_engine(engine_args)
        total = (time.perf_counter() - wall, time.thread_time() - cpu)
        phases = {"build_engine": total, **clock.phases}
        if args.json:
            print(
                json.dumps(
                    {"load": load, **{k: [round(x, 4) for x in v] for k, v in phases.items()}}
                )
            )
            continue
        print(f"load {load}:")
        for what, (wall_s, cpu_s) in phases.items():
            print(f"  {what:32s} {wall_s:6.3f} s wall {cpu_s:6.3f} s thread CPU")


if __name__ == "__main__":
    main()
