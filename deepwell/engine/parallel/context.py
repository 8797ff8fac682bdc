"""Context parallelism for a model that has a context-parallel forward (its hooks'
`context_parallel`, models/contract.py): rank 0 starts the group and steps through the
model's leader; ranks 1..N−1 load the model and run each prefill rank 0 announces.

The group itself is context_group.py, the positions each rank takes context_layout.py; what a
rank computes is the model's (DeepSeek-V4.1: models/deepseek_v41/context_parallel.py).
docs/parallel.md.
"""

import logging
import os

import torch
import torch.distributed as dist

from deepwell.engine.args import EngineArgs
from deepwell.engine.build import load_model
from deepwell.engine.models.contract import CausalLM, ContextParallelLeader
from deepwell.engine.parallel.context_group import ContextGroup, GroupAddress

logger = logging.getLogger(__name__)


def launch_context_parallel(model: CausalLM, args: EngineArgs) -> ContextParallelLeader:
    """Start ranks 1..N−1 (each loads the checkpoint), join them, and return rank 0's
    stand-in for `model`."""
    forward = model.hooks().context_parallel
    if forward is None:
        raise ValueError(
            "context parallelism runs DeepSeek-V4.1 checkpoints only (models with a "
            f"context-parallel forward), got {type(model).__name__}"
        )
    if not args.num_threads:
        # The ranks share this machine's cores (followers: run_follower).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.context_parallel_size))
    group = ContextGroup.launch(args.context_parallel_size, run_follower, args)
    return forward.leader(group, args.context_parallel_min_tokens)


def run_follower(rank: int, address: GroupAddress, args: EngineArgs) -> None:
    """Rank 1..N−1: load the model, then run each announced prefill until told to stop."""
    # Ranks share this machine's cores.
    torch.set_num_threads(args.num_threads or max(1, (os.cpu_count() or 1) // address.size))
    group = ContextGroup.connect(rank, address)
    model = load_model(args).model
    group.join()
    prefill = model.hooks().context_parallel.follower(group)
    try:
        while (message := group.receive()) is not None:
            token_ids, start = message
            prefill(token_ids, start)
    except dist.DistNetworkError:
        logger.warning("context-parallel rank %d: rank 0 left the group; stopping", rank)
    finally:
        group.close()
