"""Decode graphs: the capture sizes, padding, graph keys and static buffers, on the CPU through
the eager replay (the path CUDA graphs take, without the capture): padded static-buffer decode
gives the eager path's tokens on the embedded SmolLM2, the tiny Llama and a tiny V4.1; with
fixed-size decode metadata (paged full attention; V4.1's windows, compressed entries and
tails) a step's key is its padded batch size and model alone, so every later step of that
size replays."""

import dataclasses
import logging

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.decode_graphs import (
    DecodeGraphs,
    EagerReplay,
    GraphKey,
    GraphShapeError,
    capture_sizes,
    decode_graphs_for,
    padded_size,
    signature,
)
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.settings import environment

from .tiny_llama import run_to_completion


def test_capture_sizes_are_one_two_four_then_every_eight_up_to_the_batch_limit():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_a_batch_pads_to_the_smallest_size_holding_it_and_none_past_the_largest():
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 17, 20)] == [1, 4, 8, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None


def test_the_graph_key_holds_shapes_and_plain_values_not_tensor_contents():
    @dataclasses.dataclass
    class Plan:
        rows: torch.Tensor
        lens: list[int]

    step = (torch.arange(4), Plan(torch.zeros(2, 3), [5, 6]))
    same_shapes = (torch.arange(4) + 7, Plan(torch.ones(2, 3), [5, 6]))
    assert signature(step) == signature(same_shapes)
    assert signature(step) != signature((torch.arange(5), Plan(torch.zeros(2, 3), [5, 6])))
    assert signature(step) != signature((torch.arange(4), Plan(torch.zeros(2, 3), [5, 7])))
    assert signature(step) != signature((torch.arange(4.0), Plan(torch.zeros(2, 3), [5, 6])))


def test_eager_replay_reuses_a_keys_static_buffers_with_the_new_steps_values():
    replay = EagerReplay()
    seen = []

    def forward(ids, positions, meta):
        seen.append((ids.data_ptr(), ids.tolist(), meta["lens"].tolist()))
        return ids.float()

    graphs = DecodeGraphs([4], replay, max_blocks_per_seq=8)
    graphs.run(
        4, "m", (torch.arange(4), torch.arange(4), {"lens": torch.tensor([1])}), forward, True
    )
    step = (torch.arange(4) + 10, torch.arange(4), {"lens": torch.tensor([9])})
    graphs.run(4, "m", step, forward, True)
    assert seen[0][0] == seen[1][0]
    assert seen[1][1:] == ([10, 11, 12, 13], [9])
    assert list(replay.buffers) == [GraphKey(4, "m")] and replay.replays == 1


def test_a_step_whose_shapes_differ_from_its_keys_buffers_is_refused():
    graphs = DecodeGraphs([4], EagerReplay(), max_blocks_per_seq=8)
    graphs.run(4, "m", (torch.arange(4), torch.arange(4), torch.zeros(4, 8)), lambda *a: a[0], True)
    wider = (torch.arange(4), torch.arange(4), torch.zeros(4, 9))
    with pytest.raises(GraphShapeError, match="m x 4"):
        graphs.run(4, "m", wider, lambda *a: a[0], True)


def test_eager_replay_keeps_at_most_its_limit_of_graphs():
    replay = EagerReplay(max_graphs=2)
    for n in (1, 2, 3):
        replay.run(GraphKey(n, "m"), (torch.zeros(n), torch.zeros(n), None), lambda *a: a[0])
    assert [key.batch_size for key in replay.buffers] == [2, 3]


def test_graphs_are_off_on_the_cpu_and_with_enforce_eager_and_say_so(caplog):
    with caplog.at_level(logging.INFO, logger="deepwell.engine.decode_graphs"):
        assert decode_graphs_for(torch.device("cpu"), False, 64, False, 8) is None
        assert decode_graphs_for(torch.device("cuda"), True, 64, False, 8) is None
        assert decode_graphs_for(torch.device("cuda"), False, 64, True, 8) is None
    assert ["cpu" in caplog.messages[0], "--enforce-eager" in caplog.messages[1]] == [True, True]
    assert "expert-parallel" in caplog.messages[2]


def test_enforce_eager_is_a_setting_with_deepinfers_environment_switch():
    assert EngineArgs().enforce_eager is False
    assert environment.read("DEEPWELL_ENFORCE_EAGER", {"DEEPWELL_ENFORCE_EAGER": "1"}) is True
    assert environment.read("DEEPWELL_ENFORCE_EAGER", {"DEEPWELL_ENFORCE_EAGER": "0"}) is False


def _requests(core: EngineCore, lengths: list[int], run: str, prompt_len: int = 3) -> None:
    for index, max_tokens in enumerate(lengths):
        prompt = [(7 * index + 3 * k) % 90 + 5 for k in range(prompt_len + 2 * index)]
        # Different lengths: the batch shrinks through several capture sizes.
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        core.add_request(f"{run}{index}", prompt, params)


@dataclasses.dataclass
class GraphedRun:
    eager: list
    graphed: list
    keys: list[GraphKey]
    replays: int


def _eager_and_graphed(
    core: EngineCore, num_requests: int = 5, longest: int = 0, prompt_len: int = 3
) -> GraphedRun:
    """The same requests run eagerly, then padded through the eager replay, on one engine
    (no prefix cache: the second run computes what the first did). Outputs of 4, 6, 8, ...
    tokens, or with `longest` 4 apart up to it; prompts of `prompt_len`, 2 more each."""
    lengths = [
        longest - 4 * (num_requests - 1 - index) if longest else 4 + 2 * index
        for index in range(num_requests)
    ]
    _requests(core, lengths, "eager", prompt_len)
    eager = run_to_completion(core)
    replay = EagerReplay(max_graphs=1000)
    core.runner.decode_graphs = DecodeGraphs(capture_sizes(8), replay, max_blocks_per_seq=16)
    _requests(core, lengths, "graphed", prompt_len)
    graphed = run_to_completion(core)
    return GraphedRun(
        list(eager.values()), list(graphed.values()), list(replay.buffers), replay.replays
    )


def test_padded_static_buffer_decode_gives_the_eager_tokens_on_the_tiny_llama(make_core):
    core = make_core(num_speculative_tokens=0, enable_prefix_caching=False)
    run = _eager_and_graphed(core)
    assert run.graphed == run.eager
    # 5 decodes pad to 8, then the batch shrinks through 4, 2 and 1 as requests finish.
    assert {key.batch_size for key in run.keys} == {8, 4, 2, 1}


@pytest.mark.parametrize(
    "model", ["tiny_llama", "tiny_v41", pytest.param("embedded", marks=pytest.mark.slow)]
)
def test_32_decode_steps_replay_one_graph_per_capture_size(model, tiny_llama, request):
    """Fixed-size decode metadata: over 32 decode steps (outputs of 12 to 32 tokens) whose
    contexts grow across block boundaries and whose batch shrinks, the keys are the capture
    sizes used and nothing more, every later step of a size replays its buffers, and the
    tokens are eager's. The tiny V4.1's contexts (4 to 44 positions) cross its window of
    8, every ratio-2 group, its indexer's top-4 and its candidate pool's blocks."""
    args = dict(dtype="float32", max_model_len=256, block_size=16, memory_gib=1.0)
    args |= dict(num_speculative_tokens=0, enable_prefix_caching=False)
    if model == "tiny_llama":
        args["model"] = str(tiny_llama)
    elif model == "tiny_v41":
        args |= dict(model=str(request.getfixturevalue("v41_checkpoint")), memory_gib=0.5)
    run = _eager_and_graphed(EngineCore(EngineArgs(**args)), num_requests=6, longest=32)
    assert run.graphed == run.eager
    sizes = {key.batch_size for key in run.keys}
    assert sizes == {8, 4, 2, 1}
    assert len(run.keys) == len(sizes) and all(key.inputs == () for key in run.keys)
    # 32 decode steps (the longest request's), one first run per key, the rest replays.
    assert run.replays == 32 - 1 - len(sizes)


def test_padded_static_buffer_decode_gives_the_eager_tokens_on_the_embedded_smollm2():
    args = dict(batch_invariant=True, memory_gib=1.0, max_model_len=128, block_size=16)
    args |= dict(num_speculative_tokens=0, enable_prefix_caching=False)
    run = _eager_and_graphed(EngineCore(EngineArgs(**args)), 3)
    assert run.graphed == run.eager
    assert 4 in {key.batch_size for key in run.keys}


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def test_padded_static_buffer_decode_gives_the_eager_tokens_on_a_tiny_v41(v41_checkpoint):
    args = dict(model=str(v41_checkpoint), dtype="float32", max_model_len=256, block_size=16)
    args |= dict(num_speculative_tokens=0, memory_gib=0.5, enable_prefix_caching=False)
    run = _eager_and_graphed(EngineCore(EngineArgs(**args)))
    assert run.graphed == run.eager
    assert 8 in {key.batch_size for key in run.keys}


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_v41_decode_graphs_under_bounded_replay_give_the_eager_tokens(v41_checkpoint, mode):
    """Prompts past the keep of 20 tokens: the YOCO consumers' windows start at the replay
    start, a floor the fixed-size plans carry as data."""
    args = dict(model=str(v41_checkpoint), dtype="float32", max_model_len=256, block_size=16)
    args |= dict(num_speculative_tokens=0, memory_gib=0.5, enable_prefix_caching=False)
    args |= dict(yoco_prefill_truncation_mode=mode, yoco_prefill_keep_tokens=20)
    run = _eager_and_graphed(EngineCore(EngineArgs(**args)), 3, longest=12, prompt_len=36)
    assert run.graphed == run.eager
    assert run.replays > 0 and all(key.inputs == () for key in run.keys)


def _caches(core: EngineCore) -> dict[str, torch.Tensor]:
    kv = core.runner.kv_cache
    tensors = {f"{name}[{i}]": t for name, ts in kv.rings.items() for i, t in enumerate(ts)}
    return tensors | {f"{name}[{i}]": t for name, ts in kv.paged.items() for i, t in enumerate(ts)}


@pytest.mark.parametrize("speculative", ["none", "dspark"])
def test_a_v41_graphed_run_leaves_the_caches_an_eager_run_leaves(v41_checkpoint, speculative):
    """Every window ring, compressor tail, compressed entry and index key (and with DSpark
    the draft stages' context rings, which greedy verification would not show wrong) holds
    after a run through the graphs what it holds after an eager run, on two engines that
    give the requests the same slots and blocks."""
    args = dict(model=str(v41_checkpoint), dtype="float32", max_model_len=256, block_size=16)
    args |= dict(memory_gib=0.5, enable_prefix_caching=False, quantize_kv_cache=False)
    if speculative == "dspark":
        args["speculative_method"] = "dspark"
    else:
        args["num_speculative_tokens"] = 0
    eager, graphed = EngineCore(EngineArgs(**args)), EngineCore(EngineArgs(**args))
    replay = EagerReplay(max_graphs=1000)
    graphed.runner.decode_graphs = DecodeGraphs(capture_sizes(8), replay, max_blocks_per_seq=16)
    outputs = []
    for core in (eager, graphed):
        for tensor in _caches(core).values():
            tensor.zero_()
        _requests(core, [12, 8, 16], "r", prompt_len=5)
        outputs.append(run_to_completion(core))
    assert outputs[0] == outputs[1]
    assert replay.buffers and all(key.inputs == () for key in replay.buffers)
    eager_caches = _caches(eager)
    for name, tensor in _caches(graphed).items():
        torch.testing.assert_close(tensor, eager_caches[name], rtol=1e-5, atol=1e-5, msg=name)


def test_graphs_are_off_for_a_model_whose_step_reads_the_host_and_say_why(caplog):
    with caplog.at_level(logging.INFO, logger="deepwell.engine.decode_graphs"):
        assert decode_graphs_for(torch.device("cuda"), False, 64, False, 8, "a reason") is None
    assert "a reason" in caplog.messages[0]


def test_v41s_torch_expert_product_blocks_graphs_and_the_triton_set_lifts_it(v41_checkpoint):
    """On CUDA the packed experts' default product is the torch reference, which loops over
    the experts on the host: no graph can capture it, so the model says so; the Triton set's
    product reads nothing on the host."""
    from deepwell.engine.models.deepseek_v41.kernel_set import use_triton_kernels

    args = dict(model=str(v41_checkpoint), dtype="float32", max_model_len=64, block_size=16)
    core = EngineCore(EngineArgs(**args, num_speculative_tokens=0, memory_gib=0.25))
    model = core.runner.model
    assert "packed experts" in model.hooks().graph_blocker
    use_triton_kernels(model)
    assert model.hooks().graph_blocker is None
