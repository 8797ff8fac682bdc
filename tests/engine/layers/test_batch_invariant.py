"""Batch-invariant kernels: a row's bits are the same at any row count and place in a
row-tiled linear, and in attention whether the row runs as a decode, alone or beside
others, or inside prefill chunks of any length (paged, and DeepSeek-V4.1's window plus
selection with a sink); and the kernel properties the attention layout rests on hold on
this machine."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine.layers.amx_linear import amx_kernel_ready
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.batch_invariant import (
    MIN_PRODUCT_ROWS,
    AmxTileLinear,
    BatchInvariantAttention,
    BatchInvariantSinkAttention,
    RowTiledLinear,
    RowwiseLinear,
    row_block_lists,
    rowwise_kernel,
    tile_linears,
    tile_queries,
)
from deepwell.engine.layers.packed_linear import pack_linears
from deepwell.engine.layers.step_metadata import SequenceSpan, plan_windows

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32  # SmolLM2's heads, the tests' block size
# SmolLM2's qkv, o, gate_up and down projections and its lm_head, in bf16 (packed where
# oneDNN runs bf16) and, but for the lm_head, in float32 (MKL).
PROJECTIONS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LINEARS = [(f, torch.bfloat16) for f in [*PROJECTIONS, (576, 49_152)]] + [
    (f, torch.float32) for f in PROJECTIONS
]


@pytest.mark.parametrize(("features", "dtype"), LINEARS, ids=str)
def test_a_tiled_linear_row_has_the_same_bits_at_any_row_count_and_place(features, dtype, threads):
    # Row counts on both sides of the kernels' switches measured on an AMX Xeon (32/33 and
    # 36/37 rows) and on AVX-512 bf16 (10/11 rows), where one call over all the rows fails.
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(*features, bias=False)).to(dtype)
    pack_linears(model)
    tile_linears(model)
    rows = torch.randn(300, features[0], generator=generator).to(dtype)
    whole = model(rows)
    for count in (1, 2, 7, 8, 10, 11, 32, 33, 37, 64, 257):
        for first in (0, 5, 300 - count):
            part = model(rows[first : first + count])
            assert torch.equal(part, whole[first : first + count]), (count, first)


def as_invariant_linear(linear: nn.Linear, kind: type[nn.Linear]) -> None:
    """Turn a bf16 linear into `kind` as tile_linears would where that kernel is the one it
    picks, skipping where the kernel cannot run here."""
    if kind is AmxTileLinear:
        if not amx_kernel_ready():
            pytest.skip(
                "the AMX linear does not run here (no AMX bf16 tiles, or torch below AVX-512)"
            )
        linear.__class__ = kind
        linear.retile()
        return
    linear.kernel = rowwise_kernel(linear.weight)
    if linear.kernel is None:
        pytest.skip("blockscaled.cpp's bf16 kernel is unavailable here")
    linear.__class__ = kind


def test_an_amx_linear_follows_its_weight_after_a_retile():
    # EPLB copies a moved expert's weight in place and retiles: the old tiles must not serve.
    model = nn.Sequential(nn.Linear(64, 48, bias=False)).to(torch.bfloat16)
    as_invariant_linear(model[0], AmxTileLinear)
    rows = torch.randn(5, 64).to(torch.bfloat16)
    before = model(rows)
    with torch.no_grad():
        model[0].weight.mul_(-1)
    model[0].retile()
    assert torch.equal(model(rows), -before)


def test_tile_linears_puts_bf16_linears_on_amx_tiles_where_they_run():
    model = nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16)
    tile_linears(model)
    assert type(model[0]) is (AmxTileLinear if amx_kernel_ready() else RowwiseLinear)


def test_tile_linears_puts_float32_linears_on_the_rowwise_kernel_where_it_builds():
    # Not ROW_TILE-row calls: those computed a lone decode's linears 64 times over (3.8x a
    # batch-1 step with AVX2 forced, where --dtype auto is float32).
    model = nn.Sequential(nn.Linear(64, 32))
    tile_linears(model)
    expected = RowTiledLinear if rowwise_kernel(model[0].weight) is None else RowwiseLinear
    assert type(model[0]) is expected


@pytest.mark.parametrize("kind", [RowwiseLinear, AmxTileLinear], ids=["rowwise", "amx"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_an_invariant_linear_computes_the_linear_with_rows_anywhere_in_the_batch(
    kind, bias, threads
):
    # SmolLM2's down projection with a bias, rows at varied places among others: each row's
    # bits as alone, and the linear's value to bf16 rounding.
    generator = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(1536, 576, bias=bias)).to(torch.bfloat16)
    as_invariant_linear(model[0], kind)
    rows = torch.randn(40, 1536, generator=generator).to(torch.bfloat16)
    whole = model(rows)
    expected = F.linear(rows.float(), model[0].weight.float(), None)
    if bias:
        expected += model[0].bias.float()
    torch.testing.assert_close(whole.float(), expected, rtol=1e-2, atol=1e-2)
    for index in (0, 3, 17, 39):
        alone = model(rows[index : index + 1])
        among = model(torch.cat((rows[index + 1 :], rows[:index], rows[index : index + 1])))
        assert torch.equal(alone[0], whole[index])
        assert torch.equal(among[-1], whole[index])
    # A leading batch dimension keeps its shape and its rows.
    assert torch.equal(model(rows.view(4, 10, 1536)).view(40, 576), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("inner", "outer"), [(HEAD_DIM, BLOCK), (HEAD_DIM, 128), (128, HEAD_DIM)])
def test_a_product_row_has_the_same_bits_at_any_row_count_and_place(dtype, inner, outer, threads):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(5, KV_HEADS, 600, inner, generator=generator).to(dtype)
    other = torch.randn(5, KV_HEADS, inner, outer, generator=generator).to(dtype)
    whole = torch.matmul(rows, other)
    least = MIN_PRODUCT_ROWS[dtype]
    for count in sorted({least, 8, 9, 48, 257}):
        for first in (0, 7, 600 - count):
            part = torch.matmul(rows[:, :, first : first + count].contiguous(), other)
            assert torch.equal(part, whole[:, :, first : first + count]), (count, first)


def attend(backend, q, keys, values, spans) -> torch.Tensor:
    """Run the spans (first row, first position, rows) of one sequence whose blocks are
    0, 1, 2, ... as one step; the caches already hold every position's key and value."""
    table = list(range(keys.shape[0]))
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in spans])
    layout = [(r, p, n, table) for r, p, n in spans]
    meta = AttentionMetadata(
        slot_blocks=positions // BLOCK,
        slot_offsets=positions % BLOCK,
        num_decodes=0,
        decode_context_lens=[],
        decode_blocks=[],
        block_size=BLOCK,
        prefills=[],
        query_tiles=tile_queries(layout, BLOCK),
        row_block_lists=row_block_lists(layout, BLOCK),
    )
    k = keys[meta.slot_blocks, :, meta.slot_offsets]
    v = values[meta.slot_blocks, :, meta.slot_offsets]
    return backend.forward(q[positions], k, v, keys, values, meta)


