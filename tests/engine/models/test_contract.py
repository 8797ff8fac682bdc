"""The model contract (models/contract.py): every registered model satisfies it, a Llama-like
architecture joins with one class and its registry line, and generic engine code reaches
models only through it."""

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.engine.models import registry
from deepwell.engine.models.contract import CausalLM, ModelHooks
from deepwell.engine.models.deepseek_v41.writer import write_tiny_checkpoint
from deepwell.engine.models.llama import LlamaConfig, LlamaForCausalLM
from deepwell.engine.models.loader import load_checkpoint
from deepwell.engine.models.registry import ModelEntry, ModelOptions, build_model

from ..tiny_llama import run_to_completion, write_tiny_llama
from .tiny_qwen import write_tiny_qwen

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "deepwell" / "engine"

# A tiny checkpoint of every registered architecture.
WRITERS = {
    "LlamaForCausalLM": write_tiny_llama,
    "Qwen2ForCausalLM": lambda path: write_tiny_qwen(path, "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": lambda path: write_tiny_qwen(path, "Qwen3ForCausalLM"),
    "DeepseekV41ForCausalLM": lambda path: write_tiny_checkpoint(path, seed=0).path,
}


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B from v0.2 on: Llama's layers under Mistral's config names. A sliding
    window would need a ring cache, so a config with one is refused."""

    @classmethod
    def read_config(cls, hf) -> LlamaConfig:
        if hf.get("sliding_window") is not None:
            raise ModelLoadError(
                f"Mistral with sliding_window {hf['sliding_window']} is not supported"
            )
        return LlamaConfig.from_hf(hf)


@pytest.fixture
def mistral(monkeypatch):
    """The registry with Mistral's line added."""
    entry = ModelEntry("MistralForCausalLM", MistralForCausalLM)
    monkeypatch.setitem(registry.MODELS, entry.name, entry)


def with_architecture(source: Path, target: Path, architecture: str, **config) -> Path:
    shutil.copytree(source, target)
    config_path = target / "config.json"
    hf = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(hf | {"architectures": [architecture]} | config))
    return target


@pytest.mark.parametrize("architecture", sorted(registry.MODELS))
def test_every_registered_model_satisfies_the_contract(architecture, tmp_path):
    path = WRITERS[architecture](tmp_path / "checkpoint")
    checkpoint = load_checkpoint(str(path))
    model = build_model(
        checkpoint, ModelOptions(dtype=torch.float32, backend_class=TorchPagedAttention)
    )
    assert checkpoint.architecture == architecture
    assert isinstance(model, registry.MODELS[architecture].model_class)
    assert isinstance(model, CausalLM)
    assert isinstance(model.hooks(), ModelHooks)


def test_every_registered_architecture_has_a_tiny_checkpoint_here():
    assert set(WRITERS) == set(registry.MODELS)


def test_the_shipped_architectures_are_planned_and_run():
    for entry in registry.MODELS.values():
        assert entry.architecture.name == entry.name
        assert entry.architecture.footprint is not None
        assert entry.architecture.engine_runs


def test_an_object_without_hooks_is_not_a_causal_lm():
    class Bare(torch.nn.Module):
        def forward(self, input_ids, positions, meta, kv_cache):
            return input_ids

    assert not isinstance(Bare(), CausalLM)


def test_hooks_name_each_models_optional_parts(tiny_llama, tmp_path):
    options = ModelOptions(dtype=torch.float32, backend_class=TorchPagedAttention)
    llama = build_model(load_checkpoint(str(tiny_llama)), options)
    hooks = llama.hooks()
    assert hooks.output_head is llama.lm_head
    assert hooks.native_decode is not None
    assert hooks.routed_experts is hooks.context_parallel is hooks.draft_stages is None
    assert not hooks.invariant_rings

    v41 = build_model(load_checkpoint(str(WRITERS["DeepseekV41ForCausalLM"](tmp_path))), options)
    hooks = v41.hooks()
    assert hooks.invariant_rings and hooks.context_parallel is not None
    assert hooks.native_decode is None and hooks.draft_stages is None  # built without DSpark
    experts = hooks.routed_experts
    assert len(experts.layers) == len(v41.layers)
    assert experts.is_expert_tensor("layers.3.ffn.experts.7.w1.weight")
    assert not experts.is_expert_tensor("layers.3.ffn.shared_experts.w1.weight")


