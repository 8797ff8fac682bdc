"""Greedy output of the embedded SmolLM2 (float32) is identical with speculation on and off,
for prompts alone and in batch mixes; the KV pool is whole afterwards, aborts included."""

import pytest

from deepwell.engine import EngineArgs, EngineCore, SamplingParams

from ..tiny_llama import run_to_completion

TEXT = (
    "The committee met on Tuesday to review the budget. The committee agreed that the budget "
    "for the library would rise by ten percent, and that the budget for the parks would stay "
    "the same. The committee will meet again next month to review the budget for the schools."
)
PROMPTS = [
    f"<|im_start|>user\nSummarise this text:\n{TEXT}<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "The quick brown fox",
    "one two three four one two three four one two",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def cores():
    def make(k: int) -> EngineCore:
        return EngineCore(
            EngineArgs(
                dtype="float32",
                max_model_len=1024,
                block_size=16,
                memory_gib=1.0,
                num_speculative_tokens=k,
            )
        )

    return make(0), make(5)


def _generate(core: EngineCore, prompts: list[str], max_tokens: int) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        core.add_request(
            f"r{index}",
            core.tokenizer.encode(prompt).ids,
            SamplingParams(max_tokens=max_tokens, temperature=0),
        )
    tokens = run_to_completion(core)
    return [tokens[f"r{index}"] for index in range(len(prompts))]


@pytest.mark.parametrize(
    "batch",
    [
        [0, 1, 2, 3, 4],
        pytest.param([0], marks=pytest.mark.slow),
        pytest.param([1], marks=pytest.mark.slow),
        pytest.param([3], marks=pytest.mark.slow),
        pytest.param([4, 0, 3], marks=pytest.mark.slow),
    ],
    ids=lambda b: "-".join(map(str, b)),
)
def test_greedy_tokens_identical_with_speculation_on_and_off(cores, batch):
    off, on = cores
    prompts = [PROMPTS[i] for i in batch]
    assert _generate(on, prompts, 40) == _generate(off, prompts, 40)
    pool = on.kv.block_pool
    assert pool.num_free == pool.num_blocks


def test_speculation_accepts_drafts_on_repetitive_text(cores):
    _, on = cores
    before = on.speculator.stats()
    _generate(on, [PROMPTS[1]], 60)
    after = on.speculator.stats()
    assert after.accepted_tokens > before.accepted_tokens
    assert after.decode_steps - before.decode_steps < 60


def test_aborts_mid_speculation_leave_the_kv_pool_whole(cores):
    _, on = cores
    for index, prompt in enumerate(PROMPTS):
        on.add_request(
            f"a{index}",
            on.tokenizer.encode(prompt).ids,
            SamplingParams(max_tokens=50, temperature=0),
        )
    for _ in range(6):
        on.step()
    for index in range(0, len(PROMPTS), 2):
        on.abort(f"a{index}")
    run_to_completion(on)
    pool = on.kv.block_pool
    assert pool.num_free == pool.num_blocks
    assert not on.speculator._planned
