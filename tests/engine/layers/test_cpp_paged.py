"""The fused C++ paged-attention decode against exact attention and the torch path: random
block tables, ragged contexts, GQA ratios, bf16 and float32 caches; in the engine, the same
tokens as the torch path, the fallback where no compiler exists, and the switch."""

import dataclasses
import platform
import shutil
from pathlib import Path

import pytest
import torch

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.layers import cpp_paged, decode_kernel
from deepwell.engine.layers.attention import AttentionMetadata
from deepwell.engine.layers.batch_invariant import BatchInvariantAttention
from deepwell.engine.layers.cpp_paged import CppPagedAttention
from deepwell.engine.layers.decode_kernel import load_decode_kernel
from deepwell.engine.layers.torch_paged import TorchPagedAttention
from deepwell.serve.messages import WorkerConfig
from deepwell.serve.worker import EngineCoreAdapter

from ..tiny_llama import run_to_completion
from .avx2_rerun import rerun_at_avx2


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Built once per machine (cached), loaded once per session. Only a machine without a
    compiler skips; a build that fails on one is a failure."""
    loaded = load_decode_kernel()
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"decode attention kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason
    return loaded.module


def decode_case(lens, block_size, num_blocks, kv_heads, dim, dtype, seed, shared=False):
    """Caches and metadata of decode rows with the given contexts, each on random distinct
    blocks of the pool (when `shared`, a verify-like run of rows on the same blocks, each row
    on its predecessor's)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    values = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    tables, free = [], torch.randperm(num_blocks, generator=gen).tolist()
    for i, length in enumerate(lens):
        count = -(-length // block_size)
        if shared and i:
            # The previous row's blocks, extended with fresh ones past its last.
            extra = max(0, count - len(tables[-1]))
            tables.append(tables[-1][:count] + [free.pop() for _ in range(extra)])
        else:
            tables.append([free.pop() for _ in range(count)])
    block_ids = [b for t in tables for b in t]
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_context_lens=list(lens),
        decode_blocks=block_ids,
        block_size=block_size,
        prefills=[],
    )
    return keys, values, tables, meta


def exact_attention(q, keys, values, tables, lens):
    """float64 attention of each row over its own context, from the same (rounded) inputs."""
    heads, group = q.shape[1], q.shape[1] // keys.shape[1]
    out = []
    for row, (table, length) in enumerate(zip(tables, lens, strict=True)):
        k = keys[table].transpose(0, 1).flatten(1, 2)[:, :length].double()
        v = values[table].transpose(0, 1).flatten(1, 2)[:, :length].double()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q[row].double().unsqueeze(1) @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
        out.append((scores.softmax(-1) @ v).view(heads, -1))
    return torch.stack(out)


CASES = [
    # lens, block_size, heads, kv_heads, head_dim
    pytest.param([1, 5, 17, 32, 33, 100], 16, 4, 2, 64, id="ragged-gqa2"),
    pytest.param([300, 129, 128, 7, 1, 450, 255], 128, 9, 3, 64, id="smollm2-shapes"),
    pytest.param([40, 63, 2], 16, 8, 1, 128, id="mqa-dim128"),
    pytest.param([70, 3, 19], 32, 8, 8, 32, id="mha"),
    pytest.param([50, 22, 81], 16, 16, 2, 48, id="group8-partial-chunk"),
    pytest.param([9, 60], 8, 6, 2, 16, id="dim16-tiny-llama"),
]


def kernel_decode(q, keys, values, meta, portable: bool) -> torch.Tensor:
    """The kernel's decode, on its AVX-512 score loop where this CPU has it, or portable."""
    backend = CppPagedAttention(q.shape[1], keys.shape[1], q.shape[2])
    return backend.kernel.paged_decode(
        q,
        keys,
        values,
        meta.decode_block_ids,
        meta.decode_block_starts,
        meta.decode_context_len_tensor,
        meta.decode_sequence_starts,
        backend.scale,
        portable,
    )


@pytest.mark.parametrize(("lens", "block_size", "heads", "kv_heads", "dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_kernel_matches_exact_attention_and_the_torch_path(
    lens, block_size, heads, kv_heads, dim, dtype, portable
):
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    keys, values, tables, meta = decode_case(
        lens, block_size, num_blocks, kv_heads, dim, dtype, seed=len(lens) * dim
    )
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel_decode(q, keys, values, meta, portable)
    assert out.dtype == dtype and out.shape == q.shape
    exact = exact_attention(q, keys, values, tables, lens)
    # float32 accumulation throughout: float32 within float rounding; bf16 within the
    # output's own rounding (2^-8 relative).
    tight = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=tight, atol=tight)
    reference = TorchPagedAttention(heads, kv_heads, dim)._decode(q, keys, values, meta)
    # The torch path rounds scores and weights to bf16 on a bf16 cache.
    loose = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out, reference, rtol=loose, atol=loose)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_rows_sharing_blocks_and_strided_queries(dtype, portable):
    """A draft's verify rows read the same blocks at growing lengths; q is a view into the
    fused q/k projection, heads strided past the k heads."""
    lens = [200, 201, 202, 203, 5, 6]
    keys, values, tables, meta = decode_case(lens, 64, 20, 3, 64, dtype, seed=3, shared=True)
    assert tables[0] == tables[1][: len(tables[0])]
    fused = torch.randn(len(lens), 9 + 3, 64, generator=torch.Generator().manual_seed(2))
    q = fused.to(dtype)[:, :9]
    assert not q.is_contiguous()
    out = kernel_decode(q, keys, values, meta, portable)
    tight = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    exact = exact_attention(q, keys, values, tables, lens)
    torch.testing.assert_close(out.double(), exact, rtol=tight, atol=tight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_a_sequences_rows_read_together_give_each_rows_own_bits(dtype, portable):
    """A draft's verify rows go through the kernel as one sequence (blocks outer, rows
    inner), across a block boundary too: each row's output is bit for bit the one it gets as
    its own sequence, and exact attention within rounding."""
    lens = [126, 127, 128, 129, 130, 40, 7, 8, 9]
    keys, values, tables, meta = decode_case(lens, 64, 20, 3, 64, dtype, seed=8, shared=True)
    assert tables[4][:2] == tables[0] and len(tables[4]) == 3
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    alone = kernel_decode(q, keys, values, meta, portable)
    grouped = dataclasses.replace(meta, decode_sequence_rows=[5, 1, 3])
    together = kernel_decode(q, keys, values, grouped, portable)
    assert torch.equal(together, alone)
    tight = {torch.float32: 2e-6, torch.bfloat16: 8e-3}[dtype]
    exact = exact_attention(q, keys, values, tables, lens)
    torch.testing.assert_close(together.double(), exact, rtol=tight, atol=tight)


def test_a_row_does_not_depend_on_its_batch():
    """Each row is one task over its own blocks in a fixed order: its bits are the same
    alone as beside other rows."""
    lens = [77, 300, 12, 129]
    keys, values, tables, meta = decode_case(lens, 32, 30, 2, 64, torch.bfloat16, seed=5)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    backend = CppPagedAttention(6, 2, 64)
    together = backend._decode(q, keys, values, meta)
    for row in range(4):
        alone = AttentionMetadata(
            **{
                **{f: getattr(meta, f) for f in meta.__dataclass_fields__},
                "num_decodes": 1,
                "decode_context_lens": [lens[row]],
                "decode_blocks": tables[row],
            }
        )
        assert torch.equal(backend._decode(q[row : row + 1], keys, values, alone)[0], together[row])


def test_vector_machines_run_a_fast_score_loop(kernel):
    """Where torch dispatches AVX-512, the native cases above are the AVX-512 loop (bf16
    where the CPU has AVX512_BF16); where it dispatches AVX2, the AVX2 loop (head_dim in
    whole 16s), so every loop is covered."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    capability = torch.backends.cpu.get_cpu_capability()
    avx512, avx2 = capability == "AVX512", capability == "AVX2"
    assert kernel.fast_scores(False, 64) == (avx512 or avx2)
    assert kernel.fast_scores(True, 64) == (avx512 and "avx512_bf16" in flags or avx2)
    assert kernel.fast_scores(False, 48) == (avx512 or avx2)
    assert kernel.fast_scores(True, 48) == avx2
    assert not kernel.fast_scores(False, 40) and not kernel.fast_scores(True, 40)


@pytest.mark.parametrize(("lens", "block_size", "heads", "kv_heads", "dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_avx2_score_loop_and_value_pass_keep_the_portable_loops_bits(
    kernel, lens, block_size, heads, kv_heads, dim, dtype
):
    """The AVX2 loops score 8 keys at once and weigh values 32 dims at a time, but sum in
    the portable loops' order: the same bits, rows read together as one sequence too (so
    W's float32 tokens under AVX2 stay as they were)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("the AVX2 score loop runs where torch dispatches AVX2 (the rerun below)")
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    keys, values, tables, meta = decode_case(
        lens, block_size, num_blocks, kv_heads, dim, dtype, seed=len(lens) + dim, shared=True
    )
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(9)).to(dtype)
    together = dataclasses.replace(meta, decode_sequence_rows=[len(lens)])
    for case in (meta, together):
        native = kernel_decode(q, keys, values, case, portable=False)
        assert torch.equal(native, kernel_decode(q, keys, values, case, portable=True))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's AVX2 level")
