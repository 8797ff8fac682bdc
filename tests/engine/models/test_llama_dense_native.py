"""The native decode step on dense weights (models/llama_native.py, layers/llama_dense_decode.cpp)
against the torch path from the same cache state: the same kernels in the same order, so the
hidden states are equal to the bit, for the embedded SmolLM2 in float32 and bf16 (oneDNN's
linears and the panel kernel's) at 1, 3, 17 and 64 rows and for a Qwen2 with its qkv bias;
and which models take it, the others saying why in the log."""

import logging

import pytest
import torch

from deepwell.engine import EngineArgs, EngineCore, SamplingParams
from deepwell.engine.layers import packed_linear
from deepwell.engine.layers.amx_linear import linears_on_tiles
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.batch_invariant import row_block_lists
from deepwell.engine.layers.bf16_gemm import can_use_panels
from deepwell.engine.layers.decode_kernel import load_llama_kernel
from deepwell.engine.layers.float32_linear import RowPaddedLinear
from deepwell.engine.layers.step_metadata import StepMetadata
from deepwell.engine.models.llama_native import DenseNativeDecode

from ..tiny_llama import run_to_completion
from .tiny_qwen import write_tiny_qwen

BLOCK_SIZE = 16
NATIVE_LOG = "deepwell.engine.models.llama_native"


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Built once per machine (cached). Only a machine without a compiler skips."""
    loaded = load_llama_kernel()
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"native decode kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason


def core(model: str | None = None, **kwargs) -> EngineCore:
    """An engine whose caches hold random keys and values (seeded)."""
    args = {
        "attention_backend": "cpp",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": 200,
        "max_num_seqs": 64,
        "max_model_len": 512,
        "num_speculative_tokens": 0,
    }
    engine = EngineCore(EngineArgs(model=model, **(args | kwargs)))
    gen = torch.Generator().manual_seed(0)
    paged = engine.runner.kv_cache.paged
    for cache in (*paged["key"], *paged["value"]):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return engine


def decode_step(rows: int, kv_cache, vocab: int, seed: int, invariant: bool = False):
    """A step of `rows` decode rows at contexts of 1-48 keys on random distinct blocks:
    (input ids, positions, step metadata); `invariant`: in the batch-invariant layout."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = kv_cache.paged["key"][0].shape[0]
    lens = torch.randint(1, 3 * BLOCK_SIZE + 1, (rows,), generator=gen).tolist()
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lens]
    block_ids = [b for table in tables for b in table]
    # Each row's new key goes to its last position, in its last block.
    meta = AttentionMetadata(
        slot_blocks=torch.tensor([table[-1] for table in tables]),
        slot_offsets=torch.tensor([(n - 1) % BLOCK_SIZE for n in lens]),
        num_decodes=rows,
        decode_context_lens=lens,
        decode_blocks=block_ids,
        block_size=BLOCK_SIZE,
        prefills=[],
    )
    if invariant:
        spans = [
            (row, n - 1, 1, table) for row, (n, table) in enumerate(zip(lens, tables, strict=True))
        ]
        meta.row_block_lists = row_block_lists(spans, BLOCK_SIZE)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    return ids, torch.tensor(lens) - 1, StepMetadata(sequences=[], paged=meta)


@torch.inference_mode()
def native_equals_torch_path(
    engine: EngineCore, rows: int, seed: int, invariant: bool = False
) -> bool:
    """One step through the torch path, then natively from the same cache state (both store
    the step's K/V in the same slots): whether the hidden states are equal to the bit."""
    model, kv_cache = engine.runner.model, engine.runner.kv_cache
    native = model.native_decode
    ids, positions, step = decode_step(rows, kv_cache, model.config.vocab_size, seed, invariant)
    assert isinstance(native, DenseNativeDecode) and native.takes(ids, step)
    model.native_decode = None
    expected = model(ids, positions, step, kv_cache)
    model.native_decode = native
    hidden = model(ids, positions, step, kv_cache)
    return torch.equal(hidden, expected)