def test_a_llama_like_architecture_runs_from_its_registry_line(mistral, tiny_llama, tmp_path):
    mistral_path = with_architecture(
        tiny_llama, tmp_path / "mistral", "MistralForCausalLM", sliding_window=None
    )
    prompts = {"a": [5, 9, 14, 3, 77, 21], "b": [40, 41, 42]}
    tokens = {}
    for name, path in (("llama", tiny_llama), ("mistral", mistral_path)):
        core = EngineCore(
            EngineArgs(
                model=str(path),
                dtype="float32",
                attention_backend="torch",
                block_size=16,
                memory_gib=0.25,
            )
        )
        assert type(core.runner.model).__name__ == f"{name.capitalize()}ForCausalLM"
        for request_id, prompt in prompts.items():
            core.add_request(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0))
        tokens[name] = run_to_completion(core)
        core.close()
    assert core.architecture == "MistralForCausalLM"
    assert all(len(t) == 6 for t in tokens["mistral"].values())
    # The same weights under Llama's layers: the same tokens.
    assert tokens["mistral"] == tokens["llama"]


def test_the_new_architectures_own_config_rules_apply(mistral, tiny_llama, tmp_path):
    path = with_architecture(tiny_llama, tmp_path / "swa", "MistralForCausalLM", sliding_window=64)
    with pytest.raises(ModelLoadError, match="sliding_window 64 is not supported"):
        EngineCore(
            EngineArgs(model=str(path), dtype="float32", attention_backend="torch", memory_gib=0.25)
        )


def test_an_unregistered_architecture_is_refused_by_name(tiny_llama, tmp_path):
    path = with_architecture(tiny_llama, tmp_path / "mistral", "MistralForCausalLM")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'MistralForCausalLM'"):
        EngineCore(
            EngineArgs(model=str(path), dtype="float32", attention_backend="torch", memory_gib=0.25)
        )


def test_deepseek_v4_is_refused_as_prompt_encoding_only(tiny_llama, tmp_path):
    path = with_architecture(tiny_llama, tmp_path / "v4", "DeepseekV4ForCausalLM")
    with pytest.raises(ModelLoadError, match="known for its prompt encoding only"):
        EngineCore(
            EngineArgs(model=str(path), dtype="float32", attention_backend="torch", memory_gib=0.25)
        )


# --- generic code names no model ---

# The engine's modules that run every model: they reach one through models/contract.py.
GENERIC = [
    ENGINE / "build.py",
    ENGINE / "core.py",
    ENGINE / "runner.py",
    ENGINE / "step_rows.py",
    ENGINE / "scheduler.py",
    ENGINE / "plan" / "memory.py",
    *sorted((ENGINE / "parallel").glob("*.py")),
]
# What generic code may import from engine/models/: the contract, registries and loaders.
MODEL_INTERFACES = {
    "deepwell.engine.models.contract",
    "deepwell.engine.models.registry",
    "deepwell.engine.models.architectures",
    "deepwell.engine.models.loader",
}
MODEL_CLASS = re.compile(r"\w+ForCausalLM$")


def model_references(source: str) -> list[str]:
    """Each import of a concrete model module and each model class named, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [alias.name for alias in node.names], []
        else:
            modules, names = [], []
        for module in modules:
            if module.startswith("deepwell.engine.models.") and not any(
                module == allowed or module.startswith(f"{allowed}.")
                for allowed in MODEL_INTERFACES
            ):
                found.append(f"imports {module}")
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.append(node.value)
        found += [f"names {name}" for name in names if MODEL_CLASS.match(name)]
    return found


@pytest.mark.parametrize("path", GENERIC, ids=lambda path: str(path.relative_to(ENGINE)))
def test_generic_engine_code_names_no_model(path):
    assert model_references(path.read_text()) == []


def test_the_scan_finds_a_model_named_in_generic_code():
    source = (
        "from deepwell.engine.models.llama import LlamaForCausalLM\n"
        "import deepwell.engine.models.deepseek_v41.model\n"
        "from deepwell.engine.models.registry import build_model\n"
        "ok = isinstance(model, LlamaForCausalLM) or arch == 'DeepseekV41ForCausalLM'\n"
    )
    assert sorted(set(model_references(source))) == [
        "imports deepwell.engine.models.deepseek_v41.model",
        "imports deepwell.engine.models.llama",
        "imports deepwell.engine.models.llama.LlamaForCausalLM",
        "names DeepseekV41ForCausalLM",
        "names LlamaForCausalLM",
    ]
