"""ModelRunner: every step samples float32 logits, a bf16 head's float32 sums, whatever its
requests read of them, and greedy tokens do not depend on what the other rows read."""

import torch

from deepwell.engine import SamplingParams

from .tiny_llama import run_to_completion

PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 40)), [9] * 12]


def logit_dtypes(core, params: list[SamplingParams]):
    """The dtypes of the logits the runner samples from, and the tokens per request."""
    seen = set()
    sample = core.runner.sample

    def recording(step, logits):
        if logits is not None:
            seen.add(logits.dtype)
        return sample(step, logits)

    core.runner.sample = recording
    for index, (prompt, request_params) in enumerate(zip(PROMPTS, params, strict=True)):
        core.add_request(str(index), prompt, request_params)
    return seen, run_to_completion(core)


def bf16_core(make_core):
    # No speculation: a step that verifies a draft reads its rows' probabilities.
    return make_core(dtype="bfloat16", num_speculative_tokens=0)


def test_every_step_samples_float32_logits_and_greedy_tokens_are_the_same_either_way(
    make_core,
):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    penalised = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, presence_penalty=1)
    drawn = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    dtypes, tokens = logit_dtypes(bf16_core(make_core), [greedy] * 3)
    assert dtypes == {torch.float32}
    dtypes, reference = logit_dtypes(bf16_core(make_core), [with_logprobs] * 3)
    assert dtypes == {torch.float32}
    assert tokens == reference
    for other in (penalised, drawn):
        dtypes, _ = logit_dtypes(bf16_core(make_core), [greedy, other, greedy])
        assert dtypes == {torch.float32}
