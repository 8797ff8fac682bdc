"""Sampler behaviour on hand-made logits, and sampling options end to end on the tiny model."""

import math

import pytest
import torch

from deepwell.engine import LLM, SamplingParams, sampling
from deepwell.engine.errors import InvalidRequestError
from deepwell.engine.request import Request
from deepwell.engine.sampling import Sampler, first_argmax

from .tiny_llama import run_to_completion

VOCAB = 8


def request(prompt=(1, 2, 3), output=(), **params) -> Request:
    sampling = SamplingParams(**params)
    seed = sampling.seed if sampling.seed is not None else 0
    r = Request(
        "r", list(prompt), sampling, frozenset(), torch.Generator().manual_seed(seed), seed=seed
    )
    r.token_ids += list(output)
    return r


def logits(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_takes_the_argmax():
    tokens, logprobs = Sampler()(logits([0, 1, 5, 2], [9, 1, 0, 0]), [request(temperature=0)] * 2)
    assert tokens == [2, 0] and logprobs == [None, None]


def test_greedy_takes_the_first_of_tied_maxima_in_a_wide_batch():
    torch.manual_seed(0)
    rows = torch.round(torch.randn(64, 49152) * 2) / 2  # many ties at each row's max
    rows[3] = float("-inf")
    rows[5, :1000] = rows[5].max()
    tokens, _ = Sampler()(rows.clone(), [request(temperature=0) for _ in range(64)])
    assert tokens == rows.argmax(dim=-1).tolist()
    assert tokens[3] == 0 and tokens[5] == 0


@pytest.fixture(params=["native", "torch"])
def argmax_path(request, monkeypatch):
    """first_argmax's native scan, or (as off the CPU) its blocked search in torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(sampling, "_native_sampling", lambda: False)
    else:
        assert sampling._native_sampling()
    return request.param


@pytest.mark.parametrize("num_rows", [5, 16], ids=["one-max", "blocked"])
@pytest.mark.parametrize("vocab", [3, 17, 1024, 1025, 3000, 49152, 151936])
def test_first_argmax_is_argmax_across_blocks_and_a_short_last_block(vocab, num_rows, argmax_path):
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.round(torch.randn(num_rows, vocab, generator=gen) * 2) / 2
    top = rows.max() + 1
    rows[1, -1] = top  # the maximum in the last, maybe short, block
    rows[2, vocab // 2 :] = top  # tied maxima over several blocks: the first one wins
    rows[3] = float("-inf")
    rows[4, 0] = rows[4, vocab - 1] = top
    assert first_argmax(rows).tolist() == rows.argmax(dim=-1).tolist()
    assert first_argmax(rows)[[1, 3, 4]].tolist() == [vocab - 1, 0, 0]


def test_first_argmax_takes_a_rows_first_nan_and_ties_minus_zero_with_zero(argmax_path):
    rows = torch.full((3, 100), float("-inf"))
    rows[0, [7, 40, 90]] = float("nan")
    rows[0, 3] = 1.0
    rows[1, 20], rows[1, 60] = -0.0, 0.0
    rows[2, 20], rows[2, 99] = 0.0, float("nan")
    assert first_argmax(rows).tolist() == rows.argmax(dim=-1).tolist() == [7, 20, 99]


def test_first_argmax_reads_rows_with_a_stride():
    wide = torch.randn(6, 3000)
    rows = wide[::2, :2048]
    assert first_argmax(rows).tolist() == rows.argmax(dim=-1).tolist()


def test_top_k_one_top_p_tiny_and_min_p_one_all_reduce_to_the_argmax():
    row = [0.5, 2.0, 1.9, -1.0]
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for seed in range(20):
            tokens, _ = Sampler()(logits(row), [request(seed=seed, **params)])
            assert tokens == [1], params


def test_top_k_one_and_top_p_tiny_keep_greedys_token_among_tied_maxima():
    # Ties at the top, as bf16 logits make them: greedy takes the first, and so must top-k 1
    # and top-p whatever the seed (a sort that is not stable may rank the later one first).
    torch.manual_seed(0)
    rows = torch.round(torch.randn(16, 49152) * 2) / 2
    greedy = rows.argmax(dim=-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        for seed in range(4):
            requests = [request(seed=seed, temperature=1.5, **params) for _ in range(16)]
            assert Sampler()(rows.clone(), requests)[0] == greedy, params


def test_top_k_keeps_only_the_k_best():
    row = [3.0, 2.9, 2.8, -5.0, 2.7]
    seen = {Sampler()(logits(row), [request(seed=s, top_k=2)])[0][0] for s in range(60)}
    assert seen == {0, 1}


def test_top_k_past_the_vocabulary_keeps_all_of_it_even_beyond_64_bits():
    row = [1.0, 1.0, 1.0, 1.0, 1.0]
    for top_k in (6, 2**63, 2**70):
        seen = {Sampler()(logits(row), [request(seed=s, top_k=top_k)])[0][0] for s in range(80)}
        assert seen == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2 → top_p 0.7 keeps the first two
    row = [math.log(0.5), math.log(0.3), math.log(0.2)]
    seen = {Sampler()(logits(row), [request(seed=s, top_p=0.7)])[0][0] for s in range(80)}
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    row = [math.log(0.6), math.log(0.3), math.log(0.1)]
    seen = {Sampler()(logits(row), [request(seed=s, min_p=0.4)])[0][0] for s in range(80)}
    assert seen == {0, 1}


def test_seeded_sample_does_not_depend_on_batch_neighbours():
    row = [0.1 * i for i in range(VOCAB)]
    alone = [Sampler()(logits(row), [request(seed=s, temperature=1.5)])[0][0] for s in range(10)]
    batched = [
        Sampler()(
            logits([5.0] * VOCAB, row, row[::-1]),
            [request(temperature=0), request(seed=s, temperature=1.5), request(seed=99)],
        )[0][1]
        for s in range(10)
    ]
    assert alone == batched
    assert len(set(alone)) > 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 0 is seen with a positive logit, token 1 seen with a negative one.
    row = [2.0, -1.0, 1.5, -1.2]
    r = request(prompt=(0, 1), repetition_penalty=2.0, temperature=0)
    tokens, _ = Sampler()(logits(row), [r])
    assert tokens == [2]  # 2.0 → 1.0 drops below 1.5


def test_presence_and_frequency_penalties_count_only_output_tokens():
    row = [3.0, 2.5, 0.0]
    in_prompt = request(prompt=(0, 0, 0), frequency_penalty=1.0, temperature=0)
    assert Sampler()(logits(row), [in_prompt])[0] == [0]
    in_output = request(output=(0,), frequency_penalty=1.0, temperature=0)
    assert Sampler()(logits(row), [in_output])[0] == [1]
    presence = request(output=(0, 0), presence_penalty=0.6, temperature=0)
    assert Sampler()(logits(row), [presence])[0] == [1]


def test_logprobs_are_the_raw_distribution_with_top_alternatives():
    row = [1.0, 3.0, 2.0, 0.0]
    r = request(temperature=0, logprobs=True, top_logprobs=2)
    tokens, (lp,) = Sampler()(logits(row), [r])
    expected = torch.log_softmax(logits(row), -1)[0]
    assert tokens == [1] and lp.token_id == 1
    assert math.isclose(lp.logprob, expected[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert math.isclose(lp.top[1][1], expected[2].item(), rel_tol=1e-6)


def test_max_tokens_stop_ids_and_ignore_eos_end_requests(make_core):
    core = make_core()
    prompt = list(range(3, 40))
    core.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    first = run_to_completion(core)["free"]
    assert len(first) == 12
    stop_at = first[4]
    core.add_request(
        "stopped", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at])
    )
    stopped = run_to_completion(core)["stopped"]
    assert stopped == first[: first.index(stop_at) + 1]


def test_eos_ends_a_request_unless_ignore_eos(make_core):
    core = make_core()
    eos = 2
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0))
    core.add_request("b", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    out = run_to_completion(core)
    assert eos not in out["a"][:-1]
    assert len(out["b"]) == 50
    if eos in out["b"]:
        assert out["a"] == out["b"][: out["b"].index(eos) + 1]


def test_seeded_requests_repeat_exactly_and_logprobs_flow_through(make_core):
    core = make_core()
    params = SamplingParams(
        max_tokens=16, temperature=0.9, top_p=0.9, seed=7, logprobs=True, top_logprobs=3
    )
    core.add_request("x", list(range(3, 20)), params)
    core.add_request("noise", list(range(30, 60)), SamplingParams(max_tokens=9, seed=1))
    x, logprobs = [], []
    while core.has_unfinished():
        for output in core.step():
            if output.request_id == "x":
                x += output.new_token_ids
                logprobs += output.new_logprobs
    assert [lp.token_id for lp in logprobs] == x
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in logprobs)
    core.add_request("y", list(range(3, 20)), params)
    assert run_to_completion(core)["y"] == x


def test_logit_bias_forces_and_bans_tokens():
    row = [3.0, 2.0, 1.0, 0.0]
    forced = request(temperature=0, logit_bias={3: 100.0})
    assert Sampler()(logits(row), [forced])[0] == [3]
    banned = request(temperature=0, logit_bias={0: -100.0})
    assert Sampler()(logits(row), [banned])[0] == [1]
    # A sampled request draws from the biased distribution too: token 3 wins every draw.
    for seed in range(10):
        assert Sampler()(logits(row), [request(seed=seed, logit_bias={3: 100.0})])[0] == [3]


def test_min_tokens_masks_stop_ids_until_reached():
    row = [5.0, 1.0, 0.0]
    early = request(temperature=0, min_tokens=2, output=(1,))
    early.stop_token_ids = frozenset({0})
    assert Sampler()(logits(row), [early])[0] == [1]
    reached = request(temperature=0, min_tokens=2, output=(1, 1))
    reached.stop_token_ids = frozenset({0})
    assert Sampler()(logits(row), [reached])[0] == [0]


def test_bad_logit_bias_and_min_tokens_are_refused():
    for params in (
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"min_tokens": 17},
        {"min_tokens": -1},
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(max_tokens=16, **params)


def test_min_tokens_outlasts_eos_and_bias_outside_the_vocabulary_is_refused(make_core):
    core = make_core()
    eos = 2
    # The bias makes EOS the greedy choice; min_tokens holds it off for 6 tokens.
    params = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=6)
    core.add_request("held", [5, 6, 7], params)
    held = run_to_completion(core)["held"]
    assert len(held) == 7 and held[-1] == eos and eos not in held[:-1]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        core.add_request("bad", [5, 6], SamplingParams(logit_bias={10**9: 1.0}))


def direct_sum_smaller(probs: list[float], token: int) -> float:
    """DeepInfer's COMPUTE_SUM_SMALLER_PROBS, computed plainly: the mass of every token no
    more likely than the chosen one."""
    return math.fsum(p for p in probs if p <= probs[token])


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0),
        dict(temperature=1.0, seed=3),
        dict(temperature=0.7, top_k=5, seed=4),
        dict(temperature=1.3, top_p=0.8, seed=5),
        dict(temperature=1.0, min_p=0.2, seed=6),
    ],
)
def test_sum_smaller_probs_matches_a_direct_computation_on_recorded_logits(params):
    recorded = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)) * 3
    requests = [request(**params) for _ in range(3)]
    sampled = Sampler().sample(recorded.clone(), requests, sum_smaller=True)
    assert sampled.token_ids == Sampler()(recorded.clone(), requests)[0]
    sums = sampled.sum_smaller_probs
    for row, token, total in zip(recorded, sampled.token_ids, sums, strict=True):
        # The distribution the token was chosen from, by hand: temperature (1 for greedy),
        # then top-k, top-p over the sorted tokens, min-p, renormalised.
        scaled = (row.double() / (params["temperature"] or 1.0)).tolist()
        order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
        keep = set(order[: params.get("top_k") or len(order)])
        peak = max(scaled)
        weights = {i: math.exp(scaled[i] - peak) for i in keep}
        if "top_p" in params:
            norm, mass, kept = sum(weights.values()), 0.0, set()
            for i in order:
                if i in keep and mass < params["top_p"]:
                    kept.add(i)
                    mass += weights[i] / norm
            keep = kept
        probs = [weights[i] if i in keep else 0.0 for i in range(len(scaled))]
        if "min_p" in params:
            probs = [p if p >= params["min_p"] * max(probs) else 0.0 for p in probs]
        probs = [p / sum(probs) for p in probs]
        assert probs[token] > 0
        assert total == pytest.approx(direct_sum_smaller(probs, token), abs=1e-6)


def test_sum_smaller_probs_is_off_unless_asked():
    assert (
        Sampler().sample(logits([0, 1, 5, 2]), [request(temperature=0)]).sum_smaller_probs is None
    )


@pytest.mark.parametrize("speculative", [0, 3])
def test_every_new_token_carries_its_sum_of_smaller_probs_with_the_switch(
    make_core, monkeypatch, speculative
):
    """End to end: with DEEPWELL_COMPUTE_SUM_SMALLER_PROBS each token gets a sum. Without
    drafts every token is drawn at temperature 1 from the raw distribution, whose full
    logprobs the request records, so the sum is computed again from them; with n-gram
    drafts (greedy, so that they get accepted) each verified token gets its own."""
    monkeypatch.setenv("DEEPWELL_COMPUTE_SUM_SMALLER_PROBS", "1")
    core = make_core(num_speculative_tokens=speculative, speculative_method="ngram")
    # A repeating prompt: n-gram drafts are proposed and verified.
    prompt = [5, 6, 7, 8] * 4
    if speculative:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    else:
        params = SamplingParams(
            max_tokens=12, temperature=1.0, seed=11, logprobs=True, top_logprobs=320
        )
    core.add_request("r", prompt, params)
    tokens, logprobs, sums, per_step = [], [], [], []
    while core.has_unfinished():
        for output in core.step():
            tokens += output.new_token_ids
            logprobs += output.new_logprobs
            sums += output.new_sum_smaller_probs
            per_step.append(len(output.new_token_ids))
    assert len(sums) == len(tokens) == params.max_tokens
    assert all(0 < s <= 1 + 1e-6 for s in sums)
    if speculative:
        assert max(per_step) > 1  # an accepted draft
    else:
        for step, total in zip(logprobs, sums, strict=True):
            probs = [0.0] * 320
            for token, logprob in step.top:
                probs[token] = math.exp(logprob)
            assert total == pytest.approx(direct_sum_smaller(probs, step.token_id), abs=1e-5)
    core.close()
    monkeypatch.delenv("DEEPWELL_COMPUTE_SUM_SMALLER_PROBS")
    core = make_core(num_speculative_tokens=speculative, speculative_method="ngram")
    core.add_request("r", prompt, params)
    while core.has_unfinished():
        assert all(not o.new_sum_smaller_probs for o in core.step())
    core.close()


def test_the_offline_api_carries_the_sums_on_its_completions(tiny_llama, monkeypatch):
    monkeypatch.setenv("DEEPWELL_COMPUTE_SUM_SMALLER_PROBS", "1")
    with LLM(str(tiny_llama), dtype="float32", memory_gib=0.25, decode_sequence=False) as llm:
        (completion,) = llm.generate(
            prompt_token_ids=[[5, 6, 7]],
            sampling_params=SamplingParams(max_tokens=6, seq_seed=1, ignore_eos=True),
            use_tqdm=False,
        )
    assert len(completion.sum_smaller_probs) == len(completion.token_ids) == 6
    assert all(0 < s <= 1 + 1e-6 for s in completion.sum_smaller_probs)
