"""DeepInfer's sampling fields in the engine (spec/deepinfer.md §1.5): prompt logprobs, teacher
forcing and the first tokens without EOS, on the tiny Llama."""

import pytest
import torch

from deepwell.engine import LLM, SamplingParams

from .tiny_llama import TINY_CONFIG

EOS = TINY_CONFIG["eos_token_id"]
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 120, 64]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # 3-token steps: the prompt's rows are scored across several prefill chunks.
    with LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=16,
        memory_gib=0.25,
        max_model_len=256,
        max_num_batched_tokens=3,
        chunked_prefill=True,
        decode_sequence=False,
    ) as llm:
        yield llm


def generate(llm, prompt, **fields):
    (out,) = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(**fields), use_tqdm=False
    )
    return out


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_teacher_forced(llm):
    scored = generate(llm, PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2)
    forced = generate(
        llm, PROMPT[:1], max_tokens=len(PROMPT) - 1, golden_token_ids=PROMPT[1:], logprobs=True
    )
    assert forced.token_ids == PROMPT[1:]
    assert [e.token_id for e in scored.prompt_logprobs] == PROMPT[1:]
    torch.testing.assert_close(
        [e.logprob for e in scored.prompt_logprobs],
        [e.logprob for e in forced.logprobs],
        atol=1e-4,
        rtol=0,
    )
    assert all(len(e.top) == 2 for e in scored.prompt_logprobs)
    # Asked again: the prompt is computed again (no prefix hit), the same logprobs come back.
    again = generate(llm, PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert again.prompt_logprobs == scored.prompt_logprobs


def test_golden_tokens_lead_then_sampling_goes_on(llm):
    out = generate(
        llm, PROMPT, max_tokens=6, golden_token_ids=[7, 7, 7], seq_seed=3, ignore_eos=True
    )
    assert out.token_ids[:3] == [7, 7, 7] and len(out.token_ids) == 6


def test_first_n_tokens_cannot_be_eos(llm):
    forced_eos = {EOS: 100.0}
    assert generate(llm, PROMPT, max_tokens=5, temperature=0, logit_bias=forced_eos).token_ids == [
        EOS
    ]
    out = generate(
        llm,
        PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias=forced_eos,
        first_n_token_no_eos=2,
        eos_id=EOS,
    )
    assert EOS not in out.token_ids[:2] and out.token_ids[2] == EOS and len(out.token_ids) == 3
