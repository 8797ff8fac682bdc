"""DeepSeek-V4.1's batch-invariant paths without row tiles: the mHC mixing, the router and
the experts' activation, the compressor, the indexer's scores, the grouped output
projection, the Engram gate and the rotations give a row the same bits alone, beside any
number of rows and at any place among them, and the values of the default path."""

import pytest
import torch

from deepwell.engine.layers.batch_invariant import (
    BatchInvariantSinkAttention,
    row_kernels,
    tile_linears,
)
from deepwell.engine.models.deepseek_v41.attention import Compressor, CSA2Attention, Indexer
from deepwell.engine.models.deepseek_v41.config import DeepseekV41Config
from deepwell.engine.models.deepseek_v41.engram import Engram
from deepwell.engine.models.deepseek_v41.mhc import HyperConnection
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.rotary import PairRotary
from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG

pytestmark = pytest.mark.skipif(
    not row_kernels(torch.empty(0)), reason="invariant_rows.cpp does not build here"
)

CONFIG = DeepseekV41Config.from_hf(TINY_TEXT_CONFIG)
COUNTS = (1, 2, 3, 5, 16, 33)
TOTAL = 40


def randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return module


def inputs(*shape: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(TOTAL, *shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_rows_alone(compute, *tensors: torch.Tensor) -> torch.Tensor:
    """compute over every count and place of rows gives the rows' bits of the whole."""
    whole = compute(*tensors)
    for count in COUNTS:
        for first in (0, 4, TOTAL - count):
            part = compute(*(x[first : first + count] for x in tensors))
            for got, expected in zip(_tensors(part), _tensors(whole), strict=True):
                assert torch.equal(got, expected[first : first + count]), (count, first)
    return whole


def _tensors(value) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def pair(build):
    """The module invariant and as the default path, with the same weights."""
    return randomised(build(True)), randomised(build(False))


def test_mhc_mixing_goes_row_by_row():
    c = CONFIG
    invariant, default = pair(
        lambda on: HyperConnection(
            c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, on
        )
    )
    streams = inputs(c.hc_mult, c.hidden_size)
    got = assert_rows_alone(invariant, streams)
    for value, expected in zip(got, default(streams), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_and_the_experts_go_row_by_row(dtype):
    c = CONFIG

    def build(on: bool) -> MoE:
        return MoE(
            c.hidden_size,
            c.moe_intermediate_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.routed_scaling_factor,
            c.norm_topk_prob,
            c.swiglu_limit,
            on,
        ).to(dtype)

    invariant, default = pair(build)
    # As the engine does in this mode (build.py): every plain linear row-wise or row-tiled.
    tile_linears(invariant)
    x = inputs(c.hidden_size, dtype=dtype)
    got = assert_rows_alone(invariant, x)
    torch.testing.assert_close(got, default(x), rtol=2e-2, atol=2e-2)


def test_the_compressor_projects_and_pools_row_by_row():
    invariant, default = pair(lambda on: Compressor(CONFIG, 2, on))
    u = inputs(CONFIG.hidden_size, dtype=torch.bfloat16)
    pairs = assert_rows_alone(invariant.projections, u)
    torch.testing.assert_close(pairs, default.projections(u), rtol=1e-5, atol=1e-5)
    # Groups of 2 positions: every count of whole groups and place among them.
    groups = pairs.flatten(1).view(TOTAL // 2, 2, -1)

    def pool(groups):
        return invariant.pool(groups.reshape(-1, 2, CONFIG.head_dim), torch.bfloat16)

    whole = pool(groups)
    for count in (1, 2, 3, 7, 16):
        for first in (0, 3, TOTAL // 2 - count):
            assert torch.equal(pool(groups[first : first + count]), whole[first : first + count])
    expected = default.pool(groups.reshape(-1, 2, CONFIG.head_dim), torch.bfloat16)
    torch.testing.assert_close(whole, expected)


def test_the_indexer_scores_row_by_row():
    c = CONFIG
    invariant, default = pair(lambda on: Indexer(c, True, on))
    queries = inputs(c.index_n_heads, c.index_head_dim)
    weights = inputs(c.index_n_heads, seed=2)
    keys = torch.randn(23, c.index_head_dim, generator=torch.Generator().manual_seed(3))
    visible = torch.randint(1, 24, (TOTAL,), generator=torch.Generator().manual_seed(4))

    def scores(queries, weights, visible):
        return invariant.scores(queries, weights, keys, visible)

    got = assert_rows_alone(scores, queries, weights, visible)
    torch.testing.assert_close(
        got, default.scores(queries, weights, keys, visible), rtol=1e-5, atol=1e-4
    )


def test_the_grouped_output_projection_goes_row_by_row():
    c = CONFIG
    plan = c.layer_plans()[0]
    rotary = PairRotary(c.qk_rope_head_dim, c.rope_theta, None)
    backend = BatchInvariantSinkAttention(
        c.num_attention_heads, c.head_dim, c.sliding_window, c.index_topk
    )
    invariant, default = pair(
        lambda on: CSA2Attention(c, plan, backend, rotary, on).to(torch.bfloat16)
    )
    tile_linears(invariant)
    out = inputs(c.num_attention_heads, c.head_dim, dtype=torch.bfloat16)
    rotation = rotary.rotation(torch.arange(TOTAL))
    got = assert_rows_alone(invariant.output, out, rotation)
    torch.testing.assert_close(got, default.output(out, rotation), rtol=2e-2, atol=2e-2)


def test_the_engram_gate_goes_in_whole_vector_bodies():
    c = CONFIG
    hash_heads = (c.engram_max_ngram_size - 1) * c.engram_n_heads

    def build(on: bool) -> Engram:
        return Engram(
            c.engram_num_embeddings[0],
            c.engram_head_dim,
            hash_heads,
            c.hc_mult,
            c.hidden_size,
            c.rms_norm_eps,
            on,
        )

    invariant, default = pair(build)
    tile_linears(invariant)
    streams = inputs(c.hc_mult, c.hidden_size)
    rows = torch.randint(0, c.engram_num_embeddings[0], (TOTAL, hash_heads))
    got = assert_rows_alone(invariant, streams, rows)
    torch.testing.assert_close(got, default(streams, rows), rtol=1e-5, atol=1e-5)


def test_a_rotation_has_the_same_bits_for_any_position_count():
    rotary = PairRotary(
        CONFIG.qk_rope_head_dim, CONFIG.compress_rope_theta, TINY_TEXT_CONFIG["rope_scaling"]
    )
    positions = torch.randint(0, 4096, (TOTAL,), generator=torch.Generator().manual_seed(0))
    got = assert_rows_alone(rotary.invariant_rotation, positions)
    torch.testing.assert_close(got, rotary.rotation(positions))
