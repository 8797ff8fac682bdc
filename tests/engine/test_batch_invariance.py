"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same alone and in any
batch, at any position, with any prefill chunking (real SmolLM2 in bf16, tiny model in fp32)."""

import random

import pytest

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.layers.batch_invariant import RowTiledLinear
from deepwell.engine.models import registry

from .sliding_window import ARCHITECTURE, SlidingWindowLlama, write_sliding_window_llama

TARGET = "target"


@pytest.fixture(scope="module")
def smollm2() -> EngineCore:
    return EngineCore(
        EngineArgs(batch_invariant=True, memory_gib=2.0, max_model_len=512, block_size=32)
    )


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], budget: int):
    """Add the requests in order, step with this token budget; the target's tokens, logprobs."""
    core.scheduler.max_num_batched_tokens = budget
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    tokens, logprobs = [], []
    while core.has_unfinished():
        for output in core.step():
            if output.request_id == TARGET:
                tokens += output.new_token_ids
                logprobs += output.new_logprobs
    return tokens, logprobs


def trial(core: EngineCore, rng: random.Random, trial_id: int, max_neighbours: int) -> None:
    vocab = core.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(1, 70))]

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.getrandbits(64),
            ignore_eos=True,
            logprobs=True,
            top_logprobs=2,
        )

    target = (TARGET, prompt(), params(rng.randint(1, 6)))
    alone = run(core, [target], rng.randint(1, 80))
    neighbours = [
        (f"{trial_id}-{n}", prompt(), params(rng.randint(1, 6)))
        for n in range(rng.randint(0, max_neighbours))
    ]
    neighbours.insert(rng.randint(0, len(neighbours)), target)
    mixed = run(core, neighbours, rng.randint(1, 300))
    assert mixed == alone, f"trial {trial_id}: {len(neighbours) - 1} neighbours"


def test_request_alone_and_among_neighbours_gives_identical_tokens_and_logprobs(smollm2):
    rng = random.Random(0)
    for trial_id in range(4):
        trial(smollm2, rng, trial_id, max_neighbours=12)


@pytest.mark.slow
def test_request_alone_and_among_up_to_63_neighbours_in_200_trials(smollm2):
    rng = random.Random(1)
    for trial_id in range(200):
        trial(smollm2, rng, trial_id, max_neighbours=63)


def test_float32_rows_are_invariant_on_the_tiny_model(make_core):
    # float32 GEMMs change a row's reduction order with the row count; the tiles hide that.
    core = make_core(batch_invariant=True, max_num_seqs=64)
    rng = random.Random(2)
    for trial_id in range(10):
        trial(core, rng, trial_id, max_neighbours=40)


def test_the_environment_switch_turns_it_on(monkeypatch):
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "1")
    assert EngineArgs().batch_invariant
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "0")
    assert not EngineArgs().batch_invariant


def test_batch_invariant_core_tiles_every_linear(make_core):
    core = make_core(batch_invariant=True)
    model = core.runner.model
    linears = [m for m in model.modules() if isinstance(m, RowTiledLinear)]
    assert len(linears) == 1 + 4 * core.model_config.num_hidden_layers


def test_a_model_with_a_sliding_window_ring_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.MODELS, ARCHITECTURE, SlidingWindowLlama)
    path = write_sliding_window_llama(tmp_path)
    with pytest.raises(ValueError, match="paged KV only"):
        EngineCore(EngineArgs(model=str(path), dtype="float32", batch_invariant=True))


def test_batch_invariant_mode_does_not_speculate(make_core):
    assert make_core(batch_invariant=True).speculator is None
