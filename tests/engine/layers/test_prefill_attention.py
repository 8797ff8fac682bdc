"""The C++ prefill attention (prefill_attention.cpp) against exact attention and torch's SDPA:
chunks alone and after a cached prefix, paged through shuffled block tables, GQA groups,
head dims, strided query rows, in each form of the bf16 products (AMX tiles where they run);
its two vector forms bit for bit, and main's bits on W-like chunks; the tiles beside
oneDNN's; through the C++ backend beside decode rows; bad inputs refused by name; float32
left to the torch path."""

import hashlib

import pytest
import torch

from deepwell.engine.layers.attention import AttentionMetadata, PrefillSpan
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.decode_kernel import load_prefill_kernel
from deepwell.engine.layers.torch_paged import TorchPagedAttention

# bf16 outputs round to 2^-9 of their size; the torch path rounds its softmax weights alike.
EXACT_TOLERANCE = 8e-3
TORCH_TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def kernel():
    """Built once per machine (cached). Only a machine without a compiler or AVX512_BF16
    skips; a build that fails on one is a failure."""
    loaded = load_prefill_kernel()
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"prefill attention kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason
    if not loaded.module.vectorised():
        pytest.skip("prefill attention kernel: this CPU has no AVX512_BF16")
    return loaded.module


def forms(kernel):
    """The product forms this kernel runs here: the vector ones, and the tiles where they run."""
    return ["dpbf16", "fma"] + (["amx"] if kernel.on_tiles() else [])


# Each test that takes a form runs each one; the tiles skip where they do not run.
FORMS = ["native", "dpbf16", "fma", "amx"]


def form_or_skip(kernel, products):
    if products == "amx" and not kernel.on_tiles():
        pytest.skip("no AMX tiles here (their refusal is tested instead)")
    return products


def paged_case(context, heads, kv_heads, dim, block_size, seed, dtype=torch.bfloat16):
    """Caches holding one sequence's `context` keys on shuffled blocks (spare blocks of
    noise around them) and its block table."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-context // block_size)
    num_blocks = used + 3
    keys = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    values = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:used]
    return keys, values, table


def exact_attention(q, keys, values, table, context):
    """float64 causal attention of the chunk's rows (the last q.shape[0] positions) over the
    sequence's context, from the same rounded inputs."""
    length, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys[table].transpose(0, 1).flatten(1, 2)[:, :context].double()
    v = values[table].transpose(0, 1).flatten(1, 2)[:, :context].double()
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * dim**-0.5
    positions = torch.arange(context - length, context).unsqueeze(1)
    scores.masked_fill_(torch.arange(context).unsqueeze(0) > positions, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def causal_mask(start, end):
    """[end - start, end]: what each of rows start .. end - 1 sees."""
    return torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)


def masked_span(length, context, table, row=0):
    """A chunk ending the context, with its mask even when it is the whole context: the
    torch path then reads the keys from the caches, as the kernel does."""
    return PrefillSpan(row, length, context, table, causal_mask(context - length, context))


@pytest.mark.parametrize("products", FORMS)
@pytest.mark.parametrize(
    ("length", "context", "heads", "kv_heads", "dim", "block_size"),
    [
        (1, 1, 9, 3, 64, 128),  # one token
        (70, 70, 9, 3, 64, 128),  # a first chunk, a partial key block
        (37, 300, 9, 3, 64, 16),  # after a prefix, small cache blocks
        (129, 129, 8, 8, 64, 32),  # no GQA, a remainder tile
        (96, 1000, 4, 1, 128, 128),  # one KV head, head_dim 128, a long prefix
        (300, 557, 9, 3, 64, 16),  # chunk rows across the tiles' spans of 256 keys
        (17, 17, 6, 1, 192, 128),  # a group of 6, head_dim 192: a lone output tile pair
    ],
)
def test_kernel_matches_exact_attention_and_torch_sdpa(
    kernel, products, length, context, heads, kv_heads, dim, block_size
):
    products = form_or_skip(kernel, products)
    keys, values, table = paged_case(context, heads, kv_heads, dim, block_size, seed=length)
    gen = torch.Generator().manual_seed(context)
    # Query rows inside a wider fused projection, as the model's qkv split leaves them.
    fused = torch.randn(length, heads + 2 * kv_heads, dim, generator=gen).bfloat16()
    q = fused[:, :heads]
    out = torch.full((length, heads, dim), float("nan"), dtype=torch.bfloat16)
    kernel.chunk_attention(q, keys, values, table, context, dim**-0.5, out, products)
    expected = exact_attention(q, keys, values, table, context)
    torch.testing.assert_close(out.double(), expected, rtol=EXACT_TOLERANCE, atol=EXACT_TOLERANCE)
    torch_path = TorchPagedAttention(heads, kv_heads, dim)._prefill(
        q, None, None, keys, values, masked_span(length, context, table)
    )
    torch.testing.assert_close(out, torch_path, rtol=TORCH_TOLERANCE, atol=TORCH_TOLERANCE)


