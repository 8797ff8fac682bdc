"""Verification is lossless: emitted tokens follow the target distribution (chi-square over
many seeded draws), acceptance matches p(draft), greedy accepts the argmax run."""

import torch

from deepwell.engine import SamplingParams
from deepwell.engine.request import Request
from deepwell.engine.sampling import first_argmax
from deepwell.engine.speculative.verify import takes_batched_argmax, verify

from ..tiny_llama import run_to_completion

VOCAB = 12
DRAWS = 4000
# Chi-square critical value for 11 degrees of freedom at p = 0.001.
CHI2_11_P001 = 31.26


def _request(seed: int, **params) -> Request:
    sampling = SamplingParams(seed=seed, **params)
    return Request(
        "r", [1, 2, 3], sampling, frozenset(), torch.Generator().manual_seed(seed), seed=seed
    )


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_emitted_tokens_follow_the_target_distribution():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5
    probs = logits.softmax(dim=-1)
    draft = [int(probs[0].argmax()), int(probs[1].argmax())]
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    accepted_first = 0
    for seed in range(DRAWS):
        tokens = verify(logits, draft, _request(seed))
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            accepted_first += 1
            second[tokens[1]] += 1
    assert _chi_square(first, probs[0]) < CHI2_11_P001
    # Given an accepted first position, the next token follows row 1.
    assert _chi_square(second, probs[1]) < CHI2_11_P001
    # Acceptance of a point-mass draft is p(draft), the rejection-sampling optimum.
    rate = accepted_first / DRAWS
    assert abs(rate - probs[0, draft[0]].item()) < 4 * (rate * (1 - rate) / DRAWS) ** 0.5


def test_filters_apply_to_every_verify_row():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    top2 = [set(row.topk(2).indices.tolist()) for row in logits]
    for seed in range(200):
        tokens = verify(logits, [0, 1], _request(seed, top_k=2))
        assert all(t in top2[i] for i, t in enumerate(tokens))


def test_greedy_accepts_the_run_equal_to_the_argmax_then_adds_its_token():
    logits = torch.full((4, VOCAB), -1.0)
    logits[0, 5] = logits[1, 6] = logits[2, 9] = logits[3, 4] = 3.0
    greedy = _request(0, temperature=0)
    assert verify(logits, [5, 6, 7], greedy) == [5, 6, 9]
    assert verify(logits, [5, 6, 9], greedy) == [5, 6, 9, 4]
    assert verify(logits, [1, 6, 9], greedy) == [5]


def test_a_steps_batched_argmax_verifies_as_each_requests_own():
    """The runner takes one blocked argmax over every greedy verify row of a step: on tied
    maxima too (the first wins), each request accepts what its own rows' argmax accepts."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (40, 3000), generator=gen).float()
    targets = first_argmax(logits).tolist()
    assert targets == logits.argmax(dim=-1).tolist()
    greedy = _request(0, temperature=0)
    assert takes_batched_argmax(greedy) and not takes_batched_argmax(_request(0))
    for start in range(0, 40, 5):
        rows = logits[start : start + 5]
        for draft in (targets[start : start + 4], [targets[start], 7, 8, 9]):
            own = verify(rows, draft, greedy)
            assert verify(rows, draft, greedy, greedy_targets=targets[start : start + 5]) == own


def test_seeded_sampling_is_identical_with_speculation_on_and_off(make_core):
    prompts = [[7, 8, 9, 10] * 6, [20, 21, 22] * 5 + [20], list(range(30, 50))]

    def generate(k: int) -> tuple[dict[str, list[int]], int]:
        core = make_core(num_speculative_tokens=k)
        for index, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=index)
            core.add_request(f"r{index}", prompt, params)
        tokens = run_to_completion(core)
        return tokens, core.speculator.stats().verified_tokens if k else 0

    plain, _ = generate(0)
    # The planner weighs drafts against measured step times, so on a loaded box a run may
    # verify none and compare nothing: such a run is repeated, each one still compared.
    for _ in range(3):
        speculative, verified = generate(5)
        assert speculative == plain
        if verified:
            break
    assert verified > 0


def test_drafts_with_distributions_emit_the_target_distribution():
    """The speculative-sampling rule: whatever q drew the draft, the emitted token follows
    p, acceptance is Σ min(p, q), and the token after an accepted one follows the next row."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=generator) * 1.5
    probs = logits.softmax(dim=-1)
    # A draft distribution unlike the target's, with mass where p has little.
    q = (torch.randn(2, VOCAB, generator=generator) * 1.5).softmax(dim=-1)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    accepted_first = 0
    for seed in range(DRAWS):
        draft = torch.multinomial(q, 1, generator=generator).squeeze(1).tolist()
        tokens = verify(logits, draft, _request(seed), q)
        first[tokens[0]] += 1
        if tokens[0] == draft[0] and len(tokens) > 1:
            accepted_first += 1
            second[tokens[1]] += 1
    assert _chi_square(first, probs[0]) < CHI2_11_P001
    assert _chi_square(second, probs[1]) < CHI2_11_P001
    rate = accepted_first / DRAWS
    expected = torch.minimum(probs[0], q[0]).sum().item()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / DRAWS) ** 0.5


def test_a_draft_with_distributions_replays_for_its_seed():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    q = torch.full((3, VOCAB), 1 / VOCAB)
    runs = {tuple(verify(logits, [1, 2, 3], _request(seed), q)) for seed in (5, 5, 5)}
    assert len(runs) == 1
