"""A context-parallel group whose rank dies, leaves mid-prefill or cannot start ends with a
clear ContextParallelError, never a hang; settings it cannot run are refused up front."""

import os
import signal
import time

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.models.deepseek_v41.context_parallel import SequenceCaches
from deepwell.engine.parallel import ParallelConfig
from deepwell.engine.parallel.context_group import ContextGroup, ContextParallelError


def _leave_after_the_tokens(rank, address) -> None:
    """A follower that takes the first prefill's tokens, then exits without computing."""
    group = ContextGroup.connect(rank, address)
    group.join()
    group.receive()
    os._exit(0)


def _fail_while_loading(rank, address) -> None:
    raise RuntimeError("this follower cannot load its model")


def two_rank_core(checkpoint, **kwargs) -> EngineCore:
    args = dict(
        model=str(checkpoint),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        memory_gib=0.25,
        num_speculative_tokens=0,
        context_parallel_size=2,
    )
    return EngineCore(EngineArgs(**(args | kwargs)))


def test_a_killed_follower_is_a_clear_error(checkpoint):
    core = two_rank_core(checkpoint)
    try:
        (follower,) = core.context_parallel.group.followers
        os.kill(follower.pid, signal.SIGKILL)
        follower.join()
        core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=2))
        with pytest.raises(ContextParallelError, match=r"rank 1 \(pid \d+, exit code -9\)"):
            while core.has_unfinished():
                core.step()
    finally:
        started = time.monotonic()
        core.close()
        assert time.monotonic() - started < 5


def test_a_rank_leaving_mid_prefill_is_a_clear_error():
    group = ContextGroup.launch(2, _leave_after_the_tokens)
    try:
        group.announce(torch.arange(20), 0)
        started = time.monotonic()
        with pytest.raises(ContextParallelError, match="rank 1 .* exited|stopped answering"):
            group.all_gather(torch.zeros(4, 8))
        assert time.monotonic() - started < 30
        # The group stays down: the next prefill fails at once.
        with pytest.raises(ContextParallelError):
            group.announce(torch.arange(20), 0)
    finally:
        group.close()


def test_a_follower_that_cannot_start_is_a_clear_error():
    with pytest.raises(ContextParallelError, match="rank 1 .* exited with code 1 while starting"):
        ContextGroup.launch(2, _fail_while_loading)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"context_parallel_size": 0}, "context_parallel_size must be >= 1"),
        (
            {"context_parallel_size": 2, "yoco_prefill_truncation_mode": "mask"},
            "truncation_mode 'off'",
        ),
        ({"context_parallel_min_tokens": 0}, "context_parallel_min_tokens must be positive"),
        (
            {"context_parallel_size": 2, "parallel": ParallelConfig(data_parallel_size=2)},
            "does not combine with data or expert parallelism",
        ),
    ],
)
def test_settings_context_parallelism_cannot_run_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**settings)


def test_a_model_without_context_parallel_support_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="DeepSeek-V4.1 checkpoints only"):
        EngineCore(
            EngineArgs(
                model=str(tiny_llama),
                dtype="float32",
                block_size=16,
                memory_gib=0.25,
                context_parallel_size=2,
            )
        )


def test_a_prefill_failing_on_rank_0_takes_the_group_down_without_a_hang(checkpoint, monkeypatch):
    core = two_rank_core(checkpoint, async_scheduling=False)
    (follower,) = core.context_parallel.group.followers

    def fail(*args):
        raise MemoryError("rank 0 ran out of memory mid-prefill")

    try:
        with monkeypatch.context() as patch:
            patch.setattr(SequenceCaches, "write_window", fail)
            core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=2))
            with pytest.raises(MemoryError):
                core.step()
        # The follower is inside a collective rank 0 left: no later prefill may start.
        with pytest.raises(ContextParallelError, match="stopped on rank 0 .*MemoryError"):
            core.context_parallel.group.announce(torch.arange(20), 0)
    finally:
        started = time.monotonic()
        core.close()
        assert time.monotonic() - started < 5
    assert not follower.is_alive()
