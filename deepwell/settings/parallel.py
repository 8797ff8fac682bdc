"""ParallelConfig: the attention-DP / expert-parallel ranks a process belongs to, declared
as settings (`declare.setting`) like EngineArgs, which holds one. Torch-free: serve's HTTP
process builds it for its workers; the group itself starts in engine/parallel/group.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepwell.settings import environment as env
from deepwell.settings.declare import setting


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks, which one this is, and where they meet (vLLM's flag names).

    EP size is the DP size, as in vLLM: with `expert_parallel` every DP rank holds
    1/N of the routed experts. Without it the DP ranks share nothing and run apart.
    """

    data_parallel_size: int = setting(
        1,
        "engine ranks, each with its own scheduler, KV cache and requests",
        group="parallelism",
        flags="--data-parallel-size",
        metavar="N",
    )
    expert_parallel: bool = setting(
        False,
        "shard the routed experts over the data-parallel ranks (EP size = DP size); tokens "
        "move to their experts' ranks by all-to-all each MoE layer (MoE models only)",
        group="parallelism",
        flags="--expert-parallel",
        bool_flag="on",
    )
    enable_eplb: bool = setting(
        False,
        "expert-parallel load balancing: re-place experts (and replicas of hot ones) by their "
        "token counts every --eplb-window-steps steps",
        group="parallelism",
        flags="--enable-eplb",
        bool_flag="on",
    )
    # DeepInfer's EXPERT_COUNT_WINDOW_SIZE and EXPERT_REARRANGEMENT_STEP_INTERVAL, apart.
    eplb_window_steps: int = setting(
        100,
        "steps of token counts behind each EPLB re-placement (the last ones before it)",
        group="parallelism",
        flags="--eplb-window-steps",
        metavar="STEPS",
        env="DEEPWELL_EXPERT_COUNT_WINDOW_SIZE",
        env_parse=env.parse_int,
    )
    eplb_step_interval: int = setting(
        0,
        "EPLB re-places experts every N steps, at least the window; 0: every window",
        group="parallelism",
        flags="--eplb-step-interval",
        metavar="STEPS",
        env="DEEPWELL_EXPERT_REARRANGEMENT_STEP_INTERVAL",
        env_parse=env.parse_int,
    )
    eplb_redundant_experts: int = setting(
        0,
        "extra expert slots EPLB fills with replicas of hot experts; also makes the slots "
        "divide over the ranks",
        group="parallelism",
        flags="--eplb-redundant-experts",
        metavar="N",
        env="DEEPWELL_OVERRIDE_NUM_EXTRA_EXPERTS",
        env_parse=env.parse_int,
    )
    # Moving weights costs a step's wait; a shift of a few percent in the counts is noise.
    eplb_min_gain: float = setting(
        0.05,
        "move a layer's experts only when the new placement lowers its window's max/mean rank "
        "load by at least G, so that noise in the counts moves no weights (0 re-places at "
        "every window)",
        group="parallelism",
        flags="--eplb-min-gain",
        metavar="G",
    )
    # This process's global rank: node_rank * (ranks per node) + local rank.
    rank: int = setting(0, "this process's global rank", group="parallelism")
    master_addr: str = setting(
        "127.0.0.1",
        "address of global rank 0's machine, where the ranks meet",
        group="parallelism",
        flags="--master-addr",
    )
    master_port: int = setting(
        29500, "its rendezvous port", group="parallelism", flags="--master-port"
    )
    node_rank: int = setting(
        0, "this machine's index among them", group="parallelism", flags="--node-rank"
    )
    nnodes: int = setting(
        1, "machines the ranks span, equally", group="parallelism", flags="--nnodes"
    )
    # DeepInfer's 4 hours: a peer may be inside a long prefill.
    timeout_s: float = setting(
        14400.0,
        "seconds a collective waits for a peer before the group fails",
        group="parallelism",
        env="DEEPWELL_GLOO_TIMEOUT",
        env_parse=env.parse_float,
    )

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
        if self.eplb_step_interval and not (1 <= self.eplb_window_steps <= self.eplb_step_interval):
            raise ValueError(
                f"eplb_window_steps must lie in [1, eplb_step_interval "
                f"{self.eplb_step_interval}], got {self.eplb_window_steps}"
            )
        if self.eplb_step_interval < 0:
            raise ValueError(f"eplb_step_interval must be >= 0, got {self.eplb_step_interval}")
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
