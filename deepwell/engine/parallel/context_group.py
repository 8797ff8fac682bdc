"""The context-parallel process group: rank 0 (the engine) spawns its followers on this
machine over torch.distributed (gloo), announces each prefill and broadcasts its tokens.

The group is a TCPStore at MASTER_ADDR:MASTER_PORT (env:// style; a free local port when
unset) and a gloo process group over it. Followers wait for the next prefill on a store key,
which never times out (an idle engine is no fault) and fails at once when rank 0's store
goes away; collectives time out after COLLECTIVE_TIMEOUT, so a hung rank ends the prefill
with `ContextParallelError` instead of a hang. A launcher that already has a process group
(data or expert parallelism) builds a `ContextGroup` from its own store and rank.
"""

import datetime
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepwell.engine.errors import EngineError

logger = logging.getLogger(__name__)

# One collective of a prefill waits at most this long for the slowest rank: the ranks
# compute even shares between collectives, so a longer wait means a rank is stuck.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# A follower's wait for the next prefill: in effect forever (rank 0 leaving closes the store
# connection, which ends the wait at once).
IDLE_WAIT = datetime.timedelta(days=365)
# How often rank 0 checks that loading followers are still alive.
_STARTUP_POLL_S = 0.1
# How long a follower may take to leave after the stop command.
_STOP_WAIT_S = 10.0
_STOP = b"stop"


class ContextParallelError(EngineError, RuntimeError):
    """A context-parallel rank died, stopped answering or could not start."""


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    size: int

    @classmethod
    def from_env(cls, size: int) -> "GroupAddress":
        """MASTER_ADDR / MASTER_PORT as torch.distributed's env:// reads them; a free port
        on the loopback interface when unset."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        if port is None:
            with socket.socket() as probe:
                probe.bind((host, 0))
                return cls(host, probe.getsockname()[1], size)
        return cls(host, int(port), size)


class ContextGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        store: dist.Store,
        followers: list[multiprocessing.Process] | None = None,
    ) -> None:
        """`store` is the group's store (rank 0 hosts it): the process group meets there
        and prefills are announced there. `followers` are the processes rank 0 started
        (checked before each prefill and named when a collective fails)."""
        self.rank = rank
        self.size = size
        self.root_store = store
        self.store = dist.PrefixStore("commands/", store)
        self.followers = followers or []
        self.num_prefills = 0
        # Seconds spent in collectives since the last reset (benchmarks/context_parallel.py).
        self.collective_s = 0.0
        self.failed: ContextParallelError | None = None

    @classmethod
    def launch(cls, size: int, follower: Callable, *follower_args) -> "ContextGroup":
        """Rank 0: open the store, spawn `follower(rank, address, *follower_args)` for
        ranks 1..size-1, wait until each has called `join`, and join the process group."""
        address = GroupAddress.from_env(size)
        store = dist.TCPStore(
            address.host,
            address.port,
            size,
            is_master=True,
            timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )
        spawn = multiprocessing.get_context("spawn")
        followers = [
            spawn.Process(
                target=follower,
                args=(rank, address, *follower_args),
                name=f"deepwell-context-parallel-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in followers:
            process.start()
        group = cls(0, size, store, followers)
        try:
            for rank, process in enumerate(followers, 1):
                group._wait_started(rank, process)
        except ContextParallelError:
            group.close()
            raise
        _init_process_group(store, 0, size)
        return group

    @classmethod
    def connect(cls, rank: int, address: GroupAddress) -> "ContextGroup":
        """A follower: reach rank 0's store (call `join` once ready to compute)."""
        store = dist.TCPStore(
            address.host, address.port, address.size, is_master=False, timeout=COLLECTIVE_TIMEOUT
        )
        return cls(rank, address.size, store)

    def join(self) -> None:
        """A follower: tell rank 0 it has loaded, and enter the process group."""
        self.store.set(f"started/{self.rank}", b"1")
        _init_process_group(self.root_store, self.rank, self.size)

    def announce(self, token_ids: torch.Tensor, start: int) -> None:
        """Rank 0: start a prefill on every rank: `token_ids` [n] and the position its
        chunk starts at."""
        self._check_followers()
        key = f"prefill/{self.num_prefills}"
        if self.num_prefills:
            # Every follower took part in the previous prefill, so has read its key.
            self.store.delete_key(f"prefill/{self.num_prefills - 1}")
        self.store.set(key, f"{token_ids.numel()} {start}".encode())
        self.num_prefills += 1
        self.broadcast(token_ids, src=0)

    def receive(self) -> tuple[torch.Tensor, int] | None:
        """A follower: the next prefill's token ids and start position, or None when rank 0
        stops the group."""
        key = f"prefill/{self.num_prefills}"
        self.store.wait([key], IDLE_WAIT)
        value = self.store.get(key)
        if value == _STOP:
            return None
        self.num_prefills += 1
        count, start = (int(part) for part in value.split())
        token_ids = torch.empty(count, dtype=torch.long)
        self.broadcast(token_ids, src=0)
        return token_ids, start

    def all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's `rows` (one shape on all ranks), stacked in rank order."""
        out = rows.new_empty((self.size * rows.shape[0], *rows.shape[1:]))
        self._collective(dist.all_gather_single, out, rows.contiguous())
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._collective(dist.broadcast, tensor, src)

    def abandon(self, error: BaseException) -> None:
        """Rank 0: a prefill stopped part-way here, so the ranks' collectives are out of
        step: the group is down (followers still inside a collective are terminated)."""
        if self.failed is None:
            self.failed = ContextParallelError(
                f"context-parallel prefill stopped on rank {self.rank} ({error!r}); the "
                "group is down, restart the engine"
            )

    def close(self) -> None:
        """Rank 0: stop the followers and leave the group; a follower: leave it."""
        if self.rank == 0 and self.failed is None:
            self.store.set(f"prefill/{self.num_prefills}", _STOP)
            deadline = time.monotonic() + _STOP_WAIT_S
            for process in self.followers:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.followers:
            if process.is_alive():
                logger.warning("context-parallel %s did not stop: terminating it", process.name)
                process.terminate()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _collective(self, operation: Callable, *args) -> None:
        if self.failed is not None:
            raise self.failed
        started = time.perf_counter()
        try:
            operation(*args)
        except (dist.DistError, RuntimeError) as error:
            dead = self._dead_followers()
            cause = f"{dead} exited" if dead else f"a rank failed or stopped answering ({error})"
            self.failed = ContextParallelError(
                f"context-parallel prefill failed on rank {self.rank}: {cause}; the group "
                "is down, restart the engine"
            )
            raise self.failed from error
        self.collective_s += time.perf_counter() - started

    def _check_followers(self) -> None:
        if self.failed is not None:
            raise self.failed
        dead = self._dead_followers()
        if dead:
            self.failed = ContextParallelError(
                f"context-parallel {dead} exited; the group is down, restart the engine"
            )
            raise self.failed

    def _dead_followers(self) -> str:
        return ", ".join(
            f"rank {rank} (pid {process.pid}, exit code {process.exitcode})"
            for rank, process in enumerate(self.followers, 1)
            if not process.is_alive()
        )

    def _wait_started(self, rank: int, process: multiprocessing.Process) -> None:
        # Polled with `check`: a timed-out store wait logs a warning each time.
        while not self.store.check([f"started/{rank}"]):
            if not process.is_alive():
                self.failed = ContextParallelError(
                    f"context-parallel rank {rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode} while starting; see its error above"
                )
                raise self.failed
            time.sleep(_STARTUP_POLL_S)


def _init_process_group(store: dist.Store, rank: int, size: int) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("group/", store),
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
