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
from deepwell.engine.build import check_expert_parallel
from deepwell.engine.outputs import Completion
from deepwell.engine.parallel.eplb import Rebalance
from deepwell.engine.parallel.group import ParallelConfig, ParallelError
from deepwell.engine.sampling_params import SamplingParams

# How often the launcher looks for a dead rank while it waits for results.
WATCH_INTERVAL_S = 0.1


@dataclass(frozen=True)
class RankStats:
    """What a rank measured: steps the group computed, seconds of model work (forward and
    sampling) and of it in all-to-alls, pairs its experts computed, EPLB's re-placements,
    bytes sent to other ranks."""

    rank: int
    steps: int = 0
    compute_s: float = 0.0
    exchange_s: float = 0.0
    computed_tokens: int = 0
    rebalances: tuple[Rebalance, ...] = ()
    # Seconds of this rank's generate call (its requests and its peers' steps).
    generate_s: float = 0.0
    # Bytes the all-to-alls sent to other ranks: tokens with their routes, outputs back.
    dispatch_bytes: int = 0
    combine_bytes: int = 0


@dataclass(frozen=True)
class RankOutcome:
    """A rank → the launcher: its completions by prompt index and stats, or why it failed."""

    rank: int
    completions: dict[int, Completion]
    stats: RankStats
    error: str | None = None


@dataclass(frozen=True)
class ParallelRun:
    """Completions in input order and each local rank's stats."""

    completions: list[Completion]
    stats: list[RankStats]


def generate_data_parallel(
    args: EngineArgs, prompts: list[list[int]], params: list[SamplingParams]
) -> ParallelRun:
    """Completions of `prompts` (token ids) computed by `args.parallel`'s ranks on this
    machine, prompt i on rank i mod N. With expert parallelism over several machines each
    machine runs this; global rank 0's machine gets every completion, the others none."""
    config = args.parallel
    if config.nnodes > 1 and not config.expert_parallel:
        raise ValueError(
            "data-parallel ranks without expert parallelism share nothing: run one "
            "`deepwell generate` (or `serve --workers`) per machine instead of --nnodes"
        )
    if config.expert_parallel:
        check_expert_parallel(args)  # here, not once per rank
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
        completions, stats = _gather(processes, outcomes)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join()
        outcomes.close()
    return ParallelRun(
        [completions[i] for i in sorted(completions)], sorted(stats, key=lambda s: s.rank)
    )


def _gather(
    processes: dict[int, mp.Process], outcomes
) -> tuple[dict[int, Completion], list[RankStats]]:
    completions: dict[int, Completion] = {}
    stats: list[RankStats] = []
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
            raise ParallelError(_failure(processes, outcome))
        completions.update(outcome.completions)
        stats.append(outcome.stats)
        waiting.discard(outcome.rank)
    return completions, stats


# How long a rank's error waits for a peer's death to show as an exit code.
PEER_EXIT_GRACE_S = 1.0


def _failure(processes: dict[int, mp.Process], outcome: RankOutcome) -> str:
    """A rank's error, led by the peer whose death caused it: a killed rank reaches the
    others as a failed collective, often before its own exit code can be read."""
    deadline = time.monotonic() + PEER_EXIT_GRACE_S
    while True:
        dead = {
            rank: process.exitcode
            for rank, process in processes.items()
            if rank != outcome.rank and process.exitcode not in (None, 0)
        }
        if dead:
            rank, code = min(dead.items())
            return (
                f"rank {rank} exited with code {code}; the group is stopped "
                f"(rank {outcome.rank}: {outcome.error})"
            )
        if time.monotonic() > deadline:
            return f"rank {outcome.rank} failed: {outcome.error}"
        time.sleep(WATCH_INTERVAL_S / 4)


def _run_rank(
    args: EngineArgs, prompts: list[list[int]], params: list[SamplingParams], outcomes
) -> None:
    """A rank's process: its own engine over its share of the prompts."""
    from deepwell.engine.llm import LLM

    config: ParallelConfig = args.parallel
    try:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        llm = LLM(**fields, decode_sequence=False)
        mine = list(range(config.rank, len(prompts), config.world_size))
        started = time.perf_counter()
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
        stats = dataclasses.replace(
            _rank_stats(llm.core, config.rank), generate_s=time.perf_counter() - started
        )
        llm.core.close()
        outcomes.put(RankOutcome(config.rank, completions, stats))
    except Exception as error:  # the launcher must learn why its rank stopped
        message = f"{type(error).__name__}: {error}"
        outcomes.put(RankOutcome(config.rank, {}, RankStats(config.rank), message))


def _rank_stats(core, rank: int) -> RankStats:
    gate = core.lockstep
    if gate is None:
        return RankStats(rank, core.num_steps, core.compute_s)
    layers = [moe.parallel for moe in gate.moe_layers]
    return RankStats(
        rank,
        gate.steps,
        core.compute_s,
        sum(layer.exchange_s for layer in layers),
        sum(layer.computed_tokens for layer in layers),
        tuple(gate.eplb.history) if gate.eplb is not None else (),
        dispatch_bytes=sum(layer.dispatch_bytes for layer in layers),
        combine_bytes=sum(layer.combine_bytes for layer in layers),
    )


def run_local_ranks(config: ParallelConfig, target, *args) -> None:
    """Run `target(config.for_rank(rank), *args)` in a process per local rank until all
    exit; the first to fail (non-zero exit, or killed) stops the others and raises."""
    context = mp.get_context("spawn")
    processes = {
        rank: context.Process(
            target=target, args=(config.for_rank(rank), *args), name=f"deepwell-rank-{rank}"
        )
        for rank in config.local_ranks()
    }
    for process in processes.values():
        process.start()
    try:
        while any(p.exitcode is None for p in processes.values()):
            for rank, process in processes.items():
                if process.exitcode:
                    raise ParallelError(
                        f"rank {rank} exited with code {process.exitcode}; the group is stopped"
                    )
            time.sleep(WATCH_INTERVAL_S)
        failed = {rank: p.exitcode for rank, p in processes.items() if p.exitcode}
        if failed:
            raise ParallelError(f"ranks exited with codes {failed}")
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join()
