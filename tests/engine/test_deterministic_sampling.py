"""Counter-based draws (spec/deepinfer.md §1.6): SplitMix64 uniforms, fp64 inverse CDF, seeds."""

import torch

from deepwell.engine import SamplingParams
from deepwell.engine.sampling import inverse_cdf, splitmix64, uniform

from .tiny_llama import run_to_completion

# Vigna's splitmix64.c from state 1234567: the first three outputs.
SPLITMIX64_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423]
GAMMA = 0x9E3779B97F4A7C15


def test_splitmix64_matches_the_reference_generator():
    outputs = [splitmix64((1234567 + i * GAMMA) % 2**64) for i in range(3)]
    assert outputs == SPLITMIX64_1234567


def test_uniform_at_position_zero_is_the_top_53_bits_of_splitmix64_of_the_seed():
    # Position 0, case 0 mixes nothing into the seed.
    assert uniform(1234567, 0) == (SPLITMIX64_1234567[0] >> 11) / 2**53


def test_uniforms_for_fixed_seeds_and_positions():
    assert uniform(0, 0) == 0.8833108082136426
    assert uniform(0, 1) == 0.8549627258159381
    assert uniform(0, 2) == 0.12029011264023204
    assert uniform(42, 7) == 0.27898193635640955
    assert uniform(2**64 - 1, 1000, case=1) == 0.6163293681476786
    assert uniform(42, 7, case=1) != uniform(42, 7)


def test_inverse_cdf_takes_the_first_token_past_u_times_total():
    probs = torch.tensor([[0.1, 0.0, 0.3, 0.6]] * 5)
    tokens = inverse_cdf(probs, [0.0, 0.05, 0.1, 0.39999, 0.5])
    assert tokens.tolist() == [0, 0, 2, 2, 3]


def test_zero_probability_tokens_are_never_chosen():
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 50, generator=gen)
    probs[torch.rand(64, 50, generator=gen) < 0.7] = 0.0
    probs[:, 0] = 0.0
    probs[:, -1] = 0.0
    draws = [uniform(seed, 3) for seed in range(62)] + [0.0, 1 - 2**-53]
    tokens = inverse_cdf(probs, draws)
    assert all(probs[row, token] > 0 for row, token in enumerate(tokens.tolist()))


def test_u_times_total_rounding_up_takes_the_last_token_with_mass():
    probs = torch.tensor([[0.25, 0.5, 0.25, 0.0]], dtype=torch.float64)
    assert inverse_cdf(probs, [1.0]).tolist() == [2]


def test_seeds_are_64_bit_and_other_ints_are_masked():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(seed=2**64 + 5).seed == 5


def test_a_request_without_seed_reports_the_random_seed_it_drew(make_core):
    # Batch-invariant, so the replay alone (and after a prefix hit) sees the same logits.
    core = make_core(batch_invariant=True)
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    core.add_request("a", list(range(3, 20)), params)
    core.add_request("b", list(range(3, 20)), params)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    seeds: dict[str, set[int]] = {"a": set(), "b": set()}
    while core.has_unfinished():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            seeds[output.request_id].add(output.seed)
    assert len(seeds["a"]) == len(seeds["b"]) == 1
    (seed_a,), (seed_b,) = seeds["a"], seeds["b"]
    assert seed_a != seed_b
    # Replaying a reported seed gives the same tokens.
    core.add_request("c", list(range(3, 20)), SamplingParams(**{**vars(params), "seed": seed_a}))
    assert run_to_completion(core)["c"] == tokens["a"]


def test_a_seeded_request_reports_its_own_seed(make_core):
    core = make_core()
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, seed=2**63 + 11))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert {o.seed for o in outputs} == {2**63 + 11}
