"""int4 decode linears (`--quantization int4`): the packed bf16 result above INT4_MAX_ROWS
rows, 4-bit weights below it, exact on weights that already are Q4_1 groups, and on the
embedded SmolLM2 (whose layers are Q4_1) logits within a bound of bf16's and the smoke
prompts' greedy answers unchanged."""

import pytest
import torch
from torch import nn

from deepwell.engine import LLM, EngineArgs, SamplingParams
from deepwell.engine.layers.int4_linear import (
    GROUP_SIZE,
    INT4_MAX_ROWS,
    Int4DecodeLinear,
    quantize_int4,
    quantize_linears,
)
from deepwell.engine.layers.packed_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="oneDNN bf16 is unavailable"
)


def q4_1_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight made the way GGUF's Q4_1 stores one: d * q + m per group of 32 inputs."""
    groups = (out_features, in_features // GROUP_SIZE)
    scale = torch.rand(groups) * 0.01 + 0.001
    low = -8 * scale + torch.randn(groups) * 0.002
    q = torch.randint(0, 16, (*groups, GROUP_SIZE))
    q[..., 0], q[..., 1] = 0, 15  # the quantiser puts the group's min at 0, its max at 15
    weight = q * scale.unsqueeze(-1) + low.unsqueeze(-1)
    return weight.view(out_features, in_features), q.view(out_features, in_features)


def test_quantize_int4_recovers_q4_1_groups_from_their_bf16_values():
    torch.manual_seed(0)
    weight, stored = q4_1_weight(96, 576)
    q, scales_zeros = quantize_int4(weight.to(torch.bfloat16))
    assert q.dtype == torch.int32 and torch.equal(q, stored.to(torch.int32))
    scale = scales_zeros[..., 0].float().T.repeat_interleave(GROUP_SIZE, dim=1)
    zero = scales_zeros[..., 1].float().T.repeat_interleave(GROUP_SIZE, dim=1)
    rebuilt = (q - 8) * scale + zero
    # Only the bf16 rounding of the weights and of each group's scale and offset is lost:
    # about one bf16 step of the largest weights.
    assert (rebuilt - weight).abs().max() <= weight.abs().max() * 2**-7


@pytest.mark.parametrize("features", [(576, 960), (1536, 576)])
@torch.no_grad()
def test_int4_rows_up_to_the_limit_and_packed_bf16_above_it(features):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*features, bias=False)).to(torch.bfloat16)
    model[0].weight.copy_(q4_1_weight(features[1], features[0])[0])
    pack_linears(model)
    reference = nn.Sequential(nn.Linear(*features, bias=False)).to(torch.bfloat16)
    reference[0].weight.copy_(model[0].weight)
    pack_linears(reference)
    assert quantize_linears(model) == 1 and type(model[0]) is Int4DecodeLinear
    for rows in (1, 2, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64):
        x = torch.randn(rows, features[0]).to(torch.bfloat16)
        out, expected = model[0](x), reference[0](x)
        if rows > INT4_MAX_ROWS:
            assert torch.equal(out, expected), rows
        else:
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_quantize_linears_keeps_what_it_is_told_and_odd_widths():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(40, 8))
    model.to(torch.bfloat16)
    pack_linears(model)
    assert quantize_linears(model, keep=(model[1],)) == 1
    assert [type(m) for m in model] == [Int4DecodeLinear, PackedLinear, PackedLinear]


@pytest.mark.parametrize(
    "kwargs", [{"dtype": "float32"}, {"dtype": "bfloat16", "batch_invariant": True}]
)
def test_int4_needs_bf16_without_batch_invariance(kwargs):
    with pytest.raises(ValueError, match="int4 quantization needs"):
        EngineArgs(quantization="int4", **kwargs)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")


def test_the_core_quantizes_layer_linears_but_not_the_head(make_core):
    core = make_core(dtype="bfloat16", quantization="int4")
    model = core.runner.model
    assert type(model.lm_head) is PackedLinear
    layers = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    assert layers and all(type(m) is Int4DecodeLinear for m in layers)
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
    # the int4 engine takes its int4 path, as a batch-1 decode does. Attention on the torch
    # path for every engine here, so that only the linears differ: the haiku's 13th token
    # is a near-tie that bf16-rounded computations (int4 weights, the torch path's bf16
    # scores) take one way and float32-accurate ones (float32, bf16 with the C++ decode
    # kernel's float32 softmax) the other (docs/benchmarks.md, int4 lever).
    return LLM(
        attention_backend="torch",
        max_num_seqs=1,
        max_num_batched_tokens=2,
        num_kv_blocks=8,
        max_model_len=512,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        **kwargs,
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
    }.items():
        llm = embedded(**kwargs)
        runs[name] = next_token_logprobs(llm)
        if name != "float32":
            greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            runs[name + " smoke"] = [
                c.token_ids for c in llm.generate(SMOKE, greedy, use_tqdm=False)
            ]
        del llm
    bf16_error = distance(runs["bf16"], runs["float32"])
    int4_error = distance(runs["int4"], runs["bf16"])
    # Measured: 0.29 nats from bf16 (bf16 itself 0.16 from float32; per-channel int8, the
    # dropped alternative, 0.67). int4 must stay within 3x bf16's own error.
    assert int4_error <= 3 * bf16_error, (int4_error, bf16_error)
    top1 = [max(r, key=r.get) for r in runs["int4"]]
    assert top1 == [max(r, key=r.get) for r in runs["float32"]]
    assert runs["int4 smoke"] == runs["bf16 smoke"]
