"""nemo-automodel 0.7.0's DeepSeek-V4.1 as a CPU test oracle (spec/deepseek_v41.md §1).

Builds the tiny config of §1.3 on the CPU backend of §1.2, loads weights under the released
checkpoint names through nemo's own state-dict adapter, and runs full-recompute forwards.
Test-only: deepwell itself never imports nemo or transformers. Run it as a script for a
smoke check (`--help`).
"""

from __future__ import annotations

import os

# nemo compiles its expert activation with Inductor at first call (seconds per shape on
# CPU, and g++ needed); eager gives the same math (spec §1.2 item 2). Set before torch
# loads dynamo's config, and forced below in case it already had.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import (  # noqa: E402
    attention as nemo_attention,
)
from nemo_automodel.components.models.deepseek_v41 import dspark as nemo_dspark  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.model import (  # noqa: E402
    DeepseekV41ForCausalLM,
)
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from deepwell.engine.models.deepseek_v41.writer import TINY_TEXT_CONFIG  # noqa: E402

torch._dynamo.config.disable = True

# spec §1.2 item 1: nemo's default backend wants TileLang/CUDA kernels.
CPU_BACKEND = BackendConfig(
    attn="eager",
    linear="torch",
    rms_norm="torch_fp32",
    rope="torch",
    rope_fusion=False,
    experts="torch",
    dispatcher="torch",
    gate_precision="float32",
    enable_hf_state_dict_adapter=True,
)

# The modules that imported nemo's cache quantize-dequantize under this name.
_QUANTIZING_MODULES = (nemo_attention, nemo_dspark)


def tiny_text_config() -> dict[str, Any]:
    """The smallest V4.1 text config with every layer kind (spec §1.3), for `tiny_tokenizer`.

    Layers: 0 window-only + Engram; 1 ratio-2 KV/index source; 2 Reuse; 3 ratio-2 source +
    Engram; 4 ratio-1 source + candidate pool; 5 Reuse; 6 Reindex; 7 Reuse. 8-10 are the
    DSpark stages. Window 8, top-4 and a 3x4 pool all drop entries at S=32; 16 index heads
    keep relu from zeroing every head (exact score ties).
    """
    return dict(TINY_TEXT_CONFIG, dtype="float32")


def tiny_tokenizer() -> Tokenizer:
    """A 256-id WordLevel tokenizer whose Engram normalisation gives 128 classes.

    Besides case pairs (w7 / W7 -> one class) it holds each normalisation rule once:
    whitespace-only tokens (one class, " "), accents and case (e é E É), NFKC (ﬁ = fi),
    surrounding spaces (" w0" = w0), U+FFFD (kept raw) and a lone combining accent
    (normalises to nothing, kept as decoded). 0-2 are the special <s> </s> <pad>.
    """
    words = [" ", "\t", "\n", "  ", "e", "é", "E", "É", "ﬁ", "fi", "\ufffd", "a\ufffd", "\u0301"]
    for k in range(119):
        words += [f"w{k}", f"W{k}"]
    words += [" w0", "  w1  "]
    specials = ["<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return tokenizer


def build_oracle(
    text_config: Mapping[str, Any],
    tokenizer: Tokenizer,
    released_tensors: Mapping[str, torch.Tensor] | None,
    *,
    quantize_cache: bool,
    seed: int = 0,
    vision_config: Mapping[str, Any] | None = None,
    image_token_id: int | None = None,
) -> DeepseekV41ForCausalLM:
    """nemo's DeepseekV41ForCausalLM in fp32 on CPU, in eval mode.

    released_tensors: float32 tensors under the released checkpoint names (spec §3.8),
    loaded through nemo's state-dict adapter so the name mapping is nemo's; every model
    tensor must be given (`mtp.*` is ignored: the draft is a separate model). Without them
    the weights are nemo's initializer under `seed`.
    quantize_cache=False turns nemo's cache quantize-dequantize into the identity for this
    model's forwards, to check wiring tightly (spec §1.4 (a)).
    """
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    with warnings.catch_warnings(), torch.random.fork_rng():
        # The released config.json spells it rope_scaling (spec §3.8); transformers prefers
        # rope_parameters and says so each time it builds or copies the config.
        warnings.filterwarnings("ignore", "`rope_scaling` is deprecated", FutureWarning)
        config = DeepseekV41Config(
            text_config=dict(text_config),
            vision_config=dict(vision_config or {"num_hidden_layers": 0}),
            dtype="float32",
            pad_token_id=text_config["pad_token_id"],
            **({} if image_token_id is None else {"image_token_id": image_token_id}),
        )
        torch.manual_seed(seed)
        model = DeepseekV41ForCausalLM(config, backend=CPU_BACKEND, tokenizer=fast)
        # GroupedExperts allocates torch.empty; the default dtype would cast to bf16.
        model.initialize_weights(dtype=torch.float32)
    if released_tensors is not None:
        native = model.state_dict_adapter.from_hf(dict(released_tensors))
        model.load_state_dict(native, strict=True)
    if not quantize_cache:
        _skip_cache_quantization(model)
    return model.eval()


def released_state_dict(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights as float32 tensors under released names (nemo's adapter, unquantized)."""
    released = model.state_dict_adapter.to_hf(model.state_dict(), quantization=False)
    return {
        name: tensor.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
        for name, tensor in released.items()
    }


def random_released_weights(
    text_config: Mapping[str, Any], tokenizer: Tokenizer, seed: int
) -> dict[str, torch.Tensor]:
    """Random weights under released names, with no tensor left at an initializer constant.

    nemo's initializer leaves norm weights at 1, mHC base/scale at 0/1, sinks and the gate
    correction bias at 0 and the Engram q/k weights at 1; each would hide a wiring bug, so
    they are randomised here (spec §1.3). `ffn.gate.bias_vl` (image tokens only) stays 0.
    """
    model = build_oracle(text_config, tokenizer, None, quantize_cache=True, seed=seed)
    generator = torch.Generator().manual_seed(seed)

    def uniform(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(t.shape, generator=generator)

    def normal(t: torch.Tensor, std: float) -> torch.Tensor:
        return std * torch.randn(t.shape, generator=generator)

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "_hc.scale", "engram.q_weight", "engram.k_weight")):
                tensor.copy_(uniform(tensor, 0.5, 1.5))
            elif name.endswith("_hc.base"):
                tensor.copy_(normal(tensor, 0.5))
            elif name.endswith("sinks_param.weight"):
                tensor.copy_(normal(tensor, 1.0))
            elif name.endswith("e_score_correction_bias"):
                # Router scores sqrt(softplus(.)) sit near 0.83 and differ by a few 1e-2;
                # a bias of that size moves some selections without deciding all of them.
                tensor.copy_(normal(tensor, 0.03))
    return released_state_dict(model)


def oracle_logits(model: DeepseekV41ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V] float32 logits of a full forward over zero-based positions."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}")
    with torch.no_grad():
        return model(input_ids.long()).logits.float()


def oracle_image_logits(
    model: DeepseekV41ForCausalLM,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_hws: torch.Tensor,
    vision_token_types: torch.Tensor,
) -> torch.Tensor:
    """[B, S, V] float32 logits with images: pixel_values [patches, 3, p, p] as the processor
    gives them (bf16), grids [images, 2], types [B, S] (-1 text, 0-3 image span)."""
    with torch.no_grad():
        return model(
            input_ids.long(),
            pixel_values=pixel_values,
            image_grid_hws=image_grid_hws,
            vision_token_types=vision_token_types,
        ).logits.float()


def greedy_recompute(
    model: DeepseekV41ForCausalLM, input_ids: torch.Tensor, n: int
) -> torch.Tensor:
    """[B, n] greedy continuation, recomputing the whole prefix per token (nemo has no cache).

    Ties pick the lowest token id (torch.argmax).
    """
    sequence = input_ids.long()
    for _ in range(n):
        next_ids = oracle_logits(model, sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_ids], dim=1)
    return sequence[:, input_ids.shape[1] :]


