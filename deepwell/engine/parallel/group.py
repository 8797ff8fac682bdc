"""The torch.distributed group of attention-DP / expert-parallel ranks: its typed configuration,
start-up (gloo on CPU, NCCL on CUDA) and teardown, with a timeout so a dead peer fails."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class ParallelError(RuntimeError):
    """The group cannot start or has broken (a rank died, hung or timed out)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks, which one this is, and where they meet (vLLM's flag names).

    EP size is the DP size, as in vLLM: with `expert_parallel` every DP rank holds
    1/N of the routed experts. Without it the DP ranks share nothing and run apart.
    """

    data_parallel_size: int = 1
    expert_parallel: bool = False
    enable_eplb: bool = False
    # EPLB re-places experts after every this many steps of the group.
    eplb_window_steps: int = 32
    # Physical expert slots beyond the logical experts, filled with replicas of hot ones.
    eplb_redundant_experts: int = 0
    # A layer's experts move only when the new placement lowers its window's max/mean rank
    # load by at least this much: moving weights costs a step's wait, a shift of a few
    # percent in the counts is noise.
    eplb_min_gain: float = 0.05
    # This process's global rank: node_rank * (ranks per node) + local rank.
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_rank: int = 0
    nnodes: int = 1
    # A collective that waits longer than this for a peer fails the group.
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        size, nodes = self.data_parallel_size, self.nnodes
        if size < 1 or nodes < 1:
            raise ValueError("data_parallel_size and nnodes must be positive")
        if size % nodes:
            raise ValueError(
                f"data_parallel_size {size} must be a multiple of nnodes {nodes} "
                "(each machine runs the same number of ranks)"
            )
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"node_rank must be in [0, {nodes}), got {self.node_rank}")
        if not 0 <= self.rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {self.rank}")
        if self.expert_parallel and size == 1:
            raise ValueError(
                "expert_parallel shards experts over the DP ranks: it needs data_parallel_size > 1"
            )
        if self.enable_eplb and not self.expert_parallel:
            raise ValueError("enable_eplb balances expert-parallel ranks: it needs expert_parallel")
        if self.eplb_redundant_experts < 0 or self.eplb_window_steps < 1:
            raise ValueError("eplb_redundant_experts must be >= 0 and eplb_window_steps >= 1")
        if self.eplb_min_gain < 0:
            raise ValueError(f"eplb_min_gain must be >= 0, got {self.eplb_min_gain}")
        if self.eplb_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_redundant_experts places replicas by load: it needs enable_eplb")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.data_parallel_size // self.nnodes

    def local_ranks(self) -> range:
        """The global ranks this machine starts."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def for_rank(self, rank: int) -> ParallelConfig:
        return dataclasses.replace(self, rank=rank)

    @classmethod
    def from_torchrun(
        cls, fields: Mapping[str, Any], environ: Mapping[str, str] = os.environ
    ) -> ParallelConfig | None:
        """The configuration `fields` give, as the rank torchrun started (RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT, GROUP_RANK, NNODES in the environment); None outside it."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        world = int(environ["WORLD_SIZE"])
        if fields.get("data_parallel_size", 1) not in (1, world):
            raise ValueError(
                f"--data-parallel-size {fields['data_parallel_size']} disagrees with torchrun's "
                f"WORLD_SIZE {world}"
            )
        return cls(
            **{
                **fields,
                "data_parallel_size": world,
                "rank": int(environ["RANK"]),
                "master_addr": environ.get("MASTER_ADDR", fields.get("master_addr", "127.0.0.1")),
                "master_port": int(environ.get("MASTER_PORT", fields.get("master_port", 29500))),
                "node_rank": int(environ.get("GROUP_RANK", 0)),
                "nnodes": int(environ.get("NNODES", 1)),
            }
        )


@dataclass(frozen=True)
class DistributedGroup:
    """The started default process group, seen from one rank."""

    rank: int
    world_size: int
    backend: str
    timeout_s: float

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_group(config: ParallelConfig, device: torch.device | None = None) -> DistributedGroup:
    """Join the group (blocks until every rank has joined, at most `timeout_s`)."""
    on_cuda = device is not None and device.type == "cuda"
    backend = "nccl" if on_cuda else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{config.master_addr}:{config.master_port}",
            rank=config.rank,
            world_size=config.world_size,
            timeout=timedelta(seconds=config.timeout_s),
        )
    except (RuntimeError, ValueError, OSError) as error:
        raise ParallelError(
            f"rank {config.rank} could not join the {config.world_size}-rank group at "
            f"{config.master_addr}:{config.master_port}: {error}"
        ) from error
    return DistributedGroup(config.rank, config.world_size, backend, config.timeout_s)


@contextmanager
def collective(group: DistributedGroup, what: str) -> Iterator[None]:
    """Turn a failed collective (a peer gone: connection closed, or the timeout) into a
    ParallelError that says so, rather than torch's transport message alone."""
    try:
        yield
    except ParallelError:
        raise
    except RuntimeError as error:
        raise ParallelError(
            f"rank {group.rank}: the {what} collective failed, so the {group.world_size}-rank "
            f"group is broken (a rank died, or waited over {group.timeout_s:g}s): {error}"
        ) from error
