"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) against transformers, in float32.

A tiny random checkpoint per family, loaded by both; logits of whole prompts and of
chunked prefill with decodes, and greedy continuations, must agree.
"""

import pytest
import torch

from deepwell.engine import LLM, SamplingParams

from .tiny_qwen import write_gguf, write_tiny_qwen

# Float32 on both sides; the Done-when bar of issue #17.
ATOL = 1e-4
ARCHITECTURES = ["Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    return write_tiny_qwen(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    # 8-token steps: prompts are prefilled in chunks, and batched ones share steps.
    return LLM(
        model=str(checkpoint),
        dtype="float32",
        max_num_batched_tokens=8,
        memory_gib=0.25,
        decode_sequence=False,
        chunked_prefill=True,
    )


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in lengths]


def greedy(llm: LLM, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
    return [output.token_ids for output in outputs]


def hf_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([sequence])).logits[0].float()


def test_logits_of_chunked_prefill_and_decodes_match_transformers(llm, hf_model, monkeypatch):
    """Every row the engine samples from (each prompt's last, then one per decode step)."""
    model = llm.core.runner.model
    rows: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(
        hidden: torch.Tensor, logit_rows: torch.Tensor | None = None, float32: bool = True
    ) -> torch.Tensor:
        # float32 even where the greedy step would take the head's dtype: compared below.
        logits = compute(hidden, logit_rows)
        rows.append(logits.clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    prompt = prompts([29], seed=1)[0]
    tokens = greedy(llm, [prompt], 12)[0]
    logits = torch.cat(rows)[-12:]
    expected = hf_logits(hf_model, prompt + tokens)[len(prompt) - 1 : -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)


def test_greedy_tokens_equal_transformers_alone_and_batched(llm, hf_model):
    batch = prompts([5, 19, 11], seed=2)
    batched = greedy(llm, batch, 16)
    for prompt, tokens in zip(batch, batched, strict=True):
        assert greedy(llm, [prompt], 16)[0] == tokens
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            reference = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
        assert tokens == reference[0, len(prompt) :].tolist()


# Slow: gguf's reader takes ~10 s over the 49k-token vocabulary on the shared test machine.
@pytest.mark.slow
def test_a_gguf_file_loads_the_same_model(checkpoint, llm, tmp_path):
    """llama.cpp's Qwen layout (biases, q/k norms, no rotary permutation) gives the same
    greedy tokens and log probabilities as the safetensors directory."""
    gguf_llm = LLM(
        model=str(write_gguf(checkpoint, tmp_path / "tiny.gguf")),
        dtype="float32",
        max_num_batched_tokens=8,
        memory_gib=0.25,
        decode_sequence=False,
        chunked_prefill=True,
    )
    assert gguf_llm.core.architecture == llm.core.architecture
    assert gguf_llm.core.chat_template == llm.core.chat_template
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    batch = prompts([9, 17], seed=4)
    for a, b in zip(
        llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False),
        gguf_llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False),
        strict=True,
    ):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top, strict=True)) < ATOL