def _skip_cache_quantization(model: DeepseekV41ForCausalLM) -> None:
    """Make quantize_cache the identity while this model runs a forward.

    nemo's modules call the name they imported, so it is swapped there for the duration of
    the forward only; other models in the process keep quantizing.
    """
    saved: list[tuple[Any, Any]] = []

    def identity(values: torch.Tensor, **_: Any) -> torch.Tensor:
        return values.clone()

    def swap_in(module: torch.nn.Module, args: Any) -> None:
        for nemo_module in _QUANTIZING_MODULES:
            saved.append((nemo_module, nemo_module.quantize_cache))
            nemo_module.quantize_cache = identity

    def swap_back(module: torch.nn.Module, args: Any, output: Any) -> None:
        while saved:
            nemo_module, original = saved.pop()
            nemo_module.quantize_cache = original

    model.register_forward_pre_hook(swap_in)
    model.register_forward_hook(swap_back, always_call=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="weights and input ids")
    parser.add_argument("--no-quant", action="store_true", help="cache QDQ as identity")
    parser.add_argument("--generate", type=int, default=8, help="greedy tokens after S/2")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config, tokenizer = tiny_text_config(), tiny_tokenizer()
    start = time.perf_counter()
    weights = random_released_weights(config, tokenizer, args.seed)
    model = build_oracle(config, tokenizer, weights, quantize_cache=not args.no_quant)
    print(f"built from {len(weights)} released tensors in {time.perf_counter() - start:.2f}s")
    ids = torch.randint(
        config["vocab_size"],
        (args.batch, args.seq_len),
        generator=torch.Generator().manual_seed(args.seed),
    )
    start = time.perf_counter()
    logits = oracle_logits(model, ids)
    print(
        f"forward {tuple(ids.shape)} -> {tuple(logits.shape)} in {time.perf_counter() - start:.3f}s"
    )
    print(f"logits sum={logits.sum():.6f} abs_sum={logits.abs().sum():.6f}")
    worst = max(
        (oracle_logits(model, ids[:, :length]) - logits[:, :length]).abs().max().item()
        for length in range(1, args.seq_len)
    )
    print(f"prefix consistency: max |diff| = {worst:.2e}")
    prompt = ids[:, : args.seq_len // 2]
    print(f"greedy recompute: {greedy_recompute(model, prompt, args.generate).tolist()}")


if __name__ == "__main__":
    main()