def wide_exponents(shape, spread, gen):
    """Normal samples scaled by 2^e, e uniform in [-spread, 0]: with a spread past 63, bf16
    products below float32's normal range (denormal or flushed) occur among them, and the
    scores stay finite."""
    scales = torch.randint(-spread, 1, shape, generator=gen).float().exp2()
    return (torch.randn(shape, generator=gen) * scales).bfloat16()


@pytest.mark.parametrize(
    ("length", "context", "heads", "kv_heads", "dim", "spread", "values_shift"),
    [
        (70, 70, 9, 3, 64, 1, 0),  # W's shapes: SmolLM2's groups of 3, a partial key block
        (37, 300, 9, 3, 64, 70, 0),  # after a prefix; products from 2^-140 up
        (129, 129, 8, 8, 64, 90, 0),  # no GQA, a remainder tile
        (33, 200, 4, 1, 128, 80, 0),  # head_dim 128
        # Values near float32's smallest normal: outputs whose bits show a flushed product.
        (40, 90, 6, 2, 64, 12, -118),
    ],
)
def test_fma_products_give_the_bits_of_dpbf16(
    kernel, length, context, heads, kv_heads, dim, spread, values_shift
):
    """The FMA form of the products (DAZ and FTZ, odd half first) rounds every sum as
    VDPBF16PS does, whatever the operands' magnitudes: the outputs are equal, not close."""
    gen = torch.Generator().manual_seed(length + spread)
    block_size, num_blocks = 16, -(-context // 16) + 2
    keys = wide_exponents((num_blocks, kv_heads, block_size, dim), spread, gen)
    values = wide_exponents((num_blocks, kv_heads, block_size, dim), spread, gen)
    values = (values.float() * 2.0**values_shift).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[: -(-context // block_size)]
    q = wide_exponents((length, heads, dim), spread, gen)
    outs = {}
    for products in ("dpbf16", "fma"):
        outs[products] = torch.empty(length, heads, dim, dtype=torch.bfloat16)
        kernel.chunk_attention(q, keys, values, table, context, dim**-0.5, outs[products], products)
    assert torch.equal(outs["fma"].view(torch.int16), outs["dpbf16"].view(torch.int16))
    assert outs["fma"].isfinite().all()


def test_fma_products_keep_a_zero_sums_sign_through_the_masked_keys(kernel):
    """Rows that see none of a block's last 32 keys leave their value products out in the FMA
    form: a sum flushed to -0 must still end as VDPBF16PS's +0-weighted products leave it,
    -0 where the unseen values are all negative, +0 where one is positive."""
    length = context = 64
    heads, kv_heads, dim = 9, 3, 64
    q = torch.zeros(length, heads, dim, dtype=torch.bfloat16)  # every seen key weighs 1
    keys = torch.zeros(1, kv_heads, length, dim, dtype=torch.bfloat16)
    values = torch.full((1, kv_heads, length, dim), -0.0)
    # Key 1 then key 0 (a pair's odd product first): -(2^-120 + 2^-127) + 2^-120 flushes to -0.
    values[:, :, 0] = 2.0**-120
    values[:, :, 1] = -(2.0**-120 + 2.0**-127)
    values[:, :, 32:, 0::2] = -1.0
    values[:, :, 32:, 1::2] = 1.0
    values = values.bfloat16()
    table = torch.tensor([0])
    outs = {}
    for products in ("dpbf16", "fma"):
        outs[products] = torch.empty(length, heads, dim, dtype=torch.bfloat16)
        kernel.chunk_attention(q, keys, values, table, context, 0.125, outs[products], products)
    assert torch.equal(outs["fma"].view(torch.int16), outs["dpbf16"].view(torch.int16))
    zeros = outs["fma"][1:32].float()  # rows that see key 1 but no key past 31
    assert (zeros == 0).all()
    assert zeros[..., 0::2].signbit().all() and not zeros[..., 1::2].signbit().any()


# sha256 of `w_like_digest`'s outputs from main's kernel at cc758ef, before the FMA form's
# blocks were widened ahead and the masked keys skipped: W's greedy tokens rest on these bits.
# A change meant to move them must say so and record the new digest.
W_LIKE_DIGEST = "b40b68d6746057bb0bd0c31f9b64bea1286c9f203c20d20f3af0a578c63fcb6e"


def w_like_digest(kernel, products):
    """sha256 of the kernel's bf16 outputs on W-like chunks (9 heads over 3 KV heads of 64):
    first chunks on and off the 64-key blocks, chunks after a prefix, one token after a long
    prefix, and inputs over a wide range of exponents."""
    digest = hashlib.sha256()
    shapes = [(64, 64, 1), (70, 70, 1), (200, 200, 1), (100, 300, 1), (1, 500, 1), (129, 129, 70)]
    for seed, (length, context, spread) in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed)
        block_size = 16 if seed % 2 else 128
        num_blocks = -(-context // block_size) + 2
        keys = wide_exponents((num_blocks, 3, block_size, 64), spread, gen)
        values = wide_exponents((num_blocks, 3, block_size, 64), spread, gen)
        table = torch.randperm(num_blocks, generator=gen)[: -(-context // block_size)]
        q = wide_exponents((length, 9, 64), spread, gen)
        out = torch.empty(length, 9, 64, dtype=torch.bfloat16)
        kernel.chunk_attention(q, keys, values, table, context, 0.125, out, products)
        digest.update(out.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("products", ["dpbf16", "fma"])
def test_kernel_keeps_mains_bits_on_w_like_chunks(kernel, products):
    """Both forms give, bit for bit, what main's kernel gave before the softmax skipped the
    masked keys and the unchanged maxima (the digest above)."""
    assert w_like_digest(kernel, products) == W_LIKE_DIGEST


def test_fma_products_leave_the_callers_denormals_alone(kernel):
    """The FMA form flushes denormals only while it multiplies: after a call on this thread,
    float32 arithmetic keeps its denormals."""
    keys, values, table = paged_case(70, 9, 3, 64, 16, seed=5)
    q = torch.randn(70, 9, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    kernel.chunk_attention(q, keys, values, table, 70, 0.125, torch.empty_like(q), "fma")
    denormal = torch.tensor([2.0**-140]) * torch.tensor([1.0])
    assert denormal.item() == 2.0**-140


def test_backend_step_with_decodes_and_two_chunks_matches_the_torch_backend(kernel):
    """A mixed step through forward: one decode row, then a continued chunk and a first
    chunk of two other sequences; the step's keys are stored before anyone attends."""
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    num_blocks = 40
    cache = torch.randn(2, num_blocks, kv_heads, bs, dim, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[:19].split([4, 10, 5])
    # Sequence 0 decodes its 50th token; sequence 1 prefills 100..150; sequence 2 0..70.
    chunks = [(0, 49, 50), (1, 100, 150), (2, 0, 70)]
    rows = sum(end - start for _, start, end in chunks)
    q = torch.randn(rows, heads, dim, generator=gen).bfloat16()
    k = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(rows, kv_heads, dim, generator=gen).bfloat16()
    slot_blocks, slot_offsets, prefills, row = [], [], [], 1
    for seq, start, end in chunks:
        slot_blocks += [tables[seq][p // bs].item() for p in range(start, end)]
        slot_offsets += [p % bs for p in range(start, end)]
        if seq:
            mask = causal_mask(start, end) if start else None
            prefills.append(PrefillSpan(row, end - start, end, tables[seq], mask))
            row += end - start
    meta = AttentionMetadata(
        slot_blocks=torch.tensor(slot_blocks),
        slot_offsets=torch.tensor(slot_offsets),
        num_decodes=1,
        decode_context_lens=[50],
        decode_blocks=tables[0].tolist(),
        block_size=bs,
        prefills=prefills,
    )
    results = []
    for backend in (CppPagedAttention, TorchPagedAttention):
        key_cache, value_cache = cache[0].clone(), cache[1].clone()
        results.append(backend(heads, kv_heads, dim).forward(q, k, v, key_cache, value_cache, meta))
    assert CppPagedAttention(heads, kv_heads, dim).prefill_kernel is kernel
    torch.testing.assert_close(results[0], results[1], rtol=TORCH_TOLERANCE, atol=TORCH_TOLERANCE)


def test_float32_chunks_stay_on_the_torch_path(kernel):
    keys, values, table = paged_case(90, 4, 2, 64, 32, seed=3, dtype=torch.float32)
    q = torch.randn(40, 4, 64, generator=torch.Generator().manual_seed(3))
    span = masked_span(40, 90, table)
    cpp = CppPagedAttention(4, 2, 64)._prefill(q, None, None, keys, values, span)
    torch_path = TorchPagedAttention(4, 2, 64)._prefill(q, None, None, keys, values, span)
    assert torch.equal(cpp, torch_path)


@pytest.mark.parametrize(
    ("table", "context", "message"),
    [
        ([0, 1, 99], 40, "block id 99 is outside the cache's 11 blocks"),
        ([0], 40, "40 keys need 3 blocks, the table has 1"),
        ([0, 1, 2], 10, "a chunk of 20 rows cannot end a context of 10 keys"),
    ],
)
def test_bad_inputs_are_refused_by_name(kernel, table, context, message):
    keys, values, _ = paged_case(120, 4, 2, 64, 16, seed=1)
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match=message):
        kernel.chunk_attention(q, keys, values, torch.tensor(table), context, 0.125, out)


def test_unknown_products_are_refused_by_name(kernel):
    keys, values, table = paged_case(20, 4, 2, 64, 16, seed=1)
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="products must be native, amx, dpbf16 or fma, not x"):
        kernel.chunk_attention(q, keys, values, table, 20, 0.125, torch.empty_like(q), "x")


def test_native_products_take_the_tiles_where_they_run_and_amx_is_refused_elsewhere(kernel):
    """Unnamed, the form is the tiles where they run (their bits), else a vector form (the
    vector forms' bits); asked for where they do not run, the tiles are refused by name."""
    keys, values, table = paged_case(100, 9, 3, 64, 16, seed=2)
    q = torch.randn(60, 9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = {}
    for products in ["native", *forms(kernel)]:
        outs[products] = torch.empty_like(q)
        kernel.chunk_attention(q, keys, values, table, 100, 0.125, outs[products], products)
    expected = "amx" if kernel.on_tiles() else "fma"
    assert torch.equal(outs["native"].view(torch.int16), outs[expected].view(torch.int16))
    if kernel.on_tiles():
        # Tile products round their sums their own way: the forms differ somewhere.
        assert not torch.equal(outs["amx"], outs["fma"])
    else:
        with pytest.raises(RuntimeError, match="products amx need AMX tiles"):
            kernel.chunk_attention(q, keys, values, table, 100, 0.125, outs["fma"], "amx")


def test_tiles_and_onednns_amx_matmuls_leave_each_other_correct(kernel):
    """Each sets the thread's tile configuration its own way: calls alternating on the same
    threads still give each one's own results."""
    if not kernel.on_tiles():
        pytest.skip("no AMX tiles here")
    keys, values, table = paged_case(300, 9, 3, 64, 16, seed=4)
    q = torch.randn(300, 9, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    a = torch.randn(200, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    b = torch.randn(576, 960, generator=torch.Generator().manual_seed(6)).bfloat16()
    first, again = torch.empty_like(q), torch.empty_like(q)
    kernel.chunk_attention(q, keys, values, table, 300, 0.125, first, "amx")
    product = a @ b
    kernel.chunk_attention(q, keys, values, table, 300, 0.125, again, "amx")
    assert torch.equal(first, again)
    torch.testing.assert_close((a @ b).float(), product.float())
    exact = a.double() @ b.double()
    torch.testing.assert_close(product.double(), exact, rtol=2e-2, atol=0.5)
