"""GGUF-block decode linears (`--quantization int4`): the kernel on every instruction-set path
against the same quantised math in float64 (tight) and against float matmul of the
dequantised weights (bounded by the activations' rounding); GGUF blocks unpacked exactly; the
dense weights above the row cut-over; the engine's linears and head quantised from the
embedded GGUF's own blocks; and on the embedded model, logits within a bound of the
unquantised engine's and the smoke prompts' greedy answers unchanged."""

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from deepwell.engine import LLM, EngineArgs, SamplingParams, build
from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.decode_kernel import load_quant_kernel
from deepwell.engine.layers.float32_head import Float32Head
from deepwell.engine.layers.packed_linear import can_pack, pack_linears
from deepwell.engine.layers.quant_linear import (
    QUANT_MAX_ROWS,
    BlockWeight,
    QuantDecodeLinear,
    blocks_from_gguf,
    kernel_layout,
    quantize_q4_1,
    quantize_q8_0,
    to_decode_linear,
)
from deepwell.engine.models.gguf_reader import PlainArrayGGUFReader
from deepwell.engine.models.loader import GGUFBlocks, embedded_model_path, load_checkpoint

# What each forced path compiles to on a CPU that has AVX-512 VNNI, else AVX2 (the native
# build is the best one; a forced one never goes above what it names).
PATHS = ["native", "avx2", "scalar"]


@pytest.fixture(scope="module", params=PATHS)
def kernel(request):
    """Each path built once per machine (cached). Only a machine without a compiler skips;
    a build that fails on one is a failure."""
    loaded = load_quant_kernel(request.param)
    if loaded.module is None and loaded.reason.startswith("no "):
        pytest.skip(f"quantised linear kernel unavailable: {loaded.reason}")
    assert loaded.module is not None, loaded.reason
    if request.param != "native":
        assert loaded.module.instruction_set() in (request.param, "scalar")
    return loaded.module


def random_weight(kind: str, out_features: int, in_features: int, seed: int) -> BlockWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    weight[:, :32] += 0.3  # a block whose values share a sign: m far from 0
    return quantize_q4_1(weight) if kind == "Q4_1" else quantize_q8_0(weight)


def module_for(weight: BlockWeight, kernel, dtype: torch.dtype) -> QuantDecodeLinear:
    out_features, blocks, _ = weight.q.shape
    module = nn.Linear(blocks * 32, out_features, bias=False)
    module.weight.data.copy_(weight.dequantize())
    module.to(dtype)
    to_decode_linear(module, weight, kernel)
    return module


def same_math(kernel, weight: BlockWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's formula in float64 on its own activation quantisation: per block,
    d dx Σ q qx (+ m sx for Q4_1); and the sum of the magnitudes the kernel adds in float32
    (its VNNI path takes Q8_0's Σ q (qx + 128) and Σ q 128 apart)."""
    q_x, d_x, s_x = kernel.quantize_rows(x)
    blocks = weight.q.shape[1]
    q_x = q_x.view(x.shape[0], -1, 32)[:, :blocks].double()
    d_x, s_x = d_x[:, :blocks].double(), s_x[:, :blocks].double()
    q_w = weight.q.double()
    scales = weight.d.double() * d_x.unsqueeze(1)
    terms = scales * torch.einsum("obj,rbj->rob", q_w, q_x)
    magnitudes = scales.abs() * torch.einsum("obj,rbj->rob", q_w.abs(), q_x.abs() + 128)
    if weight.m is not None:
        offsets = weight.m.double() * s_x.unsqueeze(1)
        terms, magnitudes = terms + offsets, magnitudes + offsets.abs()
    return terms.sum(-1), magnitudes.sum(-1)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 5, QUANT_MAX_ROWS])
