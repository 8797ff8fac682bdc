"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same alone and in any
batch, at any position, with any prefill chunking (real SmolLM2 in bf16, tiny model in fp32,
tiny DeepSeek-V4.1 in fp32), with speculation on."""

import random

import pytest
from torch import nn

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.layers.batch_invariant import (
    AmxTileLinear,
    RowTiledLinear,
    RowwiseLinear,
    rowwise_kernel,
)
from deepwell.engine.models import registry
from deepwell.engine.models.deepseek_v41.writer import PRESETS, write_tiny_checkpoint

from .sliding_window import ARCHITECTURE, SlidingWindowLlama, write_sliding_window_llama

TARGET = "target"


@pytest.fixture(scope="module")
def smollm2() -> EngineCore:
    return EngineCore(
        EngineArgs(batch_invariant=True, memory_gib=2.0, max_model_len=512, block_size=32)
    )


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    """The tiny DeepSeek-V4.1 (window 8, compressed ratios 2 and 1, top-4 selection, Engram)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def v41_core(checkpoint, dtype: str) -> EngineCore:
    # Caches quantised as released.
    return EngineCore(
        EngineArgs(
            model=str(checkpoint),
            dtype=dtype,
            batch_invariant=True,
            max_model_len=512,
            block_size=16,
            memory_gib=0.5,
            max_num_seqs=64,
        )
    )


@pytest.fixture(scope="module")
def v41(v41_checkpoint) -> EngineCore:
    return v41_core(v41_checkpoint, "float32")


def run(
    core: EngineCore,
    requests: list[tuple[str, list[int], SamplingParams]],
    budget: int,
    tracked: tuple[str, ...] = (TARGET,),
):
    """Add the requests in order, step with this token budget; the tokens and logprobs of
    the tracked request (or, for several, of each)."""
    core.scheduler.max_num_batched_tokens = budget
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    results = {request_id: ([], []) for request_id in tracked}
    while core.has_unfinished():
        for output in core.step():
            if output.request_id in results:
                tokens, logprobs = results[output.request_id]
                tokens += output.new_token_ids
                logprobs += output.new_logprobs
    return results[TARGET] if tracked == (TARGET,) else results


def trial(
    core: EngineCore,
    rng: random.Random,
    trial_id: int,
    max_neighbours: int,
    num_neighbours: int | None = None,
    max_tokens: int = 6,
) -> None:
    """A target alone, then among neighbours (`num_neighbours`, or up to `max_neighbours`)
    of random lengths under a random token budget: some still prefill while it decodes."""
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

    target = (TARGET, prompt(), params(rng.randint(1, max_tokens)))
    alone = run(core, [target], rng.randint(1, 80))
    if num_neighbours is None:
        num_neighbours = rng.randint(0, max_neighbours)
    neighbours = [
        (f"{trial_id}-{n}", prompt(), params(rng.randint(1, max_tokens)))
        for n in range(num_neighbours)
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


@pytest.mark.parametrize("num_neighbours", [0, 1, 7, 63])
def test_v41_request_alone_and_among_neighbours_gives_identical_tokens_and_logprobs(
    v41, num_neighbours
):
    # Prompts up to 70 tokens cross the window (8), the top-4 selection and the candidate
    # pool; budgets from 1 token chunk them anywhere, beside decodes.
    rng = random.Random(10 + num_neighbours)
    for trial_id in range(1 if num_neighbours == 63 else 3):
        trial(v41, rng, trial_id, 63, num_neighbours=num_neighbours, max_tokens=4)


def test_v41_small_request_alone_and_among_7_neighbours(tmp_path_factory):
    # The small preset's widths (8 heads of 64, window 32, top-16) reach kernel paths the
    # tiny one's do not: with the plain sink attention kernel, trial 3 differs.
    path = tmp_path_factory.mktemp("small_v41")
    core = v41_core(
        write_tiny_checkpoint(path, seed=0, text_config=PRESETS["small"]).path, "float32"
    )
    rng = random.Random(0)
    for trial_id in range(4):
        trial(core, rng, trial_id, 63, num_neighbours=7, max_tokens=4)


def test_v41_in_bfloat16_is_invariant_too(v41_checkpoint):
    core = v41_core(v41_checkpoint, "bfloat16")
    rng = random.Random(5)
    for trial_id in range(2):
        trial(core, rng, trial_id, 63, num_neighbours=7, max_tokens=4)


@pytest.mark.slow
def test_v41_request_alone_and_among_up_to_63_neighbours_in_100_trials(v41):
    rng = random.Random(3)
    for trial_id in range(100):
        trial(v41, rng, trial_id, max_neighbours=63)


def test_the_environment_switch_turns_it_on(monkeypatch):
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "1")
    assert EngineArgs().batch_invariant
    monkeypatch.setenv("DEEPWELL_BATCH_INVARIANT", "0")
    assert not EngineArgs().batch_invariant