def test_the_score_loops_with_torch_forced_to_avx2():
    """The loop checks in a process whose torch (and so the kernel's build) runs at AVX2."""
    run = rerun_at_avx2(__file__, "avx2_score_loop or fast_score_loop or exact_attention")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_bad_shapes_are_refused_with_a_message(kernel):
    q = torch.randn(2, 4, 16)
    cache = torch.randn(3, 2, 8, 16)
    ids, starts, lens = torch.tensor([0, 1]), torch.tensor([0, 1, 2]), torch.tensor([3, 5])
    seqs = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.paged_decode(
            q, cache.bfloat16(), cache.bfloat16(), ids, starts, lens, seqs, 0.25, False
        )
    with pytest.raises(RuntimeError, match="one block start per row"):
        kernel.paged_decode(q, cache, cache, ids, starts[:2], lens, seqs, 0.25, False)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel.paged_decode(
            q,
            cache[..., :8].contiguous(),
            cache[..., :8].contiguous(),
            ids,
            starts,
            lens,
            seqs,
            0.25,
            False,
        )
    assert (
        kernel.paged_decode(q, cache, cache, ids, starts, lens, seqs, 0.25, False).shape == q.shape
    )
    with pytest.raises(RuntimeError, match="block id 3 is out of the cache"):
        kernel.paged_decode(q, cache, cache, torch.tensor([0, 3]), starts, lens, seqs, 0.25, False)
    with pytest.raises(RuntimeError, match="row 1: context length 9 needs 2 blocks, it has 1"):
        kernel.paged_decode(q, cache, cache, ids, starts, torch.tensor([3, 9]), seqs, 0.25, False)
    with pytest.raises(RuntimeError, match="block_starts must run from 0"):
        kernel.paged_decode(q, cache, cache, ids, torch.tensor([0, 1, 1]), lens, seqs, 0.25, False)
    with pytest.raises(RuntimeError, match="sequence_starts must run from 0"):
        kernel.paged_decode(q, cache, cache, ids, starts, lens, torch.tensor([0, 1]), 0.25, False)
    with pytest.raises(RuntimeError, match="sequence 0 has no rows"):
        kernel.paged_decode(
            q, cache, cache, ids, starts, lens, torch.tensor([0, 0, 2]), 0.25, False
        )
    grouped = torch.tensor([0, 2])
    assert (
        kernel.paged_decode(q, cache, cache, ids, starts, lens, grouped, 0.25, False).shape
        == q.shape
    )


