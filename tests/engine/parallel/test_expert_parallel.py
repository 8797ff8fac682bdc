"""Attention DP + MoE EP on gloo: greedy outputs of 2 and 4 ranks (each rank its own engine
and a quarter or half of the experts) equal one process's, with EPLB moving experts mid-run;
a killed rank stops the group with an error, not a hang."""

import multiprocessing
import random
import socket
import threading
import time

import pytest

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG, write_tiny_checkpoint
from deepwell.engine.parallel import ParallelConfig, ParallelError
from deepwell.engine.parallel.launch import generate_data_parallel

NUM_REQUESTS = 32
# float32 and batch-invariant: a request's bits do not depend on its rank's batch.
ENGINE = dict(
    dtype="float32",
    batch_invariant=True,
    block_size=16,
    memory_gib=0.5,
    max_model_len=256,
    num_threads=1,
    num_speculative_tokens=0,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # 16 experts, 2 per token: 8, 4 or 4+1 slots per rank.
    config = TINY_TEXT_CONFIG | dict(n_routed_experts=16)
    return str(
        write_tiny_checkpoint(tmp_path_factory.mktemp("v41_16"), seed=0, text_config=config).path
    )


@pytest.fixture(scope="module")
def batch():
    rng = random.Random(20)
    prompts = [
        [rng.randrange(3, 250) for _ in range(rng.randrange(2, 40))] for _ in range(NUM_REQUESTS)
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(4, 10), temperature=0, ignore_eos=True)
        for _ in range(NUM_REQUESTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def one_rank(checkpoint, batch) -> list[list[int]]:
    llm = LLM(checkpoint, **ENGINE, decode_sequence=False)
    prompts, params = batch
    completions = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [c.token_ids for c in completions]


def run_ranks(checkpoint, batch, **parallel):
    config = ParallelConfig(expert_parallel=True, master_port=free_port(), **parallel)
    return generate_data_parallel(EngineArgs(checkpoint, **ENGINE, parallel=config), *batch)


def test_two_expert_parallel_ranks_match_one_process(checkpoint, batch, one_rank):
    run = run_ranks(checkpoint, batch, data_parallel_size=2)
    assert [c.token_ids for c in run.completions] == one_rank
    # Both ranks computed expert pairs for the other: the exchange really ran.
    assert all(stats.computed_tokens > 0 and stats.exchange_s > 0 for stats in run.stats)
    # A token goes once to each rank holding some of its experts: fewer bytes out than one
    # row per (token, expert) pair, which the combine still returns (plus 16 route bytes).
    hidden = TINY_TEXT_CONFIG["hidden_size"]
    combined = sum(stats.combine_bytes for stats in run.stats)
    per_pair = combined // (4 * hidden) * (4 * hidden + 16)
    assert 0 < sum(stats.dispatch_bytes for stats in run.stats) < 0.9 * per_pair


def test_four_ranks_with_eplb_replacing_experts_mid_run_match_one_process(
    checkpoint, batch, one_rank
):
    run = run_ranks(
        checkpoint,
        batch,
        data_parallel_size=4,
        enable_eplb=True,
        eplb_window_steps=3,
        eplb_redundant_experts=4,
    )
    assert [c.token_ids for c in run.completions] == one_rank
    rebalances = run.stats[0].rebalances
    assert rebalances and sum(r.moved_experts for r in rebalances) > 0
    # Every rank re-placed at the same steps (each computes it from the all-reduced loads).
    assert all(stats.rebalances == rebalances for stats in run.stats)


@pytest.mark.slow
def test_four_expert_parallel_ranks_and_two_with_eplb_match_one_process(
    checkpoint, batch, one_rank
):
    run = run_ranks(checkpoint, batch, data_parallel_size=4)
    assert [c.token_ids for c in run.completions] == one_rank
    run = run_ranks(
        checkpoint,
        batch,
        data_parallel_size=2,
        enable_eplb=True,
        eplb_window_steps=2,
        eplb_redundant_experts=2,
    )
    assert [c.token_ids for c in run.completions] == one_rank


def test_a_killed_rank_stops_the_group_with_an_error(checkpoint, batch):
    def kill_a_rank_once_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = [p for p in multiprocessing.active_children() if p.name == "deepwell-rank-1"]
            if ranks:
                time.sleep(3.0)  # past loading (about 1 s), into the steps
                ranks[0].kill()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_rank_once_running)
    killer.start()
    started = time.monotonic()
    prompts, _ = batch
    # Long enough that the kill lands while the ranks step.
    long = [SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)] * len(prompts)
    with pytest.raises(ParallelError, match="rank 1 exited with code -9"):
        run_ranks(checkpoint, (prompts, long), data_parallel_size=2)
    killer.join()
    assert time.monotonic() - started < 60


def test_expert_parallel_on_a_model_without_experts_is_refused(tiny_llama, batch):
    config = ParallelConfig(data_parallel_size=2, expert_parallel=True)
    with pytest.raises(ModelLoadError, match="not a mixture-of-experts"):
        generate_data_parallel(EngineArgs(str(tiny_llama), parallel=config), *batch)


def test_expert_parallel_needs_more_than_one_rank():
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        ParallelConfig(expert_parallel=True)


def test_eplb_re_places_experts_under_a_forced_imbalance_and_not_under_forced_balance(
    checkpoint, batch, monkeypatch
):
    """DeepInfer's EPLB test switches (spec/deepinfer.md §1.4): one expert four times as hot
    as the mean loads the rank holding it, and EPLB replicates and moves experts to even the
    ranks; with every expert forced equally hot there is nothing to gain and nothing moves."""
    eplb = dict(data_parallel_size=2, enable_eplb=True, eplb_window_steps=2)
    monkeypatch.setenv("DEEPWELL_FORCE_IMBALANCE_RATIO", "4")
    rebalances = run_ranks(checkpoint, batch, eplb_redundant_experts=2, **eplb).stats[0].rebalances
    assert sum(r.moved_experts for r in rebalances) > 0
    first = rebalances[0]
    # Above the forced balance's bound below; how far depends on the tokens' own routing
    # (1.199 seen against a floor of 1.2 once), so a tighter floor reads a near-tie.
    assert first.imbalance_before > 1.1 and first.imbalance_after < first.imbalance_before
    monkeypatch.delenv("DEEPWELL_FORCE_IMBALANCE_RATIO")
    monkeypatch.setenv("DEEPWELL_FORCE_LOAD_BALANCE", "1")
    rebalances = run_ranks(checkpoint, batch, eplb_redundant_experts=0, **eplb).stats[0].rebalances
    assert rebalances and sum(r.moved_experts for r in rebalances) == 0
    assert all(r.imbalance_before < 1.1 for r in rebalances)