@pytest.fixture(params=["kernel", "tiles"])
def attention_backend(request) -> BatchInvariantAttention:
    """The backend on paged_decode.cpp (every row alone), and on its query tiles, the path
    without the kernel."""
    backend = BatchInvariantAttention(HEADS, KV_HEADS, HEAD_DIM)
    if request.param == "kernel" and backend.kernel is None:
        pytest.skip("the decode attention kernel is unavailable here")
    if request.param == "tiles":
        backend.kernel = None
    return backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decodes_and_chunks_of_any_length_give_the_same_bits(dtype, attention_backend):
    torch.manual_seed(0)
    length = 90
    backend = attention_backend
    keys = torch.randn(-(-length // BLOCK), KV_HEADS, BLOCK, HEAD_DIM).to(dtype)
    values = torch.randn_like(keys)
    q = torch.randn(length, HEADS, HEAD_DIM).to(dtype)
    whole = attend(backend, q, keys, values, [(0, 0, length)])
    # Causal attention over the whole sequence, to a tolerance: the layout computes it.
    dense_keys = keys.transpose(0, 1).flatten(1, 2)[:, :length]
    dense_values = values.transpose(0, 1).flatten(1, 2)[:, :length]
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        dense_keys.float(),
        dense_values.float(),
        is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole.float(), expected, rtol=tolerance, atol=tolerance)
    # The same rows as chunks of 1, 5 and 29 rows beside each other, and as decodes: each
    # alone (its blocks scored in place) and all in one step (gathered).
    chunked = attend(backend, q, keys, values, [(0, 0, 1), (1, 1, 5), (6, 6, 29), (35, 35, 55)])
    assert torch.equal(chunked, whole)
    decodes = attend(backend, q, keys, values, [(p, p, 1) for p in range(length)])
    assert torch.equal(decodes, whole)
    for position in (0, 31, 32, 89):
        alone = attend(backend, q, keys, values, [(0, position, 1)])
        assert torch.equal(alone[0], whole[position])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sink_attention_query_has_the_same_bits_in_any_chunk(dtype):
    """DeepSeek-V4.1's sink attention: a query's output is the same run as a decode or in
    a prefill chunk of any length and offset, whatever the width of the selection tensor
    and wherever its invalid slots lie."""
    heads, dim, window, top = 4, 32, 8, 4
    length = 40
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(length, dim, generator=generator).to(dtype)
    entries = torch.randn(length // 2, dim, generator=generator).to(dtype)
    queries = torch.randn(length, heads, dim, generator=generator).to(dtype)
    sinks = torch.randn(heads, generator=generator)
    backend = BatchInvariantSinkAttention(heads, dim, window, top)
    # Each position's selection: up to `top` of the entries it sees, ascending.
    chosen = [
        sorted(torch.randperm(p // 2, generator=generator)[:top].tolist()) for p in range(length)
    ]

    def attend(start: int, rows: int, width: int) -> torch.Tensor:
        span = SequenceSpan(0, rows, start, 0, torch.zeros(1, dtype=torch.long))
        # A ring as long as the context: its rows are the positions.
        plan = plan_windows([span], window, length)[0]
        window_keys = torch.cat((keys[plan.ring_rows], keys[start : start + rows]))
        ids = torch.full((rows, width), -1, dtype=torch.long)
        for row in range(rows):
            picked = chosen[start + row]
            # Invalid slots first in odd rows: a selection keeps -1 where topk put it.
            offset = width - len(picked) if row % 2 else 0
            ids[row, offset : offset + len(picked)] = torch.tensor(picked, dtype=torch.long)
        return backend.forward(
            queries[start : start + rows],
            window_keys,
            plan.visible,
            entries[ids.clamp(min=0)],
            ids >= 0,
            sinks,
        )

    decodes = torch.cat([attend(p, 1, top) for p in range(length)])
    for chunk in (3, 7, 16, 40):
        for start in range(0, length, chunk):
            rows = min(chunk, length - start)
            out = attend(start, rows, top + 3)
            assert torch.equal(out, decodes[start : start + rows]), (chunk, start)
