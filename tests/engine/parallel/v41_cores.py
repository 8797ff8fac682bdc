"""Engine cores on the tiny DeepSeek-V4.1 for the context-parallel tests, the prompts they
run and the cache rows a prefill writes."""

import random

import torch

from deepwell.engine import EngineArgs, EngineCore

# Longer than the window (8) and than 2N chunks of it; 61 and 101 are no multiple of 2N.
LONG = (61, 101)
# Two chunks at a 256-token budget: the second starts at 256.
CHUNKED = 300


def make_core(checkpoint, **kwargs) -> EngineCore:
    # Synchronous steps: the state after one step is the state after the prefill. DSpark
    # on (the checkpoint has its stages), so its context rings are written and compared.
    args = dict(
        model=str(checkpoint),
        dtype="float32",
        max_model_len=512,
        block_size=16,
        memory_gib=0.5,
        max_num_batched_tokens=256,
        quantize_kv_cache=False,
        async_scheduling=False,
    )
    return EngineCore(EngineArgs(**(args | kwargs)))


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def sequence_state(core: EngineCore, request_id: str) -> dict[str, torch.Tensor]:
    """Every cache row the request's prefill wrote: its slot's rings (all rows: the prompt
    is longer than each ring) and its compressed entries and index keys."""
    request = core.requests[request_id]
    cache = core.runner.kv_cache
    blocks = torch.tensor(request.block_ids)
    state = {}
    for name, layers in cache.rings.items():
        for layer, ring in enumerate(layers):
            assert request.num_computed_tokens >= ring.shape[1]
            state[f"{name}[{layer}]"] = ring[request.slot].clone()
    for name, layers in cache.paged.items():
        ratio = int(name.rsplit("_r", 1)[1])
        for layer, paged in enumerate(layers):
            entries = paged[blocks].flatten(0, 1)[: request.num_computed_tokens // ratio]
            state[f"{name}[{layer}]"] = entries.clone()
    return state
