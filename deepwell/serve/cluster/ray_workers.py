"""`deepwell serve --cluster ray`: the engine workers as Ray actors.

Ray places them (one placement group, a bundle per worker), starts them on their nodes and
restarts them when their process dies (`--ray-max-restarts`). Each actor runs the same
worker loop as a local worker process and speaks the same protocol over ZeroMQ: it binds
its inbox on its node's address and connects to this front end's `join_address`, as
`deepwell worker --connect` does, so the pool, the router and failover are the local ones.
Ray only places, starts and restarts.

A data-parallel group (`--data-parallel-size N`, its torch.distributed group formed across
the actors at rank 0's node) breaks as one: when a rank is lost the others are restarted
with it and the group meets again at a fresh port.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deepwell.serve.cluster.inference_errors import EngineUnavailable
from deepwell.serve.cluster.options import ClusterBackend
from deepwell.serve.cluster.worker_pool import WorkerPool
from deepwell.serve.messages import WorkerConfig, decode_message, encode_message

logger = logging.getLogger("deepwell.serve")

# How often a worker's supervisor looks at the pool (a worker it gave up on is restarted).
WATCH_INTERVAL_S = 0.1
# How often a restarting actor is asked whether it is up again.
RESTART_POLL_S = 0.5
# How long the workers get to leave after their Shutdown before their actors are killed.
EXIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RayPlacement:
    """How the workers are placed and restarted (the --ray-* options)."""

    strategy: str = "auto"
    cpus_per_worker: float = 1.0
    max_restarts: int = -1


class EngineWorkerActor:
    """One engine worker in a Ray worker process. Its methods run on the process's main
    thread, one at a time: `run` holds it while the worker serves."""

    def node(self) -> tuple[str, str, int]:
        """The node's address, its Ray node id, and this process's id."""
        context = ray.get_runtime_context()
        return ray.util.get_node_ip_address(), context.get_node_id(), os.getpid()

    def free_port(self) -> int:
        """A port free on this node now (rank 0's rendezvous port)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def run(self, config: bytes) -> None:
        """Serve as the worker `config` describes until the front end's `Shutdown`."""
        # Imported here: the front end's process never loads the engine.
        from deepwell.serve import worker

        config = decode_message(config)
        inbox = f"tcp://{ray.util.get_node_ip_address()}:*"
        worker.main(dataclasses.replace(config, inbox_address=inbox))


def connect(backend: ClusterBackend) -> str:
    """Join (or start) the Ray cluster; return this node's address, where workers reach us."""
    # Ray retries an unreachable head for minutes, with its own warnings: say what we wait on.
    logger.info("joining the Ray cluster at %s", backend.address or "RAY_ADDRESS, else a new one")
    try:
        ray.init(address=backend.address, namespace="deepwell", log_to_driver=True)
    except (ConnectionError, RuntimeError, TimeoutError) as error:
        raise EngineUnavailable(
            f"--cluster ray={backend.address or ''}: cannot join the Ray cluster: {error} "
            "(is `ray start --head` running there, and its port open from here?)"
        ) from None
    return ray.util.get_node_ip_address()


def disconnect() -> None:
    ray.shutdown()


class RayWorkers:
    """The workers' actors, their placement group and the `run` call each is serving."""

    def __init__(self, configs: Sequence[WorkerConfig], placement: RayPlacement) -> None:
        self._configs = list(configs)
        self._placement = placement
        parallel = self._configs[0].engine.parallel
        engines = [i for i, c in enumerate(self._configs) if c.role != "encoder"]
        # Data-parallel ranks share a torch.distributed group: they fail and restart as one.
        grouped = parallel.data_parallel_size > 1
        self._groups = [engines] if grouped else [[i] for i in engines]
        self._groups += [[i] for i, c in enumerate(self._configs) if c.role == "encoder"]
        self._group_of_ranks = grouped
        self._group: PlacementGroup | None = None
        self._actors: list[ray.actor.ActorHandle] = []
        self._runs: list[ray.ObjectRef | None] = [None] * len(self._configs)

    @property
    def strategy(self) -> str:
        if self._placement.strategy != "auto":
            return self._placement.strategy
        expert_parallel = self._configs[0].engine.parallel.expert_parallel
        return "STRICT_PACK" if expert_parallel else "SPREAD"

    def _bundle(self, config: WorkerConfig) -> dict[str, float]:
        bundle = {"CPU": self._placement.cpus_per_worker}
        if config.engine.device == "cuda":
            bundle["GPU"] = 1.0
        return bundle

    async def start(self, timeout: float) -> None:
        """Place the workers, start their actors and their worker loops."""
        bundles = [self._bundle(config) for config in self._configs]
        self._group = placement_group(bundles, strategy=self.strategy)
        try:
            await asyncio.wait_for(self._group.ready(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"Ray could not place {len(bundles)} worker(s) of {bundles[0]} with "
                f"{self.strategy} in {timeout:.0f} s; the cluster has "
                f"{ray.cluster_resources()} (--ray-cpus-per-worker, --ray-placement)"
            ) from None
        actor_class = ray.remote(EngineWorkerActor)
        self._actors = [
            actor_class.options(
                name=f"deepwell-worker-{worker_id}-{os.getpid()}",
                max_restarts=self._placement.max_restarts,
                num_cpus=bundles[worker_id]["CPU"],
                num_gpus=bundles[worker_id].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=worker_id
                ),
            ).remote()
            for worker_id in range(len(self._configs))
        ]
        for group in self._groups:
            await self._run_group(group)

    async def _run_group(self, group: list[int]) -> None:
        """Start `group`'s worker loops (its actors up), ranks meeting at rank 0's node."""
        places = [await self._node(worker_id) for worker_id in group]
        configs = [self._configs[worker_id] for worker_id in group]
        if self._group_of_ranks and len(group) > 1:
            port = await self._actors[group[0]].free_port.remote()
            configs = [_meeting_at(config, places[0][0], port) for config in configs]
        for worker_id, config, (address, node, pid) in zip(group, configs, places, strict=True):
            logger.info(
                "engine worker %d (%s): Ray actor on node %s (%s), pid %d",
                worker_id,
                config.role,
                node[:12],
                address,
                pid,
            )
            self._runs[worker_id] = self._actors[worker_id].run.remote(encode_message(config))

    async def _node(self, worker_id: int) -> tuple[str, str, int]:
        """Where the worker's actor runs, once it is up (a restarting one is waited for)."""
        while True:
            try:
                return await self._actors[worker_id].node.remote()
            except ActorDiedError:
                raise
            except RayActorError:  # restarting
                await asyncio.sleep(RESTART_POLL_S)

    async def supervise(self, pool: WorkerPool, serving: asyncio.Event) -> None:
        """Report lost workers to the pool; once serving, have them restarted to rejoin."""
        await asyncio.gather(*(self._supervise(group, pool, serving) for group in self._groups))

    async def _supervise(self, group: list[int], pool: WorkerPool, serving: asyncio.Event) -> None:
        while True:
            runs = {asyncio.ensure_future(self._runs[i]): i for i in group}
            ended = await self._first_end(runs, pool, serving)
            if ended is None:
                return  # drained on purpose: it stays out
            if not serving.is_set():
                for worker_id, reason in ended.items():
                    pool.remove(worker_id, reason, failed=True)
                return  # a failed start: the pool's start reports it
            # The group's other ranks cannot go on without it: Ray restarts them too.
            for future, worker_id in runs.items():
                if not future.done():
                    ray.kill(self._actors[worker_id], no_restart=False)
            for future, worker_id in runs.items():
                reason = ended.get(worker_id) or await _end_of(future)
                # The pool hands the lost worker's requests to the router, which re-admits them.
                pool.remove(worker_id, reason, failed=True)
            try:
                logger.warning("restarting engine worker(s) %s", ", ".join(map(str, group)))
                await self._run_group(group)
            except ActorDiedError as error:
                logger.error("engine worker(s) %s out of restarts: %s", group, error)
                return
            for worker_id in group:
                pool.restarted(worker_id)

    async def _first_end(
        self, runs: dict[asyncio.Future, int], pool: WorkerPool, serving: asyncio.Event
    ) -> dict[int, str] | None:
        """Wait until a run of the group ends; the reasons of those that did, or None when
        one ended because its worker was drained. A worker the pool gave up on (no
        heartbeat) is killed first: it may be hung."""
        killed: set[int] = set()
        while True:
            done, _ = await asyncio.wait(runs, timeout=WATCH_INTERVAL_S)
            if done:
                ended = {runs[future]: await _end_of(future) for future in done}
                if any(pool.workers[worker_id].draining for worker_id in ended):
                    return None
                return ended
            for worker_id in runs.values():
                known = pool.workers[worker_id]
                given_up = known.failure is not None and not known.draining
                if serving.is_set() and given_up and worker_id not in killed:
                    ray.kill(self._actors[worker_id], no_restart=False)
                    killed.add(worker_id)

    def stop(self) -> None:
        """After the pool's `Shutdown`: let the worker loops end, then free the actors and
        their placement group."""
        running = [run for run in self._runs if run is not None]
        if running:
            with contextlib.suppress(RayError, GetTimeoutError):
                ray.wait(running, num_returns=len(running), timeout=EXIT_TIMEOUT_S)
        for actor in self._actors:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)
        if self._group is not None:
            with contextlib.suppress(RayError):
                remove_placement_group(self._group)


async def _end_of(run: asyncio.Future) -> str:
    """Why a worker's run ended (it returns only after a `Shutdown`)."""
    try:
        await run
    except RayError as error:
        return f"Ray actor lost: {type(error).__name__}: {str(error).splitlines()[0]}"
    return "its worker loop ended"


def _meeting_at(config: WorkerConfig, address: str, port: int) -> WorkerConfig:
    parallel = dataclasses.replace(config.engine.parallel, master_addr=address, master_port=port)
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, parallel=parallel))