@pytest.mark.parametrize(
    ("dtype", "linears"),
    [("float32", "plain"), ("bfloat16", "tiles"), ("bfloat16", "onednn"), ("bfloat16", "panels")],
    ids=["float32", "bf16-tiles", "bf16-onednn", "bf16-panels"],
)
def test_embedded_native_steps_equal_the_torch_path_to_the_bit(dtype, linears, monkeypatch, caplog):
    if linears == "tiles" and not linears_on_tiles():
        pytest.skip("the bf16 linears do not run on AMX tiles here")
    if linears in ("onednn", "panels"):
        # Without AMX tiles for oneDNN the linears take its packed weight and the panels;
        # capping its ISA name says so on an AMX CPU too (oneDNN itself read its cap at
        # start-up and keeps its tiles).
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    if linears == "panels" and not can_use_panels(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("the bf16 panel kernel does not run here (no AVX512_BF16 build)")
    if linears == "onednn":
        # oneDNN's linears at every row count, on CPUs where the panels would take the rows.
        monkeypatch.setattr(packed_linear, "can_use_panels", lambda weight: False)
    with caplog.at_level(logging.INFO, logger=NATIVE_LOG):
        engine = core(dtype=dtype)
    assert "decode step: native" in caplog.text and "dense weights" in caplog.text
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    if dtype == "bfloat16" and isinstance(qkv, packed_linear.PackedLinear):
        assert (qkv.tiles is not None) == (linears == "tiles")
        assert (qkv.panels is not None) == (linears == "panels")
    if linears == "tiles":
        # The MLP's activation in its gate_up's stores, on both paths.
        gate_up = engine.runner.model.layers[0].mlp.gate_up_proj
        assert type(gate_up) is packed_linear.SiluGateUpLinear
    if dtype == "float32" and torch.backends.mkl.is_available():
        # Its large linears pad calls of 10-15 rows to MKL's gemm size: the native step too.
        assert type(engine.runner.model.layers[0].mlp.gate_up_proj) is RowPaddedLinear
    # 64 rows: W's decode steps, at the panels' row limit; 65 past it (oneDNN's linears);
    # 12 among the rows float32's large linears pad.
    steps = (1, 3, 12, 17, 64, 65) if linears != "plain" else (1, 3, 12, 17, 64)
    assert all(native_equals_torch_path(engine, rows, seed) for seed, rows in enumerate(steps))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen2_native_steps_add_the_qkv_bias_to_the_bit(dtype, tmp_path):
    engine = core(str(write_tiny_qwen(tmp_path, "Qwen2ForCausalLM", seed=3)), dtype=dtype)
    assert engine.runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert all(
        native_equals_torch_path(engine, rows, seed) for seed, rows in enumerate((1, 3, 17, 64))
    )


def test_steps_with_prefills_run_the_torch_path(make_core):
    engine = make_core(attention_backend="cpp")
    model = engine.runner.model
    ids, positions, step = decode_step(3, engine.runner.kv_cache, 100, seed=0)
    assert model.native_decode.takes(ids, step)
    step.paged.num_decodes = 2
    assert not model.native_decode.takes(ids, step)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"native_decode": "off"}, "torch path (--native-decode off)"),
        ({"attention_backend": "torch"}, "decode attention is not on the C++ kernel"),
        (
            {"batch_invariant": True, "dtype": "float32"},
            "the batch-invariant linears are not on AMX tiles",
        ),
    ],
    ids=["off", "torch-backend", "batch-invariant"],
)
def test_models_that_do_not_take_the_native_step_say_why(kwargs, reason, make_core, caplog):
    with caplog.at_level(logging.INFO, logger=NATIVE_LOG):
        engine = make_core(**kwargs)
    assert engine.runner.model.native_decode is None
    assert reason in caplog.text


@pytest.mark.skipif(not linears_on_tiles(), reason="the bf16 linears do not run on AMX tiles here")
def test_batch_invariant_decode_steps_run_natively_with_the_layers_bits(caplog):
    with caplog.at_level(logging.INFO, logger=NATIVE_LOG):
        engine = core(dtype="bfloat16", batch_invariant=True)
    assert "decode step: native" in caplog.text
    native = engine.runner.model.native_decode
    assert all(
        native_equals_torch_path(engine, rows, seed, True) for seed, rows in enumerate((1, 17, 64))
    )
    # A prompt chunk's rows (or a draft's verify rows) share a sequence: the layers take them.
    ids, _, step = decode_step(3, engine.runner.kv_cache, 100, seed=0, invariant=True)
    lists = step.paged.row_block_lists
    lists.sequence_starts = torch.tensor([0, 2, 3])
    assert not native.takes(ids, step)


def test_qwen3_runs_the_torch_path_for_its_qk_norm(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=NATIVE_LOG):
        engine = core(str(write_tiny_qwen(tmp_path, "Qwen3ForCausalLM", seed=3)), dtype="bfloat16")
    assert engine.runner.model.native_decode is None
    assert "per-head q/k norm (Qwen3)" in caplog.text


def test_speculative_verify_rows_decode_natively_with_the_torch_paths_tokens(make_core):
    # Verify rows are decode rows of their sequence's blocks (paged_decode's sequence_starts):
    # the native step passes them as the layers do, so the drafts are accepted alike.
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 12, [3, 4] * 9]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs, verify_steps = [], []
    for native in ("auto", "off"):
        engine = make_core(attention_backend="cpp", native_decode=native, num_speculative_tokens=3)
        model = engine.runner.model
        if native == "auto":
            takes = model.native_decode.takes

            def counting_takes(input_ids, meta, takes=takes) -> bool:
                taken = takes(input_ids, meta)
                if taken and input_ids.shape[0] > len(meta.sequences):
                    verify_steps.append(input_ids.shape[0])
                return taken

            model.native_decode.takes = counting_takes
        for r, prompt in enumerate(prompts):
            engine.add_request(str(r), prompt, params)
        outputs.append(run_to_completion(engine))
    assert verify_steps and outputs[0] == outputs[1]
