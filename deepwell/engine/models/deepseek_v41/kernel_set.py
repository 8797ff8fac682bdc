"""V4.1's kernel set: with `--kernels triton` its sink attention, indexer top-k, FP8-block
linears and MXFP4 experts run engine X's Triton kernels (layers/triton/), chosen once as the
model is built and bound; everything else stays torch.

The Triton modules are imported only here, when the set is asked for: Triton decides when a
kernel is decorated whether its interpreter runs it (TRITON_INTERPRET), and a missing Triton
is then an error naming the fix (`require_triton`), never a silent fallback.
"""

import logging

from torch import nn

from deepwell.engine.errors import ModelLoadError
from deepwell.engine.layers.sink_attention import SinkAttentionBackend
from deepwell.engine.layers.triton import require_triton
from deepwell.engine.models.deepseek_v41.attention import Indexer
from deepwell.engine.models.deepseek_v41.moe import MoE
from deepwell.engine.models.deepseek_v41.packed_modules import Fp8BlockLinear

logger = logging.getLogger(__name__)

TRITON = "triton"


def sink_backend_class(
    kernels: str, default: type[SinkAttentionBackend], batch_invariant: bool
) -> type[SinkAttentionBackend]:
    """The attention backend the kernel set runs: Triton's, or `default` for "auto"."""
    if kernels != TRITON:
        return default
    if batch_invariant:
        raise ModelLoadError(
            "batch-invariant mode runs its own fixed-tile kernels; "
            "--kernels triton cannot run beside it (use --kernels auto)"
        )
    require_triton()
    from deepwell.engine.layers.triton.sink_attention import TritonSinkAttention

    return TritonSinkAttention


def use_triton_kernels(model: nn.Module) -> None:
    """Point a bound model's FP8-block linears, packed experts and indexers at the Triton
    kernels (expanded weights are plain linears and stay torch)."""
    require_triton()
    from deepwell.engine.layers.triton.fp8_block_gemm import fp8_block_gemm
    from deepwell.engine.layers.triton.indexer_topk import top_k_ids
    from deepwell.engine.layers.triton.mxfp4_experts import mxfp4_expert_gemm

    for module in model.modules():
        if isinstance(module, Fp8BlockLinear):
            module.product = fp8_block_gemm
        elif isinstance(module, MoE):
            module.packed_product = mxfp4_expert_gemm
        elif isinstance(module, Indexer):
            module.top_ids = top_k_ids
    logger.info(
        "DeepSeek-V4.1 kernels: Triton sink attention, indexer top-k, FP8-block GEMM and "
        "MXFP4 expert GEMM"
    )
