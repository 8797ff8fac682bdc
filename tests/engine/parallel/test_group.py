"""The process group: a rank that dies fails its peers' next collective with a ParallelError
that says so, within a bounded time; a bad configuration is refused before anyone waits."""

import multiprocessing
import os
import socket
import time

import pytest

from deepwell.engine.parallel import ParallelConfig, ParallelError
from deepwell.engine.parallel.group import init_group
from deepwell.engine.parallel.lockstep import StepGate

TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_then_step(rank: int, port: int, errors) -> None:
    config = ParallelConfig(2, True, rank=rank, master_port=port, timeout_s=TIMEOUT_S)
    group = init_group(config)
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank is
    gate = StepGate(group, [], None)
    started = time.monotonic()
    try:
        while True:
            gate.agree(True, True)
    except ParallelError as error:
        errors.put((str(error), time.monotonic() - started))


def test_a_dead_peer_fails_the_next_collective_with_a_clear_error():
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    port = free_port()
    ranks = [context.Process(target=join_then_step, args=(r, port, errors)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        message, waited = errors.get(timeout=TIMEOUT_S + 30)
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert "rank 0: the step agreement collective failed" in message
    assert "group is broken" in message
    assert waited <= TIMEOUT_S + 5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(data_parallel_size=4, nnodes=3), "multiple of nnodes"),
        (dict(data_parallel_size=2, enable_eplb=True), "needs expert_parallel"),
        (
            dict(data_parallel_size=2, expert_parallel=True, enable_eplb=True, eplb_min_gain=-1),
            "eplb_min_gain must be >= 0",
        ),
        (
            dict(data_parallel_size=2, expert_parallel=True, eplb_redundant_experts=2),
            "needs enable_eplb",
        ),
        (dict(data_parallel_size=2, rank=2), r"rank must be in \[0, 2\)"),
    ],
)
def test_configurations_that_cannot_run_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_torchrun_environment_sets_rank_world_and_rendezvous():
    environ = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    config = ParallelConfig.from_torchrun({"expert_parallel": True}, environ)
    assert (config.rank, config.world_size, config.master_addr, config.master_port) == (
        3,
        4,
        "10.0.0.1",
        1234,
    )
    assert config.expert_parallel
    assert ParallelConfig.from_torchrun({}, {}) is None
    with pytest.raises(ValueError, match="disagrees with torchrun's WORLD_SIZE 4"):
        ParallelConfig.from_torchrun({"data_parallel_size": 2}, environ)