def backends(core) -> set[type]:
    return {type(layer.self_attn.backend) for layer in core.runner.model.layers}


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "speculative"])
def test_engine_tokens_are_the_same_on_the_kernel_and_the_torch_path(make_core, k):
    """float32 tiny Llama, batched decodes beside chunked prefills, and (speculative) a
    draft's verify rows sharing blocks: the same greedy tokens on both paths."""
    prompts = {f"r{i}": [(7 * i + 5 * j) % 300 + 3 for j in range(3 + 29 * i)] for i in range(6)}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for choice in ("torch", "cpp"):
        core = make_core(
            attention_backend=choice,
            num_speculative_tokens=k,
            block_size=8,
            max_num_batched_tokens=40,
        )
        assert backends(core) == {{"torch": TorchPagedAttention, "cpp": CppPagedAttention}[choice]}
        for key, prompt in prompts.items():
            core.add_request(key, prompt, params)
        tokens[choice] = run_to_completion(core)
    assert tokens["cpp"] == tokens["torch"]


def test_auto_decodes_on_the_torch_path_where_the_kernel_cannot_build(monkeypatch, make_core):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    missing = load_decode_kernel.__wrapped__()
    assert missing.module is None and "no C++ compiler" in missing.reason
    monkeypatch.setattr(cpp_paged, "load_decode_kernel", lambda: missing)
    cpp_paged._decode_kernel.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="--attention-backend cpp: .*no C\\+\\+ compiler"):
            make_core(attention_backend="cpp")
        core = make_core(attention_backend="auto")
        assert all(layer.self_attn.backend.kernel is None for layer in core.runner.model.layers)
        core.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0))
        assert len(run_to_completion(core)["a"]) == 5
    finally:
        cpp_paged._decode_kernel.cache_clear()


