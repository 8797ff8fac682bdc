"""Top-k / top-p through the ranked prefix (engine/sampling.py `nucleus_logits`, the native
ranked_prefix and inverse_cdf) against the stable sort of the whole vocabulary it replaced,
kept here as the oracle, over random rows with heavy ties, tiny and huge temperatures and
masked tokens."""

import math

import pytest
import torch

from deepwell.engine.sampling import (
    Sampler,
    _native_sampling,
    _ranked_keep,
    filtered_probs,
    inverse_cdf,
    native_top_p_draw,
    ranked_prefix,
)

from .test_sampling import request

TOP_PS = (1e-6, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0)


def full_sort_filter(scaled, top_k, top_p, vocabulary_mass=False):
    """The sampler's filter before the ranked prefix, on one row alone: a stable descending
    sort of the whole vocabulary. With `vocabulary_mass`, a top-p row's mass is the softmax
    of the row in vocabulary order (as the ranked prefix reads it), not of the sorted row."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = top_k if 0 < top_k < vocab else vocab
    if vocabulary_mass and k == vocab and top_p >= 1:
        return scaled.softmax(dim=-1), None  # neither filter: the row as it is
    remove = torch.arange(vocab) >= k
    sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    if vocabulary_mass and k == vocab:
        sorted_probs = scaled.softmax(dim=-1)[order]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= torch.tensor(top_p, dtype=scaled.dtype)
    kept = scaled.scatter(0, order, sorted_logits.masked_fill(remove, float("-inf")))
    return kept.softmax(dim=-1), mass_before[torch.argsort(order)]


def random_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spread = [0.05, 1.0, 3.0, 8.0][seed % 4]
    logits = torch.randn(rows, vocab, generator=gen) * spread
    if seed % 3 == 0:
        logits = logits.bfloat16().float()  # bf16 logits: a few hundred distinct values
    if seed % 5 == 0:
        logits = (logits * 2).round() / 2  # heavier ties still
    if seed % 7 == 0:
        logits[:, ::11] = float("-inf")  # masked tokens (grammar, logit bias)
    return logits


CASES = [
    (seed, vocab, temperature)
    for seed, (vocab, temperature) in enumerate(
        [(v, t) for v in (8, 17, 1500, 4096) for t in (1e-5, 0.8, 1.0, 100.0)]
    )
]


@pytest.mark.parametrize(("seed", "vocab", "temperature"), CASES)
def test_the_kept_set_is_the_full_sorts(seed, vocab, temperature):
    logits = random_rows(seed, 24, vocab)
    gen = torch.Generator().manual_seed(1000 + seed)
    params = []
    for row in range(24):
        top_k = [-1, 1, 2, 16, 50, vocab - 1, vocab, vocab + 5][row % 8]
        top_p = TOP_PS[int(torch.randint(0, len(TOP_PS), (1,), generator=gen))]
        min_p = 0.05 if row % 5 == 0 else 0.0
        if top_k == -1 and top_p == 1.0:
            top_p = 0.9
        params.append({"top_k": top_k, "top_p": top_p, "min_p": min_p})
    requests = [request(seed=row, temperature=temperature, **p) for row, p in enumerate(params)]
    probs = filtered_probs(logits.clone(), requests)
    scaled = logits / torch.tensor(temperature, dtype=torch.float32)
    near_boundary = 0
    for row, p in enumerate(params):
        oracle, mass_before = full_sort_filter(scaled[row], p["top_k"], p["top_p"])
        by_mass = not 0 < p["top_k"] < vocab
        if by_mass:
            # The mass of the vocabulary's softmax, ranked: the same ranking and arithmetic.
            oracle_vocab, _ = full_sort_filter(scaled[row], p["top_k"], p["top_p"], True)
            oracle_vocab = floored(oracle_vocab, p["min_p"])
            assert torch.equal(probs[row], oracle_vocab), (row, p)
        oracle = floored(oracle, p["min_p"])
        if torch.equal(probs[row], oracle):
            continue
        # Only top-p alone may differ from the old sort's kept set, and only at tokens whose
        # float32 mass before them is within rounding of top_p.
        assert by_mass, (row, p)
        differ = (probs[row] > 0) != (oracle > 0)
        assert ((mass_before[differ] - p["top_p"]).abs() < 1e-6).all(), (row, p)
        near_boundary += 1
    assert near_boundary <= 2


def floored(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    if not min_p:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)


def test_wide_rows_of_tied_bf16_logits_keep_the_full_sorts_top_k_set_and_tie_order():
    logits = random_rows(3, 6, 49152)
    for top_k, top_p in ((1, 1.0), (40, 1.0), (40, 0.9), (1000, 0.95), (49151, 0.5)):
        requests = [
            request(seed=row, temperature=0.8, top_k=top_k, top_p=top_p) for row in range(6)
        ]
        probs = filtered_probs(logits.clone(), requests)
        for row in range(6):
            oracle, _ = full_sort_filter(logits[row] / torch.tensor(0.8), top_k, top_p)
            assert torch.equal(probs[row], oracle), (top_k, top_p, row)


@pytest.mark.skipif(not _native_sampling(), reason="the native sampling kernel is not built")
def test_ranked_prefix_is_the_stable_sorts_first_tokens():
    logits = random_rows(15, 8, 3000)
    logits[2] = 0.0  # every token tied: ids in order
    logits[3, :10] = 0.0
    logits[3, 5] = -0.0  # -0 ties with +0
    probs = logits.softmax(dim=-1)
    need_count = torch.tensor([1, 7, 3000, 20, 3000, 3000, 2999, 64])
    need_mass = torch.tensor([math.inf] * 4 + [0.5, 0.999, math.inf, 0.3], dtype=torch.float64)
    ids, counts = ranked_prefix(logits, probs, need_count, need_mass)
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    assert ids.shape[1] == int(counts.max())
    for row in range(8):
        count = int(counts[row])
        assert ids[row, :count].tolist() == order[row, :count].tolist()
        mass = probs[row, order[row, :count]].double().cumsum(0)
        reached = count >= need_count[row] or mass[-1] >= need_mass[row]
        assert reached or count == 3000
        # The shortest such prefix: one token fewer reaches neither.
        assert count == 1 or not (count - 1 >= need_count[row] or mass[-2] >= need_mass[row])
        assert (ids[row, count:] == ids[row, 0]).all()


@pytest.mark.skipif(not _native_sampling(), reason="the native sampling kernel is not built")
def test_a_row_with_nan_is_ranked_by_the_full_sort():
    logits = torch.randn(3, 100)
    logits[1, 40] = float("nan")
    ids, counts = ranked_prefix(
        logits, None, torch.tensor([5, 5, 5]), torch.full((3,), math.inf, dtype=torch.float64)
    )
    assert counts.tolist() == [100] * 3
    assert torch.equal(ids, logits.sort(dim=-1, descending=True, stable=True).indices)


@pytest.mark.skipif(not _native_sampling(), reason="the native sampling kernel is not built")
@pytest.mark.parametrize("seed", range(8))
def test_top_p_alone_keeps_in_one_native_pass_what_the_torch_ops_keep(seed):
    vocab = 4096
    scaled = random_rows(seed, 12, vocab) / torch.tensor(0.8)
    if seed == 4:
        scaled[5, 77] = float("nan")  # every row then ranked by the full sort
    probs = scaled.softmax(dim=-1)
    top_p = torch.tensor([TOP_PS[row % (len(TOP_PS) - 1)] for row in range(12)])
    # Rows 10 and 11: top_p exactly the float32 mass before a token, which then goes (>=).
    order = scaled.sort(dim=-1, descending=True, stable=True).indices
    for row, rank in ((10, 3), (11, 40)):
        ranked = probs[row, order[row]]
        top_p[row] = (ranked.cumsum(0) - ranked)[rank]
    need_mass = top_p.double() + 1e-4
    ids, counts = ranked_prefix(scaled, probs, torch.full((12,), vocab), need_mass)
    native = torch.ops.deepwell_sampling.top_p_keep(scaled, probs, ids, counts, top_p)
    reference = _ranked_keep(
        scaled, probs, ids, counts, torch.full((12,), vocab), [True] * 12, top_p
    )
    assert torch.equal(native.isnan(), reference.isnan())
    assert torch.equal(native.nan_to_num(), reference.nan_to_num())
    kept = (native > float("-inf")).sum(dim=1)
    assert kept.min() >= 1 and kept.max() < vocab
    assert native[10, order[10, 3]] == float("-inf") < native[10, order[10, 2]]


@pytest.mark.skipif(not _native_sampling(), reason="the native sampling kernel is not built")
@pytest.mark.parametrize("seed", range(10))
def test_the_native_top_p_draw_is_the_torch_ops_draw(seed):
    """Rows without top-k drawn in one native pass: the same token as filtered_probs and
    inverse_cdf for uniforms at random and right at the boundaries of the torch path's
    cumulative probabilities (where a probability off by one bit moves the draw)."""
    # Vocabularies in whole vectors, with a tail past them, and shorter than one.
    vocab = (4096, 49152, 1500, 17, 8)[seed % 5]
    rows = random_rows(seed, 5, vocab)
    if seed == 2:
        rows[3, 100] = float("nan")  # the torch path takes this row
    gen = torch.Generator().manual_seed(500 + seed)
    for row in range(5):
        params = {
            "temperature": (0.8, 1.0, 100.0, 0.3, 1e-5)[(row + seed) % 5],
            "top_p": TOP_PS[int(torch.randint(0, len(TOP_PS), (1,), generator=gen))],
            "min_p": 0.05 if (row + seed) % 3 == 0 else 0.0,
        }
        wanted = request(seed=row, **params)
        probs = filtered_probs(rows[row : row + 1].clone(), [wanted])[0]
        cumulative = probs.double().cumsum(0)
        total = float(cumulative[-1])
        with_mass = (probs > 0).nonzero().flatten()  # none in the NaN row
        uniforms = torch.rand(12, dtype=torch.float64, generator=gen).tolist()
        if len(with_mass):
            picks = with_mass[torch.randint(0, len(with_mass), (12,), generator=gen)]
            uniforms += [float(cumulative[k]) / total for k in picks.tolist()]
        uniforms += [0.0, 1.0 - 2.0**-53]
        count = len(uniforms)
        batch = rows[row : row + 1].expand(count, -1).contiguous()
        expected = inverse_cdf(probs.expand(count, -1).contiguous(), uniforms)
        drawn = native_top_p_draw(batch, [wanted] * count, uniforms)
        assert drawn.tolist() == expected.tolist(), (seed, row, params)


def test_the_native_inverse_cdf_draws_torchs_tokens():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 5000, generator=gen) ** 8
    probs[probs < 0.3] = 0.0  # sparse rows, as a nucleus leaves them
    probs[3] = 0.0
    probs[3, [7, 4000]] = 0.25
    probs[4] = 0.0  # no mass: the last token, as torch's search gives
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen).tolist()
    uniforms[:3] = [0.0, 1.0 - 2.0**-53, 0.5]
    # float64 probabilities take the torch path.
    assert torch.equal(inverse_cdf(probs, uniforms), inverse_cdf(probs.double(), uniforms))


def test_a_rows_filter_does_not_depend_on_a_top_p_neighbour():
    # The full sort put every sampled row through the nucleus when any row asked for one,
    # where a plain row's float32 mass reaching 1.0 dropped its tail.
    row = torch.tensor([30.0, 0.0, 1.0, -5.0] + [-1.0] * 60)
    plain = request(seed=5, temperature=1.0)
    alone = filtered_probs(row[None].clone(), [plain])
    batched = filtered_probs(torch.stack([row, row]), [request(seed=6, top_p=0.5), plain])
    assert torch.equal(batched[1], alone[0])
    assert (alone[0] > 0).all()


def test_seeded_w_like_rows_draw_the_same_tokens_as_the_full_sort_reference():
    logits = random_rows(3, 32, 4096)
    requests = [
        request(seed=row, temperature=0.8, top_p=0.95, top_k=[-1, 50][row % 2]) for row in range(32)
    ]
    tokens, _ = Sampler()(logits.clone(), requests)
    scaled = logits / torch.tensor(0.8)
    from deepwell.engine.sampling import uniform

    expected = []
    for row, r in enumerate(requests):
        oracle, _ = full_sort_filter(scaled[row], r.params.top_k, r.params.top_p)
        expected += inverse_cdf(oracle[None].double(), [uniform(r.seed, r.num_tokens)]).tolist()
    assert tokens == expected
    assert len(set(tokens)) > 8
