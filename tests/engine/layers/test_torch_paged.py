"""The CPU paged attention backend: every path (batch-1 decode, ragged batched decode,
fresh and continued prefill chunks) gives the tokens of the others."""

import pytest
import torch
import torch.nn.functional as F

from deepwell.engine import SamplingParams
from deepwell.engine.layers.attention import AttentionMetadata, FixedDecodeMetadata
from deepwell.engine.layers.torch_paged import IN_PLACE_SPAN_FACTOR, TorchPagedAttention

from ..tiny_llama import run_to_completion


def test_alone_batched_and_chunked_runs_give_the_same_greedy_tokens(make_core):
    prompts = {f"r{i}": [(11 * i + 3 * j) % 300 + 3 for j in range(5 + 23 * i)] for i in range(5)}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = {}
    for key, prompt in prompts.items():
        core = make_core()
        core.add_request(key, prompt, params)
        alone |= run_to_completion(core)
    core = make_core(max_num_batched_tokens=7)  # chunked prefill beside decodes
    for key, prompt in prompts.items():
        core.add_request(key, prompt, params)
    assert run_to_completion(core) == alone


@pytest.mark.parametrize(
    ("tables", "lens", "in_place"),
    [
        # Block 29 puts the span far past 3x the decode blocks: gathered.
        ([[3, 7], [1], [0, 5, 29]], [6, 2, 11], False),
        ([[3, 7], [1], [0, 5, 9]], [6, 2, 11], True),
        # Rows 0-1 and 2-3 share blocks (a draft's verify rows): stacked in place.
        ([[3, 7], [3, 7], [1], [1], [0, 5, 9]], [6, 7, 2, 3, 11], True),
    ],
    ids=["gathered", "in_place", "stacked"],
)
def test_ragged_decode_equals_dense_attention_over_each_context(tables, lens, in_place):
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    backend = TorchPagedAttention(heads, kv_heads, dim)
    keys = torch.randn(30, kv_heads, block, dim)
    values = torch.randn(30, kv_heads, block, dim)
    q = torch.randn(len(tables), heads, dim)
    block_ids = [b for t in tables for b in t]
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(tables),
        decode_context_lens=lens,
        decode_blocks=block_ids,
        block_size=block,
        prefills=[],
    )
    _, depth, span = meta.decode_block_stacking
    assert (span * depth <= IN_PLACE_SPAN_FACTOR * len(block_ids)) == in_place
    out = backend._decode(q, keys, values, meta)
    for row, (table, length) in enumerate(zip(tables, lens, strict=True)):
        k = keys[table].transpose(0, 1).flatten(1, 2)[:, :length]
        v = values[table].transpose(0, 1).flatten(1, 2)[:, :length]
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), k, v, enable_gqa=True)
        torch.testing.assert_close(out[row], expected.squeeze(1), rtol=1e-5, atol=1e-5)


def test_a_fixed_size_decode_step_stores_and_attends_each_row_over_its_own_context():
    """AttentionBackend.decode_fixed (decode graphs): block tables padded to a fixed width
    with block 0, whose keys past each row's context are masked out; the row's new key and
    value stored first, then dense attention over exactly its context."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block, width = 4, 2, 8, 4, 5
    backend = TorchPagedAttention(heads, kv_heads, dim)
    key_cache = torch.randn(12, kv_heads, block, dim)
    value_cache = torch.randn(12, kv_heads, block, dim)
    tables, lens = [[3, 7], [1], [0, 5, 9]], [6, 2, 11]
    q = torch.randn(3, heads, dim)
    k, v = torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    # Each row's new key goes at its last position.
    rows = zip(tables, lens, strict=True)
    slots = [t[(n - 1) // block] * block + (n - 1) % block for t, n in rows]
    meta = FixedDecodeMetadata(
        slot_blocks=torch.tensor(slots) // block,
        slot_offsets=torch.tensor(slots) % block,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(lens),
    )
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    out = backend.decode_fixed(q, k, v, key_cache, value_cache, meta)
    for row, slot in enumerate(slots):
        expected_keys[slot // block, :, slot % block] = k[row]
        expected_values[slot // block, :, slot % block] = v[row]
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)
    for row, (table, length) in enumerate(zip(tables, lens, strict=True)):
        context_keys = expected_keys[table].transpose(0, 1).flatten(1, 2)[:, :length]
        context_values = expected_values[table].transpose(0, 1).flatten(1, 2)[:, :length]
        dense = F.scaled_dot_product_attention(
            q[row].view(heads, 1, dim),
            context_keys.repeat_interleave(heads // kv_heads, 0),
            context_values.repeat_interleave(heads // kv_heads, 0),
        ).view(heads, dim)
        torch.testing.assert_close(out[row], dense)