def test_a_kernel_source_missing_from_the_install_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    # What a wheel without the shared header ships: the loader falls back with a reason.
    monkeypatch.setattr(decode_kernel, "HEADER", tmp_path / "kernel_parts.h")
    missing = load_decode_kernel.__wrapped__()
    assert missing.module is None
    assert missing.reason == "its source is not installed (kernel_parts.h)"


def test_batch_invariant_mode_keeps_its_own_kernels(make_core):
    core = make_core(attention_backend="cpp", batch_invariant=True)
    assert backends(core) == {BatchInvariantAttention}


# The embedded model's chat smoke prompts (the CLI's and the parity tests').
SMOKE = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.mark.slow
def test_embedded_smoke_answers_unchanged_in_float32_and_closer_to_it_in_bf16():
    """SmolLM2 (9 heads over 3 KV heads), the smoke prompts decoded together (batched rows)
    and one at a time: in float32 the kernel's greedy answers are the torch path's; in bf16
    they stay with float32's at least as long as the torch path's do (measured: all 48
    tokens of both, where the torch path's haiku leaves float32's at token 12, its scores
    and weights rounded to bf16)."""
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    answers = {}
    for dtype in ("float32", "bfloat16"):
        for choice in ("torch", "cpp"):
            for seqs in (1, 2):
                llm = LLM(
                    dtype=dtype,
                    attention_backend=choice,
                    max_num_seqs=seqs,
                    num_kv_blocks=8,
                    max_model_len=512,
                    num_speculative_tokens=0,
                    decode_sequence=False,
                )
                answers[dtype, choice, seqs] = [
                    c.token_ids for c in llm.generate(SMOKE, greedy, use_tqdm=False)
                ]
                del llm
    for seqs in (1, 2):
        assert answers["float32", "cpp", seqs] == answers["float32", "torch", seqs]
        exact = answers["float32", "torch", seqs]
        for prompt, reference in enumerate(exact):
            kernel = agreeing_prefix(answers["bfloat16", "cpp", seqs][prompt], reference)
            torch_path = agreeing_prefix(answers["bfloat16", "torch", seqs][prompt], reference)
            assert kernel >= torch_path, (seqs, prompt, kernel, torch_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_store_puts_rows_where_indexed_assignment_does(kernel, dtype):
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(6, 3, 8, 32, generator=gen).to(dtype)
    fused = torch.randn(10, 9, 32, generator=gen).to(dtype)
    k, v = fused[:, 3:6], fused[:, 6:]  # strided views, as the model's k and v are
    slots = torch.randperm(6 * 8, generator=gen)[:10]
    blocks, offsets = slots // 8, slots % 8
    expected_keys, expected_values = cache.clone(), cache.clone()
    expected_keys[blocks, :, offsets] = k
    expected_values[blocks, :, offsets] = v
    keys, values = cache.clone(), cache.clone()
    kernel.paged_store(k, v, keys, values, blocks, offsets)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        kernel.paged_store(k, v, keys, values, blocks + 6, offsets)


def test_serve_workers_take_the_switch(tiny_llama, monkeypatch):
    """`serve --attention-backend` reaches the worker's engine; without it the launcher's
    DEEPWELL_ATTENTION_BACKEND decides, as for EngineArgs anywhere."""

    def config(**settings) -> WorkerConfig:
        engine = EngineArgs(
            model=str(tiny_llama), max_num_seqs=4, memory_gib=0.25, dtype="float32", block_size=16
        )
        return WorkerConfig(0, 0, "", "", dataclasses.replace(engine, **settings))

    worker = EngineCoreAdapter(config(attention_backend="torch"))
    assert backends(worker._core) == {TorchPagedAttention}
    monkeypatch.setenv("DEEPWELL_ATTENTION_BACKEND", "torch")
    assert backends(EngineCoreAdapter(config())._core) == {TorchPagedAttention}
    monkeypatch.delenv("DEEPWELL_ATTENTION_BACKEND")
    assert backends(EngineCoreAdapter(config())._core) == {CppPagedAttention}


def test_the_ninja_wheel_is_found_without_an_activated_environment(tmp_path, monkeypatch):
    # A PATH with a compiler and no ninja, as `.venv/bin/deepwell` sees it unactivated on a
    # machine without ninja-build: the dependency's binary beside the interpreter serves.
    (tmp_path / "c++").symlink_to(shutil.which("c++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert decode_kernel._missing_tool() is None
