"""DeepInfer's `seq_seed` (spec/deepinfer.md §1.5, §1.6): with the same logits and seed, the
sampler draws the tokens of the spec's reference function, token for token.

The reference below is written from the spec's text alone (not from engine/sampling.py):
u = SplitMix64(seq_seed + (s ^ (s << 13))), s = (3 * position + case) * 0x9E3779B97F4A7C15,
top 53 bits; the token is the first whose float64 cumulative probability exceeds u * total.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.request import Request
from deepwell.engine.sampling import Sampler

from .tiny_llama import TINY_CONFIG

MASK = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
# The tiny Llama's log-softmax rows (logits up to a constant) over a 25-token prompt.
RECORDED = json.loads((Path(__file__).parent / "data" / "seq_seed_logits.json").read_text())
SEEDS = (0, 1, 12345, 0xDEADBEEF12345678, MASK)


def splitmix64_reference(state: int) -> int:
    z = (state + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def random_sampling_reference(probs: list[float], seq_seed: int, position: int, case: int = 0):
    s = ((3 * position + case) * GOLDEN) & MASK
    u = (splitmix64_reference((seq_seed + (s ^ ((s << 13) & MASK))) & MASK) >> 11) / 2**53
    total = 0.0
    for p in probs:
        total += p
    target = u * total
    cumulative = 0.0
    for index, p in enumerate(probs):
        cumulative += p
        if cumulative > target:
            return index
    return max(i for i, p in enumerate(probs) if p > 0)


def reference_probs(logits: list[float], temperature: float) -> list[float]:
    """DeepInfer's distribution: softmax(logits / T) in float32, summed in float64."""
    row = torch.tensor(logits, dtype=torch.float32) / temperature
    return row.softmax(-1).double().tolist()


def request_at(position: int, params: SamplingParams) -> Request:
    """A request whose next token takes `position` in its sequence."""
    return Request(
        request_id="r",
        prompt_token_ids=[0] * position,
        params=params,
        stop_token_ids=frozenset(),
        generator=torch.Generator(),
        seed=params.seed,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-6])
def test_seq_seed_draws_the_reference_tokens_on_recorded_logits(temperature):
    logits = torch.tensor(RECORDED["logits"], dtype=torch.float32)
    # Below 1e-5 DeepInfer samples at 1e-5 (§1.5).
    effective = max(temperature, 1e-5)
    drawn, expected = [], []
    for seed in SEEDS:
        params = SamplingParams(seq_seed=seed, temperature=temperature)
        requests = [request_at(40 + 7 * row, params) for row in range(len(logits))]
        tokens, _ = Sampler()(logits.clone(), requests)
        drawn += tokens
        expected += [
            random_sampling_reference(reference_probs(row, effective), seed, 40 + 7 * index)
            for index, row in enumerate(RECORDED["logits"])
        ]
    assert drawn == expected
    if temperature == 1.0:
        # The draws are not just the argmax: the test would see a wrong formula.
        argmax = [max(range(len(row)), key=row.__getitem__) for row in RECORDED["logits"]]
        assert sum(t != a for t, a in zip(drawn, argmax * len(SEEDS), strict=True)) > 20


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from .tiny_llama import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("seq_seed"))
    with LLM(
        str(path),
        dtype="float32",
        block_size=16,
        memory_gib=0.25,
        max_model_len=256,
        decode_sequence=False,
    ) as llm:
        yield llm


def test_generated_tokens_follow_the_reference_formula_token_for_token(tiny_llm):
    vocab = TINY_CONFIG["vocab_size"]
    prompt = [5, 17, 99, 3, 250, 41]
    params = SamplingParams(max_tokens=16, seq_seed=2**63 + 11, ignore_eos=True, top_logprobs=vocab)
    (first,) = tiny_llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    (again,) = tiny_llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert again.token_ids == first.token_ids
    expected = []
    for index, step in enumerate(first.logprobs):
        # top_logprobs over the whole vocabulary: the model's full distribution at that step.
        probs = [0.0] * vocab
        for token, logprob in step.top:
            probs[token] = math.exp(logprob)
        expected.append(random_sampling_reference(probs, 2**63 + 11, len(prompt) + index))
    assert first.token_ids == expected
