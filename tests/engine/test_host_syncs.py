"""No host synchronisation inside the layer loop: a decode step's model forward reads no
tensor value on the host (tests/engine/host_reads.py counts every such torch call made from
deepwell code), on the tiny Llama and a tiny V4.1 with its released MXFP4 experts, eager and
as a decode-graph step; the expanded experts' per-expert loop is the known exception, and the
counter sees it."""

import pytest

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.decode_graphs import DecodeGraphs, EagerReplay, capture_sizes
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from .host_reads import HostReads


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def decode_reads(core: EngineCore) -> HostReads:
    """Host reads in the model forward of two decode steps of three requests."""
    for index in range(3):
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        core.add_request(f"r{index}", [5 + index, 9, 13, 20 + index], params)
    core.step()
    core.step()
    runner, reads = core.runner, HostReads()
    forward = runner._forward_model

    def counted(*inputs):
        with reads:
            return forward(*inputs)

    runner._forward_model = counted
    core.step()
    core.step()
    return reads


def v41_core(checkpoint, **settings) -> EngineCore:
    args = dict(model=str(checkpoint), dtype="float32", max_model_len=256, block_size=16)
    args |= dict(memory_gib=0.5, num_speculative_tokens=0, async_scheduling=False)
    return EngineCore(EngineArgs(**args | settings))


def test_a_v41_decode_forward_reads_nothing_on_the_host(v41_checkpoint):
    assert dict(decode_reads(v41_core(v41_checkpoint)).reads) == {}


def test_a_llama_decode_forward_reads_nothing_on_the_host(make_core):
    core = make_core(attention_backend="torch", num_speculative_tokens=0, async_scheduling=False)
    assert dict(decode_reads(core).reads) == {}


def test_a_llama_decode_graph_step_reads_nothing_on_the_host(make_core):
    """The fixed-size decode metadata of a graph step (what a CUDA graph would replay)."""
    core = make_core(num_speculative_tokens=0, async_scheduling=False)
    core.runner.decode_graphs = DecodeGraphs(capture_sizes(4), EagerReplay(), 16)
    reads = decode_reads(core)
    assert core.runner.decode_graphs.replay.replays > 0
    assert dict(reads.reads) == {}


def test_a_v41_decode_graph_step_reads_nothing_on_the_host(v41_checkpoint):
    """Its fixed-size plans (windows, compressed entries, tails) read as tensors."""
    core = v41_core(v41_checkpoint)
    core.runner.decode_graphs = DecodeGraphs(capture_sizes(4), EagerReplay(), 16)
    reads = decode_reads(core)
    assert core.runner.decode_graphs.replay.replays > 0
    assert dict(reads.reads) == {}


def test_the_expanded_experts_loop_is_seen_reading_its_counts(v41_checkpoint):
    reads = decode_reads(v41_core(v41_checkpoint, expand_weights=True)).reads
    assert {(where.split(":")[0], call) for where, call in reads} == {
        ("engine/models/deepseek_v41/moe.py", "bincount"),
        ("engine/models/deepseek_v41/moe.py", "tolist"),
    }


def test_a_packed_expert_bank_moves_with_its_module_tables_included(v41_checkpoint):
    core = v41_core(v41_checkpoint)
    moe = next(m for m in core.runner.model.modules() if isinstance(m, MoE))
    assert moe.packed_experts is not None
    moe.to("meta")
    bank = moe.packed_experts
    assert {t.device.type for t in (*bank.w1, *bank.w2_scale, *bank.tables)} == {"meta"}
    assert bank.w1[0] is moe.packed_w1_0
