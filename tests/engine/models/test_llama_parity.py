"""The embedded SmolLM2 GGUF against transformers (loading the same GGUF offline).

float32: greedy tokens identical, each prompt alone and all batched with chunked prefill.
bfloat16: log-probabilities within a bound of the float32 reference.
"""

import os

import pytest
import torch

from deepwell.engine import LLM, SamplingParams
from deepwell.engine.models.loader import embedded_model_path

from .hf_gguf import fast_gguf_reads

PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The best way to learn a new language is",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans",
    "A good cup of coffee needs",
    "import numpy as np\n\nx = np.",
    "The three laws of thermodynamics state that",
    "Dear hiring manager, I am writing to",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "Machine learning models are trained by",
    "Here is a recipe for pancakes:\n1.",
    "The weather today is",
]


@pytest.fixture(scope="module")
def hf_model():
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    with fast_gguf_reads():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    # Generate exactly max_new_tokens, as ignore_eos does.
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def llm32():
    # 5-token steps: every prompt but the shortest is prefilled in chunks, even alone, and
    # in a batch the chunks share steps with other requests' decodes.
    return LLM(
        dtype="float32",
        max_num_batched_tokens=5,
        max_num_seqs=16,
        decode_sequence=False,
        chunked_prefill=True,
    )


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    ids = torch.tensor([prompt_ids])
    # An explicit mask: otherwise HF treats every <|im_end|> (SmolLM2's pad id) as padding.
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


def hf_argmax_along(model, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """HF's greedy choice after each prefix of prompt + tokens, in one forward pass.

    Equal to `tokens` exactly when HF's own greedy decoding would produce `tokens`.
    """
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0]
    return logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()


def encode_all(llm) -> list[list[int]]:
    return [llm.tokenizer.encode(p).ids for p in PROMPTS]


def generate(llm, prompts, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


def test_float32_greedy_matches_transformers_alone_and_batched_quick(hf_model, llm32):
    prompts = encode_all(llm32)[:4]
    batched = generate(llm32, prompts, 12)
    for prompt, tokens in zip(prompts, batched, strict=True):
        assert generate(llm32, [prompt], 12)[0] == tokens
        assert hf_argmax_along(hf_model, prompt, tokens) == tokens


@pytest.mark.slow
def test_float32_greedy_matches_transformers_generate_16_prompts_48_tokens(hf_model, llm32):
    prompts = encode_all(llm32)
    assert len(prompts) >= 16
    # All together: 32-token steps force chunked prefill mixed with decodes.
    batched = generate(llm32, prompts, 48)
    for prompt, tokens in zip(prompts, batched, strict=True):
        expected = hf_greedy(hf_model, prompt, 48)
        assert generate(llm32, [prompt], 48)[0] == expected
        assert tokens == expected


def test_bfloat16_logprobs_stay_close_to_float32_reference(hf_model):
    llm = LLM(
        dtype="bfloat16", max_num_batched_tokens=64, decode_sequence=False, chunked_prefill=True
    )
    prompts = [llm.tokenizer.encode(p).ids for p in PROMPTS[:4]]
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    worst = 0.0
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        for position, entry in enumerate(out.logprobs):
            for token, logprob in entry.top:
                worst = max(worst, abs(logprob - reference[position, token].item()))
            agree += entry.token_id == reference[position].argmax().item()
            total += 1
    print(
        f"bf16 vs float32: worst top-5 logprob difference {worst:.3f}, argmax agreement {agree}/{total}"
    )
    assert worst < 0.5, f"bf16 logprob differs from float32 by {worst:.3f}"
    assert agree / total >= 0.85
