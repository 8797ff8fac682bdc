"""Offline generation over data-parallel ranks: start this machine's ranks as processes,
deal the prompts round robin, gather the completions in input order, and watch the ranks
so that one that dies stops the group with an error instead of a hang."""

from __future__ import annotations

import dataclasses
import queue
import time
from dataclasses import dataclass

import torch.distributed as dist
import torch.multiprocessing as mp

from deepwell.engine.args import EngineArgs
from deepwell.engine.outputs import Completion
from deepwell.engine.parallel.group import ParallelConfig, ParallelError
from deepwell.engine.sampling_params import SamplingParams

# How often the launcher looks for a dead rank while it waits for results.
WATCH_INTERVAL_S = 0.1


@dataclass(frozen=True)
class RankOutcome:
    """A rank → the launcher: its completions by prompt index, or why it failed."""

    rank: int
    completions: dict[int, Completion]
    error: str | None = None


def generate_data_parallel(
    args: EngineArgs, prompts: list[list[int]], params: list[SamplingParams]
) -> list[Completion]:
    """Completions of `prompts` (token ids) computed by `args.parallel`'s ranks on this
    machine, prompt i on rank i mod N. With expert parallelism over several machines each
    machine runs this; global rank 0's machine gets every completion, the others none."""
    config = args.parallel
    if config.nnodes > 1 and not config.expert_parallel:
        raise ValueError(
            "data-parallel ranks without expert parallelism share nothing: run one "
            "`deepwell generate` (or `serve --workers`) per machine instead of --nnodes"
        )
    context = mp.get_context("spawn")
    outcomes = context.Queue()
    processes = {
        rank: context.Process(
            target=_run_rank,
            args=(
                dataclasses.replace(args, parallel=config.for_rank(rank)),
                prompts,
                params,
                outcomes,
            ),
            name=f"deepwell-rank-{rank}",
            daemon=True,
        )
        for rank in config.local_ranks()
    }
    for process in processes.values():
        process.start()
    try:
        completions = _gather(processes, outcomes)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join()
    return [completions[i] for i in sorted(completions)]


def _gather(processes: dict[int, mp.Process], outcomes) -> dict[int, Completion]:
    completions: dict[int, Completion] = {}
    waiting = set(processes)
    while waiting:
        try:
            outcome: RankOutcome = outcomes.get(timeout=WATCH_INTERVAL_S)
        except queue.Empty:
            for rank in sorted(waiting):
                code = processes[rank].exitcode
                if code is not None:
                    # Its outcome may still be in the pipe: one last look before failing.
                    time.sleep(WATCH_INTERVAL_S)
                    if outcomes.empty():
                        raise ParallelError(
                            f"rank {rank} exited with code {code} before reporting; the "
                            "group is stopped"
                        ) from None
            continue
        if outcome.error is not None:
            raise ParallelError(f"rank {outcome.rank} failed: {outcome.error}")
        completions.update(outcome.completions)
        waiting.discard(outcome.rank)
    return completions


def _run_rank(
    args: EngineArgs, prompts: list[list[int]], params: list[SamplingParams], outcomes
) -> None:
    """A rank's process: its own engine over its share of the prompts."""
    from deepwell.engine.llm import LLM

    config: ParallelConfig = args.parallel
    try:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        llm = LLM(**fields)
        mine = list(range(config.rank, len(prompts), config.world_size))
        done = llm.generate(
            prompt_token_ids=[prompts[i] for i in mine],
            sampling_params=[params[i] for i in mine],
            use_tqdm=False,
        )
        completions = {
            i: dataclasses.replace(c, request_id=str(i)) for i, c in zip(mine, done, strict=True)
        }
        if llm.core.group is not None and config.nnodes > 1:
            everyone: list[dict[int, Completion] | None] = [None] * config.world_size
            dist.all_gather_object(everyone, completions)
            completions = (
                {} if config.rank else {i: c for part in everyone for i, c in part.items()}
            )
        llm.core.close()
        outcomes.put(RankOutcome(config.rank, completions))
    except Exception as error:  # the launcher must learn why its rank stopped
        outcomes.put(RankOutcome(config.rank, {}, f"{type(error).__name__}: {error}"))
