"""`--device`: resolved once (engine/device.py), and every tensor a step makes is made there.

No GPU here: the checks run steps with the default device set to "meta", so a tensor created
without naming its device (a bare `torch.zeros(...)`) lands on meta and breaks the step; and
they prepare a step for a "meta" runner, whose every tensor must then be on meta.
"""

import dataclasses

import pytest
import torch

from deepwell import cli
from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.decode_graphs import DecodeGraphs, EagerReplay, capture_sizes
from deepwell.engine.device import DeviceError, memory_budget_gib, place, resolve_device
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint

from .tiny_llama import run_to_completion

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")


@no_cuda
def test_cuda_without_cuda_is_an_error_naming_what_is_missing():
    with pytest.raises(DeviceError, match=r"--device cuda: .*(without CUDA|sees no GPU)"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


@no_cuda
def test_generate_on_cuda_without_cuda_exits_with_a_message_not_a_traceback(tiny_llama, capsys):
    argv = ["generate", "--raw", "--model", str(tiny_llama), "Hi", "--device", "cuda"]
    argv += ["--attention-backend", "torch"]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert "--device cuda" in err and "Traceback" not in err


def _requests(core) -> None:
    prompts = [[5, 9, 13, 5, 9, 13, 5], [7] * 20, list(range(3, 40))]
    core.add_request("greedy", prompts[0], SamplingParams(max_tokens=8, temperature=0))
    core.add_request("seeded", prompts[1], SamplingParams(max_tokens=8, seed=7, top_k=20))
    core.add_request("nucleus", prompts[2], SamplingParams(max_tokens=8, seed=8, top_p=0.9))


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_steps_create_no_tensor_on_the_default_device(make_core, kernels):
    settings = {
        "kernels": kernels,
        "attention_backend": "torch",
        "async_scheduling": False,  # steps on this thread, where the default device is set
        "num_speculative_tokens": 3,
        "num_kv_blocks": 16,
        "max_model_len": 256,
    }
    core = make_core(**settings)
    _requests(core)
    expected = run_to_completion(core)
    core = make_core(**settings)
    _requests(core)
    with torch.device("meta"):
        assert run_to_completion(core) == expected


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41"), seed=0).path


def _v41_core(checkpoint, **settings):
    args = dict(model=str(checkpoint), dtype="float32", max_model_len=256, block_size=16)
    args |= dict(memory_gib=0.5, async_scheduling=False)
    return EngineCore(EngineArgs(**args | settings))


def test_v41_steps_with_dspark_drafts_create_no_tensor_on_the_default_device(v41_checkpoint):
    """The target's layers, its draft stages and the drafter."""
    core = _v41_core(v41_checkpoint, speculative_method="dspark")
    _requests(core)
    expected = run_to_completion(core)
    core = _v41_core(v41_checkpoint, speculative_method="dspark")
    _requests(core)
    with torch.device("meta"):
        assert run_to_completion(core) == expected


def _tensors(value, path="step"):
    """(path, tensor) of every tensor in a prepared step, cached properties included."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name), f"{path}.{field.name}")
        if isinstance(value, AttentionMetadata):
            derived = (
                "decode_block_ids",
                "decode_context_len_tensor",
                "decode_block_starts",
                "decode_block_rows",
                "decode_block_padding",
                "decode_sequence_starts",
            )
            for name in derived:
                yield f"{path}.{name}", getattr(value, name)
            yield f"{path}.decode_block_stacking", value.decode_block_stacking[0]
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{path}[{key!r}]")


def test_a_prepared_step_lives_on_the_runners_device(make_core):
    core = make_core(
        num_kv_blocks=16, max_model_len=256, async_scheduling=False, attention_backend="torch"
    )
    _requests(core)
    core.step()  # prefills; the next plan decodes beside them
    core.runner.device = torch.device("meta")
    step = core.runner.prepare(core.scheduler.schedule().chunks)
    tensors = dict(_tensors(dataclasses.replace(step, chunks=[], pending_rows=[])))
    assert len(tensors) > 10
    assert {path for path, t in tensors.items() if t.device.type != "meta"} == set()


def test_place_moves_nested_step_metadata_and_keeps_other_values():
    @dataclasses.dataclass
    class Plan:
        rows: torch.Tensor
        name: str

    placed = place({"plans": [Plan(torch.arange(3), "a")], "n": 2}, torch.device("meta"))
    assert placed["plans"][0].rows.device.type == "meta"
    assert placed["plans"][0].name == "a" and placed["n"] == 2


def test_the_cpu_budget_is_memory_gib_whatever_the_gpu_share():
    assert memory_budget_gib(3.5, 0.5, torch.device("cpu")) == 3.5


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_a_gpu_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        EngineArgs(gpu_memory_utilization=share)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_prepared_v41_step_lives_on_the_runners_device(v41_checkpoint, graphs):
    """Its window, compressed and tail plans, and with decode graphs their fixed-size form."""
    core = _v41_core(v41_checkpoint, num_speculative_tokens=0)
    if graphs:
        core.runner.decode_graphs = DecodeGraphs(capture_sizes(4), EagerReplay(), 16)
    _requests(core)
    core.step()  # prefills; the next plan decodes
    core.runner.device = torch.device("meta")
    step = core.runner.prepare(core.scheduler.schedule().chunks)
    assert (step.meta.fixed is not None) == graphs
    tensors = dict(_tensors(dataclasses.replace(step, chunks=[], pending_rows=[])))
    assert len(tensors) > 10
    assert {path for path, t in tensors.items() if t.device.type != "meta"} == set()