def test_batch_invariant_core_tiles_every_linear(make_core):
    core = make_core(batch_invariant=True)
    model = core.runner.model
    invariant = (RowTiledLinear, RowwiseLinear, AmxTileLinear)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 + 4 * core.model_config.num_hidden_layers
    assert all(isinstance(m, invariant) for m in linears)
    if rowwise_kernel(linears[0].weight) is not None:
        # A row-wise kernel serves this dtype: no call is padded to ROW_TILE rows.
        assert not any(isinstance(m, RowTiledLinear) for m in linears)


def test_a_ring_model_without_invariant_ring_layers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(
        registry.MODELS, ARCHITECTURE, registry.ModelEntry(ARCHITECTURE, SlidingWindowLlama)
    )
    path = write_sliding_window_llama(tmp_path)
    with pytest.raises(ValueError, match="batch-invariant ring layers"):
        EngineCore(EngineArgs(model=str(path), dtype="float32", batch_invariant=True))


# A model that has learned to copy continues it, so n-gram drafts keep coming.
REPEATED_TEXT = "one two three four five six seven eight nine ten, " * 3
# A sampled request with logprobs beside the target (a request asking for logprobs does
# not speculate): its logprobs stay the same among speculating neighbours.
WITNESS = "witness"


def speculating_trial(core: EngineCore, rng: random.Random, trial_id: int, neighbours: int):
    """A target on a repetitive prompt (n-gram drafts find matches) and a witness, alone,
    then among seeded neighbours, some speculating, some reporting logprobs; the target
    verified drafts alone."""

    def params(logprobs: bool, temperature: float) -> SamplingParams:
        return SamplingParams(
            max_tokens=rng.randint(8, 16),
            temperature=temperature,
            seed=rng.getrandbits(64),
            ignore_eos=True,
            logprobs=logprobs,
        )

    def repetitive() -> list[int]:
        tokens = [rng.randrange(core.vocab_size) for _ in range(rng.randint(2, 8))]
        return (tokens * 6)[: rng.randint(12, 48)]

    prompt = core.tokenizer.encode(REPEATED_TEXT).ids
    target = (TARGET, prompt[: rng.randint(len(prompt) // 2, len(prompt))], params(False, 0.0))
    witness = (WITNESS, repetitive(), params(True, 1.0))
    verified = core.speculator.stats().verified_tokens
    tracked = (TARGET, WITNESS)
    alone = run(core, [target, witness], rng.randint(16, 80), tracked)
    assert core.speculator.stats().verified_tokens > verified, "the target never speculated"
    assert alone[WITNESS][1], "the witness reported no logprobs"
    batch = [
        (f"{trial_id}-{n}", repetitive(), params(rng.random() < 0.5, rng.choice([0.0, 1.0])))
        for n in range(neighbours)
    ]
    for request in (target, witness):
        batch.insert(rng.randint(0, len(batch)), request)
    assert run(core, batch, rng.randint(16, 300), tracked) == alone, f"trial {trial_id}"


def speculating_core(request, model: str) -> EngineCore:
    core = request.getfixturevalue(model)
    assert core.speculator is not None, f"{model}: batch-invariant mode must keep speculating"
    return core


@pytest.mark.parametrize("model", ["smollm2", "v41"])
def test_speculation_stays_on_and_keeps_a_request_invariant(request, model):
    core = speculating_core(request, model)
    rng = random.Random(4)
    for trial_id, neighbours in enumerate([0, 1, 7]):
        speculating_trial(core, rng, trial_id, neighbours)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "v41"])
def test_speculation_keeps_a_request_invariant_among_up_to_63_neighbours(request, model):
    core = speculating_core(request, model)
    rng = random.Random(6)
    for trial_id in range(20):
        speculating_trial(core, rng, trial_id, rng.randint(1, 63))
