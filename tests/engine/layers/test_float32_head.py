"""The bf16 output head's logits are the float32 sums of its products: never rounded to bf16,
within float32 accumulation error of the exact product, a row's bits its own whatever the
batch, on every kernel this machine runs (AMX tiles, AVX512_BF16 panels, the row-wise kernel)
and from GGUF blocks."""

import pytest
import torch
from torch import nn

from deepwell.engine.layers import bf16_gemm, float32_head
from deepwell.engine.layers.amx_linear import amx_kernel_ready
from deepwell.engine.layers.bf16_gemm import MAX_ROWS, panel_kernel_ready
from deepwell.engine.layers.float32_head import (
    Float32Head,
    can_take_float32_head,
    to_float32_head,
)
from deepwell.engine.layers.packed_linear import can_pack, pack_linears
from deepwell.engine.layers.quant_linear import load_kernel, quantize_q8_0, to_decode_linear
from deepwell.engine.llm import LLM
from deepwell.engine.sampling_params import SamplingParams

LAYOUTS = {
    "tiles": pytest.param(
        "tiles", marks=pytest.mark.skipif(not amx_kernel_ready(), reason="no AMX tiles here")
    ),
    "panels": pytest.param(
        "panels",
        marks=pytest.mark.skipif(
            not panel_kernel_ready(), reason="no AVX512_BF16 panel kernel here"
        ),
    ),
    "rows": "rows",
}


def head_on(layout: str, linear: nn.Linear, monkeypatch) -> Float32Head:
    """`linear` made a Float32Head on the kernel `layout` names."""
    monkeypatch.setattr(bf16_gemm, "onednn_uses_amx", lambda: layout == "tiles")
    monkeypatch.setattr(float32_head, "can_use_panels", lambda weight: layout == "panels")
    to_float32_head(linear)
    assert type(linear) is Float32Head
    assert (linear.tiles is not None, linear.panels is not None) == (
        layout == "tiles",
        layout == "panels",
    )
    return linear


def exact_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The exact product (float64) and a bound on float32 accumulation's error over it."""
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    return exact, x.shape[1] * 2.0**-23 * magnitude + 1e-30


@pytest.mark.parametrize("layout", LAYOUTS.values())
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_logits_are_the_unrounded_float32_sums_and_a_rows_bits_its_own(
    layout, with_bias, monkeypatch
):
    torch.manual_seed(3)
    # 1,000 outputs: neither a whole number of 16-output tiles nor of 32-output panels.
    linear = nn.Linear(576, 1000, bias=with_bias).to(torch.bfloat16)
    if with_bias:
        linear.bias.data = linear.bias.data.float()
    head = head_on(layout, linear, monkeypatch)
    # Past MAX_ROWS the panels go a call per MAX_ROWS rows.
    x = torch.randn(2 * MAX_ROWS + 3, 576)
    logits = head(x)
    rounded_x = x.bfloat16()
    assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], 1000)
    exact, bound = exact_bound(rounded_x, head.weight, head.bias)
    assert ((logits.double() - exact).abs() <= bound).all()
    # bf16's 8 bits would leave every logit on its grid: the sums mostly are not.
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9
    for rows in ([0], [5], list(range(7)), list(range(MAX_ROWS + 1))):
        assert torch.equal(head(x[rows]), logits[rows])
    # The model's dtype is bf16: a float32 input is rounded first, not multiplied as is.
    assert torch.equal(head(rounded_x), logits)


@pytest.mark.skipif(not can_pack(torch.empty(0, dtype=torch.bfloat16)), reason="no oneDNN bf16")
def test_a_packed_head_drops_onednns_copy_and_keeps_its_tied_weight():
    embedding = nn.Embedding(1000, 576).to(torch.bfloat16)
    model = nn.ModuleDict({"head": nn.Linear(576, 1000, bias=False).to(torch.bfloat16)})
    model["head"].weight = embedding.weight
    pack_linears(model)
    head = model["head"]
    assert can_take_float32_head(head)
    to_float32_head(head)
    assert "packed_weight" not in dict(head.named_buffers())
    assert head.weight is embedding.weight
    assert not can_take_float32_head(nn.Linear(576, 1000))  # float32: its logits already are


def test_a_head_on_gguf_blocks_keeps_the_block_kernels_sums_up_to_its_row_limit():
    torch.manual_seed(4)
    linear = nn.Linear(576, 1000, bias=False).to(torch.bfloat16)
    kernel = load_kernel()
    to_decode_linear(linear, quantize_q8_0(linear.weight), kernel)
    x = torch.randn(linear.max_rows, 576).bfloat16()
    rounded = linear(x)  # the block kernel's result in x's dtype, bf16
    quant_weight = linear.quant_weight
    to_float32_head(linear)
    assert linear.quant_weight is quant_weight and linear.kind == "Q8_0"
    logits = linear(x)
    # The block kernel quantises bf16 and their exact float32 widening alike: its float32
    # sums are what it rounded before, and mostly off bf16's grid.
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), rounded)
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9
    # Past the row limit the dense bf16 weight's float32 sums, a row's bits its own.
    more = torch.randn(linear.max_rows + 1, 576).bfloat16()
    exact, bound = exact_bound(more, linear.weight, None)
    assert ((linear(more).double() - exact).abs() <= bound).all()
    assert torch.equal(linear(more)[:3], linear(torch.cat([more[:3]] * 3))[:3])


@pytest.mark.parametrize(
    "options", [{}, {"quantization": "int4"}, {"batch_invariant": True}], ids=str
)
def test_the_embedded_models_bf16_head_gives_float32_sums(options):
    with LLM(None, dtype="bfloat16", **options) as llm:
        model = llm.core.runner.model
        head = model.lm_head
        assert type(head) is Float32Head
        assert head.weight is model.embed_tokens.weight
        hidden = torch.randn(9, model.config.hidden_size)
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        assert (logits != logits.bfloat16().float()).float().mean() > 0.9
        if head.quant_weight is None:
            exact, bound = exact_bound(hidden.bfloat16(), head.weight, None)
            assert ((logits.double() - exact).abs() <= bound).all()


def test_the_question_make_run_prints_is_answered_in_the_default_dtype_as_in_float32():
    """`make run` prints a curl line asking this. In bf16 (the default dtype where the CPU
    multiplies bf16 natively) with bf16-rounded logits its first token tied ("L" and "The"
    both -1.924 on the AMX Xeon) and the lower id began "L'Étoile, la Marseillaise"; the
    float32 sums keep "The" ahead (-1.883 against -1.972). (bf16 forced onto AVX2, not its
    default there, still flips it: its linears round elsewhere.)"""
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for dtype in ("auto", "float32"):
        with LLM(None, dtype=dtype) as llm:
            answer = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert answer.startswith("The capital of France is Paris"), (dtype, answer)