@pytest.mark.parametrize("in_features", [576, 608])  # 18 blocks, and 19
def test_kernel_is_the_quantised_math_of_llama_cpp(kernel, kind, rows, in_features):
    weight = random_weight(kind, 200, in_features, seed=rows)
    module = module_for(weight, kernel, torch.float32)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7))
    x[0, 40:72] = 0  # an all-zero activation block: dx = 0
    out = module(x).double()
    expected, magnitude = same_math(kernel, weight, x)
    # float32 sums of exact int32 dots: a few float32 roundings of the magnitudes.
    assert ((out - expected).abs() <= 1e-5 * magnitude + 1e-6).all()
    # Against float64 of the dequantised weight: off only by the activations' rounding,
    # at most half a step dx/2 per input, weighted by |w|.
    _, d_x, _ = kernel.quantize_rows(x)
    blocks = weight.q.shape[1]
    dense = weight.dequantize().double()
    step = d_x[:, :blocks].double().repeat_interleave(32, dim=1) / 2
    bound = step @ dense.abs().T
    assert ((out - x.double() @ dense.T).abs() <= bound * 1.001 + 1e-4).all()


def test_activation_quantisation_is_llama_cpp_q8_1(kernel):
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    q, d, s = kernel.quantize_rows(x)
    assert q.shape == (3, 96) and d.shape == (3, 3)
    blocks = x.view(3, 3, 32)
    scale = blocks.abs().amax(-1) / 127
    expected = torch.round(blocks * (1 / scale).unsqueeze(-1)).to(torch.int8)
    assert torch.equal(q.view(3, 3, 32), expected)
    assert torch.equal(d, scale)
    assert torch.equal(s, scale * expected.sum(-1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantisation_of_wide_rows_matches_torch_on_every_path(kernel, dtype):
    # The down projection's 1,536 inputs, two rows, an all-zero block (d = 0) and values
    # that land on .5 after scaling (ties to even): the vector paths round as torch.round.
    x = torch.randn(2, 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[1, 64:96] = 0
    x[0, 0] = 127  # d = 1: the halves below stay ties
    x[0, 1:32] = torch.arange(-15, 16).to(dtype) + 0.5
    q, d, s = kernel.quantize_rows(x)
    blocks = x.float().view(2, 48, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    expected = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8)
    assert torch.equal(q.view(2, 48, 32), expected)
    assert torch.equal(d, scale)
    assert torch.equal(s, scale * expected.sum(-1).float())
    assert d[1, 2] == 0 and (q[1, 64:96] == 0).all()


def test_bf16_activations_give_bf16_out_from_float32_sums(kernel):
    weight = random_weight("Q4_1", 64, 576, seed=3)
    x = torch.randn(2, 576).to(torch.bfloat16)
    out = module_for(weight, kernel, torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    expected, _ = same_math(kernel, weight, x)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)


def test_a_bias_is_added_to_the_kernel_rows(kernel):
    weight = random_weight("Q4_1", 64, 576, seed=4)
    plain = module_for(weight, kernel, torch.float32)
    biased = nn.Linear(576, 64)  # Qwen2's q/k/v carry biases
    biased.weight.data.copy_(weight.dequantize())
    to_decode_linear(biased, weight, kernel)
    x = torch.randn(3, 576)
    assert torch.equal(biased(x), plain(x) + biased.bias)


def read_tile_layout(packed: torch.Tensor, kind: str, out_features: int, blocks: int):
    """q, d and the third field (m or Σq) of every output and block, read byte by byte at
    the positions quant_gemv.cpp's header documents."""
    quant_bytes, block_bytes = (256, 320) if kind == "Q4_1" else (512, 576)
    data = packed.view(packed.shape[0], blocks, block_bytes)
    q = torch.zeros(out_features, blocks, 32, dtype=torch.int64)
    for i in range(32):
        group, j = divmod(i, 4)
        for o in range(16):
            if kind == "Q4_1":
                byte = data[:, :, 64 * (group % 4) + 4 * o + j].long()
                values = (byte >> (4 * (group // 4))) & 0x0F
            else:
                values = data[:, :, 64 * group + 4 * o + j].view(torch.int8).long()
            q[o::16, :, i] = values[: len(range(o, out_features, 16))]
    scales = data[:, :, quant_bytes:].contiguous().view(torch.int16).view(-1, blocks, 2, 16)
    fields = scales.permute(2, 0, 3, 1).reshape(2, -1, blocks)[:, :out_features]
    return q, fields[0].view(torch.float16).float(), fields[1]


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(64, 576), (200, 608), (7, 32)])
def test_the_tile_layout_holds_each_blocks_values_and_zero_padding(kind, shape):
    weight = random_weight(kind, *shape, seed=11)
    packed = kernel_layout(weight)
    tiles = -(-shape[0] // 16)
    assert packed.shape == (tiles, shape[1] // 32 * (320 if kind == "Q4_1" else 576))
    q, d, third = read_tile_layout(packed, kind, tiles * 16, shape[1] // 32)
    out = shape[0]
    assert torch.equal(q[:out], weight.q.long()) and torch.equal(d[:out], weight.d)
    if kind == "Q4_1":
        assert torch.equal(third[:out].view(torch.float16).float(), weight.m)
    else:
        assert torch.equal(third[:out].long(), weight.q.long().sum(-1))
    # The padding rows of the last tile are zero weights.
    assert not q[out:].any() and not d[out:].any() and not third[out:].any()


@pytest.mark.parametrize("out_features", [1, 15, 17])
def test_outputs_beyond_the_last_tiles_real_rows_are_not_written(kernel, out_features):
    weight = random_weight("Q4_1", out_features, 64, seed=12)
    module = module_for(weight, kernel, torch.float32)
    x = torch.randn(2, 64)
    expected, magnitude = same_math(kernel, weight, x)
    out = module(x)
    assert out.shape == (2, out_features)
    assert ((out.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_calls_above_the_cut_over_run_the_dense_weights(kind):
    kernel = load_quant_kernel().module
    if kernel is None:
        pytest.skip("quantised linear kernel unavailable")
    dtype = torch.bfloat16 if can_pack(torch.empty(0, dtype=torch.bfloat16)) else torch.float32
    weight = random_weight(kind, 96, 576, seed=5)
    model = nn.Sequential(nn.Linear(576, 96, bias=False)).to(dtype)
    model[0].weight.data.copy_(weight.dequantize())
    reference = nn.Sequential(nn.Linear(576, 96, bias=False)).to(dtype)
    reference[0].weight.data.copy_(model[0].weight)
    pack_linears(model)
    pack_linears(reference)
    to_decode_linear(model[0], weight, kernel)
    assert model[0].max_rows == QUANT_MAX_ROWS
    for rows in (QUANT_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 576).to(dtype)
        assert torch.equal(model[0](x), reference[0](x)), rows


@pytest.fixture(scope="module")
def embedded_reader():
    return PlainArrayGGUFReader(embedded_model_path())


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight"])
def test_gguf_blocks_unpack_to_what_gguf_dequantises(embedded_reader, name):
    tensor = next(t for t in embedded_reader.tensors if t.name == name)
    blocks = GGUFBlocks(tensor.tensor_type.name, torch.from_numpy(np.array(tensor.data)))
    unpacked = blocks_from_gguf(blocks)
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert torch.equal(unpacked.dequantize(), torch.from_numpy(np.asarray(expected)))


def test_the_embedded_checkpoint_keeps_its_blocks_permuted_like_its_values():
    checkpoint = load_checkpoint(None)
    kinds = {name: b.kind for name, b in checkpoint.blocks.items()}
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert len(kinds) == 1 + 7 * checkpoint.hf_config["num_hidden_layers"]
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
    ):
        dequantized = blocks_from_gguf(checkpoint.blocks[name]).dequantize()
        assert torch.equal(dequantized, checkpoint.tensors[name]), name


def test_int4_load_refuses_blocks_that_are_not_the_loaded_weight(monkeypatch):
    # Layer 5's k and v blocks swapped: the same shape and kind, so only the load's check of
    # the blocks against the float weight (a sample of rows) can tell.
    real_checkpoint = build._checkpoint

    def swapped(*args):
        checkpoint = real_checkpoint(*args)
        k, v = (f"model.layers.5.self_attn.{p}_proj.weight" for p in "kv")
        checkpoint.blocks[k], checkpoint.blocks[v] = checkpoint.blocks[v], checkpoint.blocks[k]
        return checkpoint

    args = EngineArgs(quantization="int4", dtype="float32", num_kv_blocks=8)
    monkeypatch.setattr(build, "_checkpoint", swapped)
    with pytest.raises(ModelLoadError, match=r"layers\.5\.self_attn\.qkv_proj: .* do not match"):
        build.load_model(args)
    monkeypatch.setattr(build, "_checkpoint", real_checkpoint)
    assert build.load_model(args).model.layers[5].self_attn.qkv_proj.kind == "Q4_1"


def test_int4_refuses_batch_invariance_and_takes_float32():
    with pytest.raises(ValueError, match="int4 quantization cannot run batch-invariant"):
        EngineArgs(quantization="int4", dtype="bfloat16", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")
    assert EngineArgs(quantization="int4", dtype="float32").quantization == "int4"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_core_quantizes_layers_q4_1_and_the_head_q8_0(make_core, dtype):
    core = make_core(dtype=dtype, quantization="int4")
    model = core.runner.model
    # A bf16 head keeps its blocks inside a Float32Head (float32 sums, not rounded).
    head = QuantDecodeLinear if dtype == "float32" else Float32Head
    assert type(model.lm_head) is head and model.lm_head.kind == "Q8_0"
    layers = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert layers and all(type(m) is QuantDecodeLinear and m.kind == "Q4_1" for m in layers)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    tokens = []
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert len(tokens) == 4


# The embedded model's chat smoke prompts (the CLI's and the parity test's).
SMOKE = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
]
PROMPTS = [
    "The history of the Roman Empire begins",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "In 1969, the first humans",
    "import numpy as np\n\nx = np.",
    "The three laws of thermodynamics state that",
    *SMOKE,
]


def embedded(**kwargs) -> LLM:
    # Steps of 2 tokens: a prompt is prefilled 2 rows at a time, so every linear call of
    # the int4 engine takes the kernel, as a batch-1 decode does. Attention on the torch
    # path for every engine here, so that only the linears differ: the haiku's 13th token
    # is a near-tie that bf16-rounded computations take one way and float32-accurate ones
    # the other (docs/benchmarks.md, int4 lever).
    return LLM(
        attention_backend="torch",
        max_num_seqs=1,
        max_num_batched_tokens=2,
        num_kv_blocks=8,
        max_model_len=512,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        **kwargs,
        decode_sequence=False,
        chunked_prefill=True,
    )


def next_token_logprobs(llm: LLM) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=10)
    completions = llm.generate(PROMPTS, params, use_tqdm=False)
    return [dict(c.logprobs[0].top) for c in completions]


def distance(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Largest logprob difference over the tokens both rank in their top 10."""
    return max(abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x.keys() & y.keys())


@pytest.mark.slow
def test_embedded_int4_logits_within_bound_and_smoke_answers_unchanged():
    runs = {}
    for name, kwargs in {
        "float32": {"dtype": "float32"},
        "bf16": {"dtype": "bfloat16"},
        "int4": {"dtype": "bfloat16", "quantization": "int4"},
        "int4 float32": {"dtype": "float32", "quantization": "int4"},
    }.items():
        llm = embedded(**kwargs)
        runs[name] = next_token_logprobs(llm)
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        runs[name + " smoke"] = [c.token_ids for c in llm.generate(SMOKE, greedy, use_tqdm=False)]
        del llm
    bf16_error = distance(runs["bf16"], runs["float32"])
    errors = {name: distance(runs[name], runs["float32"]) for name in ("int4", "int4 float32")}
    # Measured: 0.45 nats (bf16 engine) and 0.37 (float32) from float32, bf16 itself 0.16;
    # the same with the head left dense, so the layers' 8-bit activations (llama.cpp's
    # q8_1 rounding) make it, not the head. A wrong block or scale moves logits by whole nats.
    assert all(error <= 4 * bf16_error for error in errors.values()), (errors, bf16_error)
    top1 = [max(r, key=r.get) for r in runs["float32"]]
    for name in ("int4", "int4 float32"):
        assert [max(r, key=r.get) for r in runs[name]] == top1, name
    # The haiku's 13th token is a near-tie (0.09 nats in float32, 0.04 with int4) that
    # every 8-bit or bf16 rounding of the activations, and the kernel's float order, can
    # take either way (see `embedded`): int4 equals its engine dtype's answers up to it,
    # and on the other prompt throughout.
    for name, reference in (("int4 smoke", "bf16 smoke"), ("int4 float32 smoke", "float32 smoke")):
        france, haiku = runs[name]
        assert france == runs[reference][0], name
        assert haiku[:12] == runs[reference][1][:12], name
