"""The torch.distributed group of attention-DP / expert-parallel ranks: start-up (gloo on CPU,
NCCL on CUDA) and teardown, with a timeout so a dead peer fails. Its typed configuration,
`ParallelConfig`, is a setting (deepwell/settings/parallel.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepwell.settings.parallel import ParallelConfig


class ParallelError(RuntimeError):
    """The group cannot start or has broken (a rank died, hung or timed out)."""


@dataclass(frozen=True)
class DistributedGroup:
    """The started default process group, seen from one rank."""

    rank: int
    world_size: int
    backend: str
    timeout_s: float

    @property
    def device(self) -> torch.device:
        """Where this group's collectives read their tensors: the rank's GPU on NCCL, else
        the host."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device | None) -> str:
    """The collective backend for tensors on `device`: NCCL for CUDA tensors (gloo cannot
    read device memory), gloo for host tensors (NCCL cannot read host memory)."""
    return "nccl" if device is not None and device.type == "cuda" else "gloo"


def init_group(config: ParallelConfig, device: torch.device | None = None) -> DistributedGroup:
    """Join the group (blocks until every rank has joined, at most `timeout_s`) on the
    backend for the engine's `device`."""
    backend = backend_for(device)
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
